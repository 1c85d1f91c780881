package handshake_test

import (
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/handshake"
)

// A key asked for as often as it may be goes at once, then 2 s, 4 s, … a
// minute apart; other keys are not held by it; a key left alone starts
// afresh.
func TestBackoffDoublesPerKeyAndForgets(t *testing.T) {
	b := handshake.EdgeRefreshes()
	t0 := time.Unix(1_000_000, 0)
	now := t0
	var goes []time.Duration
	for now.Sub(t0) < 5*time.Minute {
		if wait := b.Next("ann", now); wait == 0 {
			goes = append(goes, now.Sub(t0))
		} else if wait < 0 || wait > time.Minute {
			t.Fatalf("wait %s at %s", wait, now.Sub(t0))
		}
		now = now.Add(100 * time.Millisecond)
	}
	want := []time.Duration{0, 2, 6, 14, 30, 62, 122, 182, 242}
	if len(goes) != len(want) {
		t.Fatalf("goes at %v, want at %v s", goes, want)
	}
	for i, g := range goes {
		if g != want[i]*time.Second {
			t.Fatalf("go %d at %s, want %ds (all: %v)", i, g, want[i], goes)
		}
	}
	if wait := b.Next("bob", now); wait != 0 {
		t.Fatalf("another key waits %s behind ann's", wait)
	}
	// Refused: nothing recorded, the wait only shrinks.
	w1 := b.Next("ann", now)
	w2 := b.Next("ann", now.Add(time.Second))
	if w1 <= 0 || w2 != w1-time.Second {
		t.Fatalf("refusals moved the pacing: %s then %s", w1, w2)
	}
	// Left alone for the longest wait after its own: at once, then 2 s.
	quiet := t0.Add(242*time.Second + time.Minute + time.Minute)
	if wait := b.Next("ann", quiet); wait != 0 {
		t.Fatalf("after a quiet spell ann waits %s", wait)
	}
	if wait := b.Next("ann", quiet.Add(time.Second)); wait != time.Second {
		t.Fatalf("after starting afresh the next wait is %s, want 1s left of 2s", wait)
	}
}

// Lifecycle's pacing is half the edge's at every step, so an edge that
// paces itself is never refused by lifecycle, however late its commands
// arrive after one another.
func TestLifecyclePacingIsLooserThanTheEdges(t *testing.T) {
	edge, lc := handshake.EdgeRefreshes(), handshake.LifecycleRefreshes()
	t0 := time.Unix(1_000_000, 0)
	now := t0
	for i := 0; i < 12; i++ {
		if wait := edge.Next("k", now); wait != 0 {
			now = now.Add(wait)
			if edge.Next("k", now) != 0 {
				t.Fatal("the edge refused its own go")
			}
		}
		// Lifecycle sees the edge's go up to half a second late, or early
		// by as much relative to the one before.
		skew := time.Duration(i%2) * 500 * time.Millisecond
		if wait := lc.Next("k", now.Add(skew)); wait != 0 {
			t.Fatalf("go %d at %s: lifecycle refused an edge that paced itself (wait %s)", i, now.Sub(t0), wait)
		}
	}
}
