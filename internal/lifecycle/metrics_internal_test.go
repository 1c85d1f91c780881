package lifecycle

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A scrape-time gauge whose value cannot be had is absent from the
// scrape, not a stand-in value; once it can be read, it is there.
func TestScrapeGaugeIsAbsentWhileUnknown(t *testing.T) {
	known, value := false, 7.0
	g := scrapeGauge{
		desc: prometheus.NewDesc("aaas_test_backlog", "test", nil, nil),
		read: func() (float64, bool) { return value, known },
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(g)
	if n := promtest.CollectAndCount(g); n != 0 {
		t.Fatalf("%d series while unknown, want none", n)
	}
	known = true
	if err := promtest.GatherAndCompare(reg, strings.NewReader("# HELP aaas_test_backlog test\n# TYPE aaas_test_backlog gauge\naaas_test_backlog 7\n"), "aaas_test_backlog"); err != nil {
		t.Fatal(err)
	}
}

// The queue's age is its oldest wake's wait, whatever order the queue
// bucket lists them in, and 0 when nobody waits.
func TestOldestQueuedWake(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, time.Minute)
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: state.BucketQueue}); err != nil {
		t.Fatal(err)
	}
	b, err := kv.Open[state.Queued](ctx, js, state.BucketQueue)
	if err != nil {
		t.Fatal(err)
	}
	cache, err := kv.NewCache(ctx, b, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	w := &Worker{queueCache: cache}
	now := time.Now()
	if got := w.oldestQueued(now); got != 0 {
		t.Fatalf("empty queue: %v s", got)
	}
	for user, waited := range map[string]time.Duration{"b": time.Minute, "a": 5 * time.Minute, "c": time.Second} {
		if _, err := b.Put(ctx, user, state.Queued{User: user, Since: now.Add(-waited)}); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if got := w.oldestQueued(now); got != 300 {
			return fmt.Errorf("oldest wake waited %v s, want 300", got)
		}
		return nil
	})
}
