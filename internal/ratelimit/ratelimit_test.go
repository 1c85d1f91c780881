package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/state"
)

func TestLimiter(t *testing.T) {
	ctx := natstest.Context(t, time.Minute)
	lim := newLimiter(t, ctx, 3, time.Minute)
	for i := 0; i < 3; i++ {
		if v, err := lim.Allow(ctx, "10.0.0.1"); !v.Allowed || err != nil {
			t.Fatalf("attempt %d refused: %v", i+1, err)
		}
	}
	v, err := lim.Allow(ctx, "10.0.0.1")
	if v.Allowed || !v.Audit || err != nil || v.RetryAfter <= 0 || v.RetryAfter > time.Minute {
		t.Fatalf("4th attempt: %+v err=%v", v, err)
	}
	// Only the first refusal in the window is the one to audit, whichever
	// way it was refused.
	if v, _ := lim.Allow(ctx, "10.0.0.1"); v.Allowed || v.Audit {
		t.Fatalf("5th attempt: %+v", v)
	}
	if first, err := lim.Refused(ctx, "10.0.0.1"); first || err != nil {
		t.Fatalf("a refusal after the audited one is audited again: %v %v", first, err)
	}
	if v, _ := lim.Allow(ctx, "10.0.0.2"); !v.Allowed {
		t.Fatal("another client was limited")
	}
	if first, _ := lim.Refused(ctx, "10.0.0.2"); !first {
		t.Fatal("another client's first refusal is not audited")
	}
	if first, _ := lim.Refused(ctx, "10.0.0.2"); first {
		t.Fatal("its second is")
	}
}

// The window slides: once the oldest attempt leaves it, exactly one more
// attempt fits, wherever a fixed window's boundary would have fallen.
func TestLimiterWindowSlides(t *testing.T) {
	ctx := natstest.Context(t, time.Minute)
	const window = 2 * time.Second
	lim := newLimiter(t, ctx, 3, window)
	allow := func(what string, want bool) time.Duration {
		t.Helper()
		v, err := lim.Allow(ctx, "10.0.0.3")
		if err != nil || v.Allowed != want {
			t.Fatalf("%s: allowed=%v err=%v, want allowed=%v", what, v.Allowed, err, want)
		}
		return v.RetryAfter
	}
	allow("first", true)
	time.Sleep(window / 2)
	allow("second", true)
	allow("third", true)
	retry := allow("fourth", false)
	if retry <= 0 || retry > window/2+100*time.Millisecond {
		t.Fatalf("retry after %s, want about %s (when the first attempt leaves)", retry, window/2)
	}
	time.Sleep(retry + 50*time.Millisecond)
	allow("after the first left", true)
	allow("while the second and third are in the window", false)
}

// newLimiter is a Limiter on a NATS server of its own with the buckets.
func newLimiter(t *testing.T, ctx context.Context, limit int, window time.Duration) *ratelimit.Limiter {
	t.Helper()
	_, js := natstest.Connect(t, natstest.Start(t).URL())
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	lim, err := ratelimit.New(ctx, js, limit, window)
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// A shared count runs out for every holder of the bucket at once, and
// the next window has its own.
func TestSpendAudit(t *testing.T) {
	ctx := natstest.Context(t, time.Minute)
	lim := newLimiter(t, ctx, 3, time.Minute)
	for i := 0; i < 2; i++ {
		if ok, err := lim.SpendAudit(ctx, 7, 2); !ok || err != nil {
			t.Fatalf("audit %d of 2 refused: %v", i+1, err)
		}
	}
	if ok, err := lim.SpendAudit(ctx, 7, 2); ok || err != nil {
		t.Fatalf("a third audit of 2 was granted: %v", err)
	}
	if ok, err := lim.SpendAudit(ctx, 8, 2); !ok || err != nil {
		t.Fatalf("the next window's first audit refused: %v", err)
	}
}
