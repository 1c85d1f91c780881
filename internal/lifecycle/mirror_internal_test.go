package lifecycle

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/sandbox"
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

// The mirror asks the API server about a sandbox only when the caches say
// its pod went while it runs: the one case where a suspend the sandbox
// informer has not brought yet reads as a restart.
func TestPodLeft(t *testing.T) {
	now := metav1.Now()
	running := &sandboxv1beta1.Sandbox{}
	alive, going := &corev1.Pod{}, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}}
	for _, tc := range []struct {
		name       string
		prev, next state.Phase
		st         sandbox.State
		want       bool
	}{
		{"ready, pod gone", state.PhaseReady, state.PhaseWaking, sandbox.State{Sandbox: running}, true},
		{"ready, pod terminating", state.PhaseReady, state.PhaseWaking, sandbox.State{Sandbox: running, Pod: going}, true},
		{"failed, pod gone", state.PhaseFailed, state.PhaseWaking, sandbox.State{Sandbox: running}, true},
		{"already waking", state.PhaseWaking, state.PhaseWaking, sandbox.State{Sandbox: running}, false},
		{"resuming from suspended", state.PhaseSuspended, state.PhaseWaking, sandbox.State{Sandbox: running}, false},
		{"first start", state.PhaseClaiming, state.PhaseClaiming, sandbox.State{Sandbox: running}, false},
		{"pod alive but not ready", state.PhaseReady, state.PhaseWaking, sandbox.State{Sandbox: running, Pod: alive}, false},
		{"no sandbox", state.PhaseReady, state.PhaseWaking, sandbox.State{}, false},
		{"suspending", state.PhaseReady, state.PhaseSuspending, sandbox.State{Sandbox: running, Pod: going}, false},
	} {
		if got := podLeft(state.Sandbox{Phase: tc.prev}, state.Sandbox{Phase: tc.next}, tc.st); got != tc.want {
			t.Errorf("%s: podLeft = %v, want %v", tc.name, got, tc.want)
		}
	}
}
