package kv_test

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Full copies started together load one after another, each complete;
// and one whose watch cannot start (NATS is down) loads once NATS is
// back, with no error for its process to exit on.
func TestFullCopiesLoadInTurnAndRetry(t *testing.T) {
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

	b, err := kv.Open[map[string]any](ctx, js, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	ns.Stop()
	late, err := kv.NewCache(ctx, b, ">", quiet)
	if err != nil {
		t.Fatalf("a cache whose watch cannot start failed its process: %v", err)
	}
	if late.IsSynced() {
		t.Fatal("synced with NATS down")
	}
	back, err := ns.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Stop)
	testutil.Eventually(t, time.Minute, func() error {
		if !late.IsSynced() || late.Len() != 3000 {
			return fmt.Errorf("after NATS came back: synced %v, %d entries", late.IsSynced(), late.Len())
		}
		return nil
	})
}
