package sweeper

import (
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
		name:     "an edge whose clock is 30s ahead changes nothing",
		beacons:  []events.Beacon{beacon("a", 1, t0.Add(20*time.Second), t0.Add(30*time.Second))},
		stamped:  []time.Time{t0},
		at:       t0.Add(time.Second),
		wantLast: t0,
		wantBusy: true,
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
			c := newClocks()
			for i, b := range tt.beacons {
				c.observe(b, uint64(i+1), tt.stamped[i])
			}
			v := c.view("ann", tt.at)
			if !v.last.Equal(tt.wantLast) || v.busy != tt.wantBusy {
				t.Fatalf("view = last %s busy %v, want last %s busy %v", v.last, v.busy, tt.wantLast, tt.wantBusy)
			}
			if v.seq != uint64(len(tt.beacons)) {
				t.Fatalf("seq %d", v.seq)
			}
		})
	}
}
