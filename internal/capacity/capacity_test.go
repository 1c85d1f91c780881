package capacity

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var t0 = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

func TestAdmit(t *testing.T) {
	// Listed out of order on purpose: admission goes by Since.
	q := []state.Queued{{User: "cy", Since: t0.Add(2 * time.Second)}, {User: "ann", Since: t0}, {User: "bo", Since: t0.Add(time.Second)}}
	tied := []state.Queued{{User: "zed", Since: t0}, {User: "al", Since: t0}}
	for _, tc := range []struct {
		name  string
		queue []state.Queued
		use   Usage
		lim   Limits
		want  string
	}{
		{"no caps: everyone", q, Usage{Running: 100, Starting: 50}, Limits{}, "[ann bo cy]"},
		{"one place left: the oldest", q, Usage{Running: 9}, Limits{MaxRunning: 10}, "[ann]"},
		{"full", q, Usage{Running: 10}, Limits{MaxRunning: 10}, "[]"},
		{"over the cap (lowered at run time)", q, Usage{Running: 12}, Limits{MaxRunning: 10}, "[]"},
		{"starts cap the batch", q, Usage{Running: 1, Starting: 1}, Limits{MaxStarts: 3}, "[ann bo]"},
		{"the tighter cap wins", q, Usage{Running: 5, Starting: 0}, Limits{MaxRunning: 7, MaxStarts: 1}, "[ann]"},
		{"ties go by name", tied, Usage{}, Limits{MaxRunning: 1}, "[al]"},
		{"empty queue", nil, Usage{}, Limits{MaxRunning: 1}, "[]"},
		// ann and bo are of gpu, cy of small.
		{"a full profile passes over its own users, not the others'", q, Usage{Running: 1, Profiles: map[string]int{"gpu": 1}}, Limits{Profiles: map[string]int{"gpu": 1}}, "[cy]"},
		{"a profile's places are given within the round", q, Usage{}, Limits{Profiles: map[string]int{"gpu": 1}}, "[ann cy]"},
		{"a profile's cap lowered below its use", q, Usage{Running: 5, Profiles: map[string]int{"gpu": 5}}, Limits{Profiles: map[string]int{"gpu": 3}}, "[cy]"},
		{"the total cap holds over every profile", q, Usage{Running: 9}, Limits{MaxRunning: 10, Profiles: map[string]int{"gpu": 5}}, "[ann]"},
		{"a profile with room keeps the order", q, Usage{Running: 2, Profiles: map[string]int{"gpu": 1, "small": 1}}, Limits{MaxRunning: 4, Profiles: map[string]int{"gpu": 2, "small": 1}}, "[ann]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			profileOf := func(user string) string { return map[string]string{"ann": "gpu", "bo": "gpu", "cy": "small"}[user] }
			if got := fmt.Sprint(Admit(tc.queue, profileOf, tc.use, tc.lim)); got != tc.want {
				t.Fatalf("Admit = %s, want %s", got, tc.want)
			}
		})
	}
}

func TestEvict(t *testing.T) {
	cands := []Candidate{
		{User: "busy-oldest", Last: t0.Add(-time.Hour), Busy: true},
		{User: "old", Last: t0.Add(-30 * time.Minute)},
		{User: "recent", Last: t0.Add(-time.Minute)},
		{User: "older", Last: t0.Add(-40 * time.Minute)},
	}
	for _, tc := range []struct {
		name    string
		waiting int
		use     Usage
		lim     Limits
		freeing int
		want    string
	}{
		{"nobody waits", 0, Usage{Running: 10}, Limits{MaxRunning: 10}, 0, "[]"},
		{"a place is free", 1, Usage{Running: 9}, Limits{MaxRunning: 10}, 0, "[]"},
		{"one waits: the longest idle, never a busy one", 1, Usage{Running: 10}, Limits{MaxRunning: 10}, 0, "[older]"},
		{"two wait, one place free", 2, Usage{Running: 9}, Limits{MaxRunning: 10}, 0, "[older]"},
		{"suspends already under way count", 2, Usage{Running: 10}, Limits{MaxRunning: 10}, 1, "[older]"},
		{"more wait than can be evicted", 9, Usage{Running: 10}, Limits{MaxRunning: 10}, 0, "[older old recent]"},
		{"no running cap: nothing to make room for", 3, Usage{Running: 10, Starting: 5}, Limits{MaxStarts: 5}, 0, "[]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := fmt.Sprint(Evict(tc.waiting, tc.use, tc.lim, tc.freeing, cands)); got != tc.want {
				t.Fatalf("Evict = %s, want %s", got, tc.want)
			}
		})
	}
}

func TestPhasesThatCount(t *testing.T) {
	want := map[state.Phase]bool{state.PhaseClaiming: true, state.PhaseWaking: true, state.PhaseReady: true, state.PhaseSuspending: true}
	for _, p := range state.Phases {
		if p.Running() != want[p] {
			t.Errorf("%s.Running() = %v", p, p.Running())
		}
	}
}

// Tally, kept change by change, always says what a walk of the same
// sandboxes says: through creations, phase changes, managed flips and
// deletions in any order, told by records (Observe) or by their fields
// (Change), and with two changes of one key told in the order they were
// not made (as a cache's subscribers can be).
func TestTallyIsCount(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tally := Tally{Default: "small"}
	now := map[string]state.Sandbox{}
	walk := func() Usage {
		var u Usage
		for _, b := range now {
			u.add(b.Managed, b.Phase, cmp.Or(b.Profile, "small"), 1)
		}
		return u
	}
	// same compares two usages, a profile counted 0 as one not counted.
	same := func(a, b Usage) bool {
		maps.DeleteFunc(a.Profiles, func(_ string, n int) bool { return n == 0 })
		maps.DeleteFunc(b.Profiles, func(_ string, n int) bool { return n == 0 })
		return a.Running == b.Running && a.Starting == b.Starting && a.Stopping == b.Stopping && maps.Equal(a.Profiles, b.Profiles)
	}
	// change makes one change of key and returns how to tell the tally.
	change := func(key string, i int) func() {
		was, had := now[key]
		if rng.IntN(5) == 0 {
			delete(now, key)
			return func() {
				tally.Observe(key, kv.Entry[state.Sandbox]{Key: key, Value: was}, had, kv.Entry[state.Sandbox]{Key: key}, true)
			}
		}
		b := state.Sandbox{User: key, Phase: state.Phases[rng.IntN(len(state.Phases))], Managed: rng.IntN(10) > 0,
			Profile: []string{"", "small", "gpu"}[rng.IntN(3)]}
		now[key] = b
		if i%2 == 0 {
			return func() {
				tally.Observe(key, kv.Entry[state.Sandbox]{Key: key, Value: was}, had, kv.Entry[state.Sandbox]{Key: key, Value: b}, false)
			}
		}
		return func() {
			tally.Change(Counted{was.Managed, was.Phase, was.Profile}, had, Counted{b.Managed, b.Phase, b.Profile}, true)
		}
	}
	for i := range 20_000 {
		key := "u" + strconv.Itoa(rng.IntN(300))
		first := change(key, i)
		if rng.IntN(4) == 0 {
			second := change(key, i+1)
			second()
		}
		first()
		if got, want := tally.Usage(), walk(); !same(got, want) {
			t.Fatalf("after change %d: tally %+v, walk %+v", i, got, want)
		}
	}
	if u := tally.Usage(); u.Running == 0 || u.Starting == 0 || u.Stopping == 0 || u.Profiles["gpu"] == 0 || u.Profiles["small"] == 0 {
		t.Fatalf("the changes never made every count move: %+v", u)
	}
}

// BenchmarkAdmissionRound is lifecycle's admission round without its
// reads of Kubernetes and KV: the usage, kept as sandboxes change (Tally),
// and the choice of whom to start from a queue of 1000. Its cost must
// not move with the sandboxes that exist (issue 28: a round walked every
// sandbox, 34 ms at 200k, four times a second).
func BenchmarkAdmissionRound(b *testing.B) {
	queue := make([]state.Queued, 1000)
	for i := range queue {
		queue[i] = state.Queued{User: "q" + strconv.Itoa(i), Since: t0.Add(time.Duration(i*7919%1000) * time.Millisecond)}
	}
	for _, n := range []int{10_000, 1_000_000} {
		var tally Tally
		for i := range n {
			phase := state.PhaseSuspended
			if i%5 == 0 {
				phase = state.PhaseReady
			}
			tally.Change(Counted{}, false, Counted{Managed: true, Phase: phase}, true)
		}
		lim := Limits{MaxRunning: n/5 + 10, MaxStarts: 20}
		b.Run(fmt.Sprintf("sandboxes=%d", n), func(b *testing.B) {
			for b.Loop() {
				if got := Admit(queue, func(string) string { return "" }, tally.Usage(), lim); len(got) != 10 {
					b.Fatalf("admitted %d, want the 10 free places", len(got))
				}
			}
		})
	}
}
