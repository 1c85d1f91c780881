package kv_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Current says how fresh a cache is: it moves forward while the watch keeps
// up with the bucket, stops while the server is gone (the cache still
// serves what it had), and moves again once it is back. The edge's routing
// fence (ROUTE_MAX_STALENESS) rests on it.
func TestCurrentFollowsTheWatchAndStopsWithoutTheServer(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := state.EnsureBuckets(natstest.Context(t, 10*time.Second), js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	before := time.Now()
	c, err := kv.NewCache(ctx, boxes, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-c.Synced()
	if cur := c.Current(); cur.Before(before) || cur.After(time.Now()) {
		t.Fatalf("after the initial load Current is %s, want between the cache's start %s and now", cur, before)
	}
	// Writes go on: each look that the watch has caught up with moves
	// Current past the write.
	for i := range 2 {
		rev, err := boxes.Put(natstest.Context(t, 10*time.Second), "bob", state.Sandbox{User: "bob", Phase: state.PhaseReady, Address: fmt.Sprintf("10.0.0.%d:3080", i)})
		if err != nil {
			t.Fatal(err)
		}
		written := time.Now()
		testutil.Eventually(t, 30*time.Second, func() error {
			if e, ok := c.Get("bob"); !ok || e.Revision < rev {
				return fmt.Errorf("revision %d not applied", rev)
			}
			if cur := c.Current(); !cur.After(written) {
				return fmt.Errorf("Current %s, not yet after the write at %s", cur, written)
			}
			return nil
		})
	}

	// The server goes: Current stops where it was while the cache keeps
	// its records. A cache on another server, in the same window, shows
	// the looks go on (the control).
	other := natstest.Start(t)
	_, ojs := natstest.Connect(t, other.URL())
	if err := state.EnsureBuckets(natstest.Context(t, 10*time.Second), ojs, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	ctrl, err := kv.NewCache(ctx, testutil.Open[state.Sandbox](t, ojs, state.BucketSandboxes), ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-ctrl.Synced()
	s.Stop()
	stopped := time.Now()
	frozen := c.Current()
	if frozen.After(stopped) {
		t.Fatalf("Current %s is after the server stopped (%s)", frozen, stopped)
	}
	// Three watchdog looks (every 2 s) all fail; Current must not move.
	deadline := stopped.Add(7 * time.Second)
	for time.Now().Before(deadline) {
		if cur := c.Current(); !cur.Equal(frozen) {
			t.Fatalf("Current moved to %s with the server down (was %s)", cur, frozen)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if cur := ctrl.Current(); !cur.After(stopped) {
		t.Fatalf("the control cache's Current %s did not move after %s either: the looks did not run", cur, stopped)
	}
	if e, ok := c.Get("bob"); !ok || e.Value.Address != "10.0.0.1:3080" {
		t.Fatalf("the cache lost its record while the server was down: %+v %v", e, ok)
	}

	// Back: the reconnected watch confirms again.
	r, err := s.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	back := time.Now()
	testutil.Eventually(t, time.Minute, func() error {
		if cur := c.Current(); !cur.After(back) {
			return fmt.Errorf("Current %s, not yet after the restart at %s", cur, back)
		}
		return nil
	})
}
