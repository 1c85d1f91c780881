// Package restarttest holds the kv tests that take NATS away while a
// watch is being made: a server stopped and restarted under a cache's
// start, a link that loses the watch's request. Their failures in CI
// (a cache still unsynced a minute after NATS came back) came from a
// watch made under a context with a far deadline, which nats.go waited
// out for an answer that was lost; kv now bounds the making itself.
package restarttest

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// filled is a NATS server whose sandboxes bucket holds n keys, a context
// of the test's 2 minutes, and the bucket.
func filled(t *testing.T, n int) (*embednats.Server, context.Context, *kv.Bucket[map[string]any]) {
	t.Helper()
	ns := natstest.Start(t)
	_, js := natstest.Connect(t, ns.URL())
	ctx := natstest.Context(t, 2*time.Minute)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	b, err := kv.Open[map[string]any](ctx, js, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if _, err := b.Put(ctx, "k"+strconv.Itoa(i), map[string]any{"i": i}); err != nil {
			t.Fatal(err)
		}
	}
	return ns, ctx, b
}

// A full copy whose watch cannot start (NATS is down) is not synced and
// returns no error for its process to exit on; it loads once NATS is back.
func TestAFullCopyStartedWhileNATSIsDownLoadsWhenItIsBack(t *testing.T) {
	ns, ctx, b := filled(t, 3000)
	ns.Stop()
	late, err := kv.NewCache(ctx, b, ">", slog.New(slog.DiscardHandler))
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
