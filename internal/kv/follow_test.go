package kv_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// TestFollowSeesEveryChangeFromNowOn: a follower is told of each put,
// delete, purge and expiry (a per-key TTL's limit marker) after it
// starts, and of nothing that was there before; when its watch ends (NATS
// restarted) it is told it may have missed changes, and follows the
// changes after.
func TestFollowSeesEveryChangeFromNowOn(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, time.Minute)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	sessions := testutil.Open[state.Session](t, js, state.BucketSessions)
	put := func(key string, opts ...kv.WriteOption) {
		t.Helper()
		if _, err := sessions.Put(ctx, key, state.Session{User: "bob"}, opts...); err != nil {
			t.Fatal(err)
		}
	}
	put("bob.before")

	var mu sync.Mutex
	var seen []string
	restarts, probed := 0, false
	followed, stop := context.WithCancel(ctx)
	var done sync.WaitGroup
	done.Go(func() {
		sessions.Follow(followed, quiet, func(key string, present bool) {
			mu.Lock()
			defer mu.Unlock()
			if key == "bob.probe" {
				probed = true
				return
			}
			seen = append(seen, fmt.Sprintf("%s %v", key, present))
		}, func() {
			mu.Lock()
			defer mu.Unlock()
			restarts++
		})
	})
	t.Cleanup(func() { stop(); done.Wait() })
	expect := func(want ...string) {
		t.Helper()
		testutil.Eventually(t, 30*time.Second, func() error {
			mu.Lock()
			defer mu.Unlock()
			if !slices.Equal(seen, want) {
				return fmt.Errorf("seen %q, want %q", seen, want)
			}
			return nil
		})
	}
	// The watch starts with the follower; the first put it sees proves it
	// runs (writes before that may not be seen).
	probe := func() {
		t.Helper()
		mu.Lock()
		probed = false
		mu.Unlock()
		testutil.Eventually(t, 30*time.Second, func() error {
			put("bob.probe")
			mu.Lock()
			defer mu.Unlock()
			if !probed {
				return fmt.Errorf("no change seen yet")
			}
			return nil
		})
	}
	probe()
	put("bob.a")
	e, err := sessions.Get(ctx, "bob.a")
	if err != nil {
		t.Fatal(err)
	}
	if err := sessions.Delete(ctx, "bob.a", e.Revision); err != nil {
		t.Fatal(err)
	}
	if err := sessions.Purge(ctx, "bob.before"); err != nil {
		t.Fatal(err)
	}
	put("bob.brief", kv.WithTTL(time.Second))
	expect("bob.a true", "bob.a false", "bob.before false", "bob.brief true", "bob.brief false")

	// NATS restarted: the watch resumes where it was (an ordered
	// consumer), nothing missed.
	s.Stop()
	back, err := s.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Stop)
	probe()
	mu.Lock()
	seen = nil
	mu.Unlock()
	put("bob.after")
	expect("bob.after true")

	// The bucket recreated (NATS lost its data): the watch ends, the
	// follower is told, and it follows the new bucket.
	if err := js.DeleteKeyValue(ctx, state.BucketSessions); err != nil {
		t.Fatal(err)
	}
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		mu.Lock()
		defer mu.Unlock()
		if restarts == 0 {
			return fmt.Errorf("not told its watch ended")
		}
		return nil
	})
	sessions = testutil.Open[state.Session](t, js, state.BucketSessions)
	probe()
	mu.Lock()
	seen = nil
	mu.Unlock()
	put("bob.new")
	expect("bob.new true")
}
