package restarttest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A watch whose making goes unanswered (its request held by a link nobody
// noticed fail, then lost with it; or sent while NATS restarts, as in a CI
// run of the test beside) is given up within its own bound and made again,
// whatever the deadline of the context it is made under: nats.go waits
// for the answer until that deadline (its own 5 s only when there is
// none). A full copy started under a far deadline still loads soon after
// the link is back, and a listing answers with an error well before its
// caller's deadline.
func TestAWatchWhoseMakingGoesUnansweredIsMadeAgain(t *testing.T) {
	ns, ctx, _ := filled(t, 300)

	faults := testenv.NewFaults(t)
	nc, cutJS := natstest.Connect(t, faults.Links("cut", []string{strings.TrimPrefix(ns.URL(), "nats://")}))
	b, err := kv.Open[map[string]any](ctx, cutJS, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	faults.Blackhole("cut")
	sent, answered := nc.Stats().OutMsgs, nc.Stats().InMsgs

	c, err := kv.NewCache(ctx, b, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	// The fault happened: the watch's request went out, and no answer came.
	testutil.Eventually(t, 30*time.Second, func() error {
		if nc.Stats().OutMsgs == sent {
			return errors.New("the watch has sent nothing yet")
		}
		return nil
	})
	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, err := b.List(lctx, "k1"); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a listing over the dead link: %v, want the watch's own error well before a minute", err)
	}
	if got := nc.Stats().InMsgs; got != answered || c.IsSynced() {
		t.Fatalf("the link carried answers while blackholed: %d messages in, synced %v", got-answered, c.IsSynced())
	}

	// The link goes, and the request with it: nats.go does not send again
	// what it had written to a connection that closed.
	faults.Cut("cut")
	faults.Restore("cut")
	testutil.Eventually(t, time.Minute, func() error {
		if !c.IsSynced() || c.Len() != 300 {
			return fmt.Errorf("after the link carried again: synced %v, %d entries", c.IsSynced(), c.Len())
		}
		return nil
	})
	if _, err := b.List(lctx, "k1"); err != nil {
		t.Fatalf("a listing once the link carries: %v", err)
	}
}
