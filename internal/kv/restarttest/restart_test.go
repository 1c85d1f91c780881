// Package restarttest holds the kv test that stops and restarts its NATS
// server under a cache's start. It runs in a test process of its own: the
// full copies' turn to load is the process's, and the kv package's other
// tests leave caches behind that made this one miss its minute in CI.
package restarttest

import (
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A full copy whose watch cannot start (NATS is down) is not synced and
// returns no error for its process to exit on; it loads once NATS is back.
func TestAFullCopyStartedWhileNATSIsDownLoadsWhenItIsBack(t *testing.T) {
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
	for i := range 3000 {
		if _, err := b.Put(ctx, "k"+strconv.Itoa(i), map[string]any{"i": i}); err != nil {
			t.Fatal(err)
		}
	}
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
