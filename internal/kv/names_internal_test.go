package kv

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
)

// newTestNames is a Names of n sources whose watches never start: the
// tests below drive apply and replaying themselves.
func newTestNames(n int) *Names {
	return NewNames(context.Background(), slog.New(slog.DiscardHandler), make([]KeySource, n)...)
}

// Whatever the order of puts and deletions across sources, replays and
// reads, the names read are the sorted union of what the sources hold,
// counted per source, across many folds of the changes into the base.
func TestNamesMergeOnRead(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	n := newTestNames(2)
	want := [2]map[string]bool{{}, {}}
	union := func() []string {
		var out []string
		for k := range want[0] {
			out = append(out, k)
		}
		for k := range want[1] {
			if !want[0][k] {
				out = append(out, k)
			}
		}
		slices.Sort(out)
		return out
	}
	folds := 0
	for step := range 60_000 {
		// A replay now and then: keys arrive unsorted while it runs.
		if step%7000 == 0 {
			n.replaying(1)
		}
		if step%7000 == 3000 {
			n.replaying(-1)
		}
		src, key := rng.IntN(2), fmt.Sprintf("u%05d", rng.IntN(20_000))
		present := rng.IntN(3) > 0
		before := len(n.base)
		n.apply(key, src, present)
		if present {
			want[src][key] = true
		} else {
			delete(want[src], key)
		}
		if len(n.base) != before {
			folds++
		}
		if step%997 == 0 {
			all := union()
			if got := n.Range("", 0); !slices.Equal(got, all) {
				t.Fatalf("step %d: %d names read, want %d", step, len(got), len(all))
			}
			from := fmt.Sprintf("u%05d", rng.IntN(20_000))
			i, _ := slices.BinarySearch(all, from)
			page := all[i:min(len(all), i+50)]
			if got := n.Range(from, 50); !slices.Equal(got, page) {
				t.Fatalf("step %d: 50 from %s: %v, want %v", step, from, got, page)
			}
			if n.Len() != len(all) || n.LenOf(0) != len(want[0]) || n.LenOf(1) != len(want[1]) {
				t.Fatalf("step %d: counts %d %d %d, want %d %d %d", step, n.Len(), n.LenOf(0), n.LenOf(1), len(all), len(want[0]), len(want[1]))
			}
		}
	}
	if folds < 3 {
		t.Fatalf("the changes folded into the base %d times: the test did not reach compaction", folds)
	}
}

// BenchmarkNamesRange is a page of names read right after a change, at
// a million keys; the baseline reads the same page with no change pending.
func BenchmarkNamesRange(b *testing.B) {
	n := newTestNames(1)
	n.replaying(1)
	for i := range 1_000_000 {
		n.apply(fmt.Sprintf("user-%07d", i), 0, true)
	}
	n.replaying(-1)
	b.Run("unchanged", func(b *testing.B) {
		for b.Loop() {
			_ = n.Range("user-0500000", 1000)
		}
	})
	b.Run("after-a-change", func(b *testing.B) {
		i := 0
		for b.Loop() {
			i++
			n.apply(fmt.Sprintf("user-%07d", i%1_000_000), 0, i/1_000_000%2 == 1)
			_ = n.Range("user-0500000", 1000)
		}
	})
}
