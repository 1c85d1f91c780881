package lifecycle

import (
	"testing"
	"time"
)

// A handshake whose pod is not in the cache comes back after 250 ms,
// 750 ms and 2 s: the 3 s the handler used to wait, without a worker.
func TestPodWaitDelay(t *testing.T) {
	var total time.Duration
	for delivered, want := range map[uint64]time.Duration{1: 250 * time.Millisecond, 2: 750 * time.Millisecond, 3: 2 * time.Second, 9: 2 * time.Second, 0: 250 * time.Millisecond} {
		if got := podWaitDelay(delivered); got != want {
			t.Errorf("delivery %d: %s, want %s", delivered, got, want)
		}
	}
	for d := uint64(1); d < podWaits; d++ {
		total += podWaitDelay(d)
	}
	if total != 3*time.Second {
		t.Fatalf("the waits add up to %s", total)
	}
}
