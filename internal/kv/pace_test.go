package kv_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Full copies started together load one after another, each complete.
// (One whose watch cannot start loads once NATS is back: restarttest.)
func TestFullCopiesLoadInTurn(t *testing.T) {
	ns := natstest.Start(t)
	_, js := natstest.Connect(t, ns.URL())
	ctx := natstest.Context(t, 2*time.Minute)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	buckets := []string{state.BucketSandboxes, state.BucketQueue, state.BucketKeepAwake}
	var caches []*kv.Cache[map[string]any]
	for _, name := range buckets {
		b, err := kv.Open[map[string]any](ctx, js, name)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 3000 {
			if _, err := b.Put(ctx, "k"+strconv.Itoa(i), map[string]any{"i": i}); err != nil {
				t.Fatal(err)
			}
		}
		caches = append(caches, nil)
	}
	kv.ResetLoadingMost()
	for i, name := range buckets {
		b, _ := kv.Open[map[string]any](ctx, js, name)
		c, err := kv.NewCache(ctx, b, ">", quiet)
		if err != nil {
			t.Fatal(err)
		}
		caches[i] = c
	}
	for i, c := range caches {
		<-c.Synced()
		if c.Len() != 3000 {
			t.Fatalf("%s: %d entries", buckets[i], c.Len())
		}
	}
	if n := kv.LoadingMost(); n != 1 {
		t.Fatalf("%d full copies loaded at once, want one at a time", n)
	}
}
