package idle

import (
	"testing"
	"time"
)

func TestDecide(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	p := Policy{IdleTimeout: 15 * time.Minute}
	capped := Policy{IdleTimeout: 15 * time.Minute, MaxRuntime: 8 * time.Hour}
	tests := []struct {
		name   string
		p      Policy
		v      View
		s      Sandbox
		now    time.Time
		want   Decision
		reason Reason
	}{{
		name: "idle since the last activity",
		p:    p, v: View{Last: t0}, s: Sandbox{ReadySince: t0.Add(-time.Hour)}, now: t0.Add(15 * time.Minute),
		want: Decision{SuspendAt: t0.Add(15 * time.Minute), Reason: ReasonIdle, Due: true, Last: t0},
	}, {
		name: "not yet due a second before",
		p:    p, v: View{Last: t0}, now: t0.Add(15*time.Minute - time.Second),
		want: Decision{SuspendAt: t0.Add(15 * time.Minute), Reason: ReasonIdle, Last: t0},
	}, {
		name: "never touched: the clock starts when it became Ready",
		p:    p, s: Sandbox{ReadySince: t0}, now: t0.Add(time.Minute),
		want: Decision{SuspendAt: t0.Add(15 * time.Minute), Reason: ReasonIdle, Last: t0},
	}, {
		name: "busy (a request, an input stream, a model call): no deadline",
		p:    p, v: View{Last: t0, Busy: true}, now: t0.Add(48 * time.Hour),
		want: Decision{Busy: true, Last: t0},
	}, {
		name: "a tab left open without input makes the reason idle_connected",
		p:    p, v: View{Last: t0, IdleStreams: 2}, now: t0.Add(time.Hour),
		want: Decision{SuspendAt: t0.Add(15 * time.Minute), Reason: ReasonIdleConnected, Due: true, Last: t0},
	}, {
		name: "keep-awake holds past the idle time",
		p:    p, v: View{Last: t0}, s: Sandbox{KeepAwakeUntil: t0.Add(2 * time.Hour)}, now: t0.Add(time.Hour),
		want: Decision{SuspendAt: t0.Add(2 * time.Hour), Reason: ReasonIdle, Last: t0},
	}, {
		name: "an expired keep-awake changes nothing",
		p:    p, v: View{Last: t0}, s: Sandbox{KeepAwakeUntil: t0.Add(-time.Hour)}, now: t0.Add(time.Hour),
		want: Decision{SuspendAt: t0.Add(15 * time.Minute), Reason: ReasonIdle, Due: true, Last: t0},
	}, {
		name: "MAX_RUNTIME suspends a busy sandbox",
		p:    capped, v: View{Last: t0.Add(9 * time.Hour), Busy: true}, s: Sandbox{ReadySince: t0}, now: t0.Add(9 * time.Hour),
		want: Decision{SuspendAt: t0.Add(8 * time.Hour), Reason: ReasonMaxRuntime, Due: true, Busy: true, Last: t0.Add(9 * time.Hour)},
	}, {
		name: "the earlier of idle and the ceiling wins",
		p:    capped, v: View{Last: t0.Add(7*time.Hour + 50*time.Minute)}, s: Sandbox{ReadySince: t0}, now: t0.Add(7 * time.Hour),
		want: Decision{SuspendAt: t0.Add(8 * time.Hour), Reason: ReasonMaxRuntime, Last: t0.Add(7*time.Hour + 50*time.Minute)},
	}, {
		name: "keep-awake lifts the ceiling until it ends",
		p:    capped, v: View{Last: t0.Add(9 * time.Hour), Busy: true}, s: Sandbox{ReadySince: t0, KeepAwakeUntil: t0.Add(10 * time.Hour)}, now: t0.Add(9 * time.Hour),
		want: Decision{SuspendAt: t0.Add(10 * time.Hour), Reason: ReasonMaxRuntime, Busy: true, Last: t0.Add(9 * time.Hour)},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.p.Decide(tt.v, tt.s, tt.now); got != tt.want {
				t.Fatalf("Decide = %+v\nwant     %+v", got, tt.want)
			}
		})
	}
}

func TestDormancy(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	day := 24 * time.Hour
	p := Policy{IdleTimeout: time.Minute, DormantAfter: 90 * day, DormantDeleteAfter: 30 * day}
	for _, tt := range []struct {
		name     string
		p        Policy
		asleep   time.Time
		now      time.Time
		dormant  bool
		deleteAt time.Time
	}{
		{"off", Policy{IdleTimeout: time.Minute}, t0, t0.Add(1000 * day), false, time.Time{}},
		{"awake", p, time.Time{}, t0, false, time.Time{}},
		{"asleep, not yet", p, t0, t0.Add(89 * day), false, t0.Add(120 * day)},
		{"dormant", p, t0, t0.Add(90 * day), true, t0.Add(120 * day)},
		{"dormant, never deleted", Policy{DormantAfter: day}, t0, t0.Add(2 * day), true, time.Time{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d, at := tt.p.Dormancy(tt.asleep, tt.now)
			if d != tt.dormant || !at.Equal(tt.deleteAt) {
				t.Fatalf("Dormancy = %v %s, want %v %s", d, at, tt.dormant, tt.deleteAt)
			}
		})
	}
}

func TestReasons(t *testing.T) {
	p := Policy{IdleTimeout: 15 * time.Minute, MaxRuntime: 8 * time.Hour}
	for _, r := range Reasons {
		if !r.Valid() || r.Describe(p) == "" {
			t.Errorf("%s: valid %v, %q", r, r.Valid(), r.Describe(p))
		}
		if r.Forced() && r.Inactive() && r != ReasonMaxRuntime {
			t.Errorf("%s is both forced and inactive", r)
		}
	}
	if Reason("sleepy").Valid() {
		t.Error("an unknown reason is valid")
	}
	if got := ReasonIdle.Describe(p); got != "it was idle for 15 minutes" {
		t.Errorf("idle: %q", got)
	}
	for d, want := range map[time.Duration]string{time.Hour: "1 hour", 90 * time.Second: "90 seconds", 2 * time.Minute: "2 minutes", time.Second: "1 second"} {
		if got := Words(d); got != want {
			t.Errorf("Words(%s) = %q, want %q", d, got, want)
		}
	}
}
