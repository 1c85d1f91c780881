package idle

import (
	"fmt"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/events"
)

// The clocks judge by the stream's time: an edge's clock being off, or a
// beacon forged under an edge's name (edges share one NATS identity),
// must not make a busy user look idle.
func TestClocksTrustTheStreamAndOnlyMoveForward(t *testing.T) {
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	beacon := func(edge string, inFlight int, lastActive, sentAt time.Time) events.Beacon {
		return events.Beacon{User: "ann", Edge: edge, InFlight: inFlight, LastActive: lastActive, SentAt: sentAt, TTL: 3 * time.Second}
	}
	tests := []struct {
		name     string
		beacons  []events.Beacon
		stamped  []time.Time
		at       time.Time
		wantLast time.Time
		wantBusy bool
		// wantUntil is BusyUntil: the busy beacon's stream time and TTL.
		wantUntil time.Time
	}{{
		name:     "an edge's last activity counts back from the stream's time",
		beacons:  []events.Beacon{beacon("a", 0, t0.Add(-10*time.Second), t0)},
		stamped:  []time.Time{t0.Add(time.Second)},
		at:       t0.Add(2 * time.Second),
		wantLast: t0.Add(-9 * time.Second),
	}, {
		name:     "an edge whose clock is 30s behind changes nothing",
		beacons:  []events.Beacon{beacon("a", 0, t0.Add(-40*time.Second), t0.Add(-30*time.Second))},
		stamped:  []time.Time{t0},
		at:       t0.Add(time.Second),
		wantLast: t0.Add(-10 * time.Second),
	}, {
		name:      "an edge whose clock is 30s ahead changes nothing",
		beacons:   []events.Beacon{beacon("a", 1, t0.Add(20*time.Second), t0.Add(30*time.Second))},
		stamped:   []time.Time{t0},
		at:        t0.Add(time.Second),
		wantLast:  t0,
		wantBusy:  true,
		wantUntil: t0.Add(3 * time.Second),
	}, {
		name: "a forged idle beacon under a busy edge's name moves nothing back",
		beacons: []events.Beacon{
			beacon("a", 1, t0.Add(-time.Second), t0),
			beacon("a", 0, t0.Add(-time.Hour), t0),
		},
		stamped:  []time.Time{t0, t0.Add(time.Second)},
		at:       t0.Add(2 * time.Second),
		wantLast: t0,
	}, {
		name: "a forged TTL pins the sandbox five minutes at most",
		beacons: []events.Beacon{
			{User: "ann", Edge: "a", InFlight: 1, LastActive: t0, SentAt: t0, TTL: 1000 * time.Hour},
		},
		stamped:  []time.Time{t0},
		at:       t0.Add(events.MaxBeaconTTL + time.Second),
		wantLast: t0,
	}, {
		name: "the newest of several edges wins",
		beacons: []events.Beacon{
			beacon("a", 0, t0.Add(-time.Minute), t0),
			beacon("b", 0, t0.Add(-time.Second), t0),
		},
		stamped:  []time.Time{t0, t0},
		at:       t0,
		wantLast: t0.Add(-time.Second),
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := NewClocks()
			for i, b := range tt.beacons {
				c.Observe(b, uint64(i+1), tt.stamped[i])
			}
			v := c.View("ann", tt.at)
			if !v.Last.Equal(tt.wantLast) || v.Busy != tt.wantBusy || !v.BusyUntil.Equal(tt.wantUntil) {
				t.Fatalf("view = last %s busy %v until %s, want last %s busy %v until %s", v.Last, v.Busy, v.BusyUntil, tt.wantLast, tt.wantBusy, tt.wantUntil)
			}
			if v.Seq != uint64(len(tt.beacons)) {
				t.Fatalf("seq %d", v.Seq)
			}
		})
	}
}

// The table the admin view shows: per edge the newest beacon, its time
// taken from the stream (an edge's clock 30 s off changes nothing), and
// work in flight only while its beacon's TTL runs.
func TestLoadPerSender(t *testing.T) {
	a := NewClocks()
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	skew := 30 * time.Second
	beacon := func(edge string, inFlight int, idle time.Duration, clockOff time.Duration) events.Beacon {
		sent := t0.Add(clockOff)
		return events.Beacon{User: "ann", Edge: edge, InFlight: inFlight, LastActive: sent.Add(-idle), SentAt: sent, TTL: 10 * time.Second}
	}
	a.Observe(beacon("edge-a", 2, 0, skew), 1, t0)
	a.Observe(beacon("edge-b", 0, time.Minute, -skew), 2, t0)
	a.Observe(beacon("edge-a", 0, time.Hour, 0), 3, t0.Add(-time.Second)) // older, delivered late

	for _, tc := range []struct {
		at   time.Time
		load []Load
	}{
		{t0.Add(5 * time.Second), []Load{{Edge: "edge-a", InFlight: 2, At: t0}}},
		{t0.Add(11 * time.Second), nil},
	} {
		v := a.View("ann", tc.at)
		last, load := v.Last, v.Load
		if !last.Equal(t0) {
			t.Errorf("at %s: last active %s, want the stream's %s", tc.at, last, t0)
		}
		if fmt.Sprint(load) != fmt.Sprint(tc.load) {
			t.Errorf("at %s: in flight %v, want %v", tc.at, load, tc.load)
		}
	}
	if v := a.View("nobody", t0); !v.Last.IsZero() || v.Load != nil {
		t.Errorf("unknown user: %+v", v)
	}
}
