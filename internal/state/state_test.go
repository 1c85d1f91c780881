package state_test

import (
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/jsconfig"
	"github.com/aaas-project/aaas/internal/state"
)

func TestHandshakeKey(t *testing.T) {
	a, b := state.HandshakeKey("bob", "pod-1", "GW.example:8443"), state.HandshakeKey("bob", "pod-1", "gw.example:8443")
	if a != b || a != "bob.pod-1."+state.HostKey("gw.example:8443") || len(state.HostKey("x")) != 16 {
		t.Fatalf("%q %q", a, b)
	}
}

func TestEnsureBucketsUpdatesOnlyWhatChanged(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 20*time.Second)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	holds := func(c state.BucketsConfig) map[string]bool {
		t.Helper()
		out := map[string]bool{}
		for _, bc := range state.BucketConfigs(c) {
			b, err := js.KeyValue(ctx, bc.Bucket)
			if err != nil {
				t.Fatal(err)
			}
			st, err := b.Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			out[bc.Bucket] = jsconfig.Holds(st.Config(), bc)
		}
		return out
	}
	for name, ok := range holds(state.DefaultBucketsConfig()) {
		if !ok {
			t.Errorf("bucket %s would be updated on every start", name)
		}
	}
	cfg := state.DefaultBucketsConfig()
	cfg.SessionTTL = 2 * time.Hour
	if holds(cfg)[state.BucketSessions] {
		t.Fatal("a changed session TTL is not seen as a change")
	}
	if err := state.EnsureBuckets(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	if !holds(cfg)[state.BucketSessions] {
		t.Fatal("the changed session TTL was not applied")
	}
}

// Every bucket has a byte cap, and all of them together leave room in the
// 6 GiB store of the embedded server for the streams (1.75 GiB).
func TestEveryBucketIsBounded(t *testing.T) {
	var sum int64
	for _, bc := range state.BucketConfigs(state.DefaultBucketsConfig()) {
		if bc.MaxBytes <= 0 {
			t.Errorf("bucket %s has no byte cap", bc.Bucket)
		}
		sum += bc.MaxBytes
	}
	// 2.625 GiB: with the streams' 1.75 GiB, 4.4 of the 6 GiB at most.
	if sum > 2<<30+640<<20 {
		t.Errorf("buckets reserve %d MiB", sum>>20)
	}
}
