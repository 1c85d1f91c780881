package lifecycle

import (
	"fmt"
	"testing"
)

// A canary takes about its share of sandboxes, the same ones every time,
// and a larger share only adds to a smaller one's.
func TestInCanary(t *testing.T) {
	const n = 10000
	for _, percent := range []int{1, 10, 50, 99} {
		in := 0
		for i := range n {
			key := fmt.Sprintf("user%d", i)
			if inCanary(key, percent) {
				in++
				if !inCanary(key, percent+1) || !inCanary(key, 100) {
					t.Fatalf("%s is in at %d%% but not at %d%%", key, percent, percent+1)
				}
			}
		}
		if got := float64(in) / n * 100; got < float64(percent)*0.8-0.5 || got > float64(percent)*1.2+0.5 {
			t.Errorf("%d%%: %.1f%% of sandboxes in", percent, got)
		}
	}
}
