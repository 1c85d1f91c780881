package kv

import "testing"

func TestWatchdog(t *testing.T) {
	type look struct {
		last, applied uint64
		stalled       bool
	}
	for _, tc := range []struct {
		name  string
		looks []look
	}{
		{"caught up", []look{{10, 10, false}, {10, 10, false}, {12, 12, false}}},
		{"behind but moving", []look{{20, 15, false}, {25, 19, false}, {30, 26, false}}},
		{"stuck while the bucket moves on", []look{{20, 15, false}, {25, 15, true}}},
		{"stuck while the bucket is still", []look{{20, 15, false}, {20, 15, true}}},
		{"one look behind is not a stall", []look{{10, 10, false}, {12, 10, false}}},
		// The replacement resumed after 15, but 20 was removed (a TTL)
		// before it could be seen: not a stall again until more writes.
		{"a removed last sequence", []look{{20, 15, false}, {20, 15, true}, {20, 15, false}, {20, 15, false}, {21, 15, false}, {21, 15, true}}},
		{"no leader to ask", []look{{0, 15, false}, {0, 15, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d watchdog
			for i, l := range tc.looks {
				if got := d.stalled(l.last, l.applied); got != l.stalled {
					t.Fatalf("look %d (last %d, applied %d): stalled %v, want %v", i, l.last, l.applied, got, l.stalled)
				}
				if l.stalled {
					d.resumed()
				}
			}
		})
	}
}

// A replacement that failed (no leader to create the new consumer on) is
// tried again at the next look, though the bucket has not moved since.
func TestWatchdogTriesAFailedReplacementAgain(t *testing.T) {
	var d watchdog
	for i, want := range []bool{false, true, true} {
		if got := d.stalled(20, 15); got != want {
			t.Fatalf("look %d: stalled %v, want %v", i, got, want)
		}
	}
	d.resumed()
	if d.stalled(20, 15) {
		t.Fatal("stalled again right after the replacement")
	}
}
