package handshake

import (
	"fmt"
	"testing"
	"time"
)

// The keys remembered are bounded: past the bound, keys whose pacing is
// over go first, and live ones only when nothing else is left to drop.
func TestBackoffForgetsKeysBeyondItsBound(t *testing.T) {
	b := EdgeRefreshes()
	t0 := time.Unix(1_000_000, 0)
	for i := range maxBackoffKeys - 1 {
		b.Next(fmt.Sprint("old", i), t0)
	}
	later := t0.Add(time.Hour) // every old key is over
	b.Next("live", later)
	b.Next("new", later)
	if len(b.keys) != 2 || b.Next("live", later) == 0 {
		t.Fatalf("%d keys after the prune (live kept: %v)", len(b.keys), b.keys["live"])
	}
	for i := range maxBackoffKeys + 10 {
		b.Next(fmt.Sprint("flood", i), later)
	}
	if len(b.keys) > maxBackoffKeys {
		t.Fatalf("%d keys remembered, bound %d", len(b.keys), maxBackoffKeys)
	}
}
