package spend_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
)

// At a month's end the month followed moves on: the month that ended is
// read from the bucket when asked (its late writes included), the new one
// followed by a cache of its own, and the old one's watch stops. Each
// watch is a consumer of the usage stream, which is how the test sees
// which months are followed.
func TestMonthsFollowTheCurrentMonthAcrossItsEnd(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 30*time.Second)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	usage := testutil.Open[state.Usage](t, js, state.BucketUsage)
	put := func(user, month string, micros int64) {
		t.Helper()
		if _, err := usage.Put(ctx, state.UsageKey(user, month), state.Usage{User: user, Month: month, CostMicros: micros}); err != nil {
			t.Fatal(err)
		}
	}
	var clock atomic.Pointer[time.Time]
	set := func(at time.Time) { clock.Store(&at) }
	set(time.Date(2026, 11, 30, 23, 59, 0, 0, time.UTC))
	life, end := context.WithCancel(ctx)
	defer end()
	m := &spend.Months{Bucket: usage, Log: slog.New(slog.DiscardHandler), Life: life, Now: func() time.Time { return *clock.Load() }}
	stream, err := js.Stream(ctx, "KV_"+state.BucketUsage)
	if err != nil {
		t.Fatal(err)
	}
	watches := func(want int) {
		t.Helper()
		testutil.Eventually(t, 20*time.Second, func() error {
			info, err := stream.Info(ctx)
			if err != nil {
				return err
			}
			if info.State.Consumers != want {
				return fmt.Errorf("%d watches of the usage stream, want %d", info.State.Consumers, want)
			}
			return nil
		})
	}
	spent := func(month string, want string) {
		t.Helper()
		testutil.Eventually(t, 10*time.Second, func() error {
			got, err := m.Month(ctx, month)
			if err != nil {
				return err
			}
			if s := fmt.Sprint(got); s != want {
				return fmt.Errorf("%s: %s, want %s", month, s, want)
			}
			return nil
		})
	}
	row := func(user, month string, micros int64) string {
		return fmt.Sprintf("%v", state.Usage{User: user, Month: month, CostMicros: micros})
	}
	put("ann", "2026-11", 100)
	put("bob", "2026-10", 7)
	spent("2026-11", "["+row("ann", "2026-11", 100)+"]")
	watches(1) // November, followed
	spent("2026-10", "["+row("bob", "2026-10", 7)+"]")
	watches(1) // October read once, not followed

	set(time.Date(2026, 12, 1, 0, 0, 1, 0, time.UTC))
	put("ann", "2026-11", 150) // a call that ended at midnight, metered late
	put("cat", "2026-12", 3)
	spent("2026-11", "["+row("ann", "2026-11", 150)+"]")
	spent("2026-12", "["+row("cat", "2026-12", 3)+"]")
	watches(1) // December's, November's gone
	put("dan", "2026-12", 4)
	spent("2026-12", "["+row("cat", "2026-12", 3)+" "+row("dan", "2026-12", 4)+"]")
}
