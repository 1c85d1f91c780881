package lifecycle

import (
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/state"
)

// The mirror writes a record only when it changed: a comparison that
// tells two derivations of the same state apart (a pointer's address, a
// time's location after a JSON round trip) rewrites the record on every
// reconcile, and each write enqueues the next; the edges took each new
// revision of a suspended sandbox for a new state and published a wake
// for it (the fault suite found the flood starving other users' commands).
func TestSameRecord(t *testing.T) {
	at := time.Date(2026, 12, 1, 14, 2, 0, 0, time.UTC)
	box := func(edit func(*state.Sandbox)) state.Sandbox {
		b := state.Sandbox{Phase: state.PhaseSuspended, Sandbox: "dsh-ann", Managed: true, ReadySince: at,
			LastSuspend: &state.Suspension{At: at, Reason: "idle", Detail: "it was idle for 15 minutes"}, Updated: at}
		if edit != nil {
			edit(&b)
		}
		return b
	}
	for _, tc := range []struct {
		name string
		b    state.Sandbox
		same bool
	}{
		{"the same", box(nil), true},
		{"LastSuspend parsed afresh", box(func(b *state.Sandbox) { c := *b.LastSuspend; b.LastSuspend = &c }), true},
		{"times in another location", box(func(b *state.Sandbox) {
			b.ReadySince = at.Local()
			b.LastSuspend = &state.Suspension{At: at.Local(), Reason: "idle", Detail: "it was idle for 15 minutes"}
		}), true},
		{"only Updated differs", box(func(b *state.Sandbox) { b.Updated = at.Add(time.Hour) }), true},
		{"another reason", box(func(b *state.Sandbox) { b.LastSuspend = &state.Suspension{At: at, Reason: "max_runtime"} }), false},
		{"another suspend time", box(func(b *state.Sandbox) {
			b.LastSuspend = &state.Suspension{At: at.Add(time.Second), Reason: "idle", Detail: "it was idle for 15 minutes"}
		}), false},
		{"never suspended", box(func(b *state.Sandbox) { b.LastSuspend = nil }), false},
		{"another phase", box(func(b *state.Sandbox) { b.Phase = state.PhaseWaking }), false},
		{"ready at another time", box(func(b *state.Sandbox) { b.ReadySince = at.Add(time.Second) }), false},
	} {
		if got := sameRecord(box(nil), tc.b); got != tc.same {
			t.Errorf("%s: sameRecord = %v, want %v", tc.name, got, tc.same)
		}
		if got := sameRecord(tc.b, box(nil)); got != tc.same {
			t.Errorf("%s (swapped): sameRecord = %v, want %v", tc.name, got, tc.same)
		}
	}
}
