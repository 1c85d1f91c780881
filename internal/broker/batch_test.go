package broker

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/state"
)

// Two brokers' batchers add to one key at once, each with many callers:
// every change lands exactly once, though each broker's kept value is
// behind the other's writes most of the time; and a batch that changes
// nothing reads the key fresh, not the kept value.
func TestBatchersOnOneKeyLoseNothing(t *testing.T) {
	b := newLedgerBus(t)
	usage := bucket[state.Usage](b, state.BucketUsage)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	brokers := []*batcher[state.Usage]{newBatcher(ctx, usage, time.Minute), newBatcher(ctx, usage, time.Minute)}
	const perBroker = 200
	var wg sync.WaitGroup
	for _, bt := range brokers {
		for range perBroker {
			wg.Go(func() {
				if err := bt.do(natstest.Context(t, time.Minute), "ann.2026-12", func(cur *state.Usage) bool { cur.Calls++; return true }, nil); err != nil {
					t.Error(err)
				}
			})
		}
	}
	wg.Wait()
	e, err := usage.Get(natstest.Context(t, 10*time.Second), "ann.2026-12")
	if err != nil || e.Value.Calls != 2*perBroker {
		t.Fatalf("%d calls counted of %d: %v", e.Value.Calls, 2*perBroker, err)
	}
	// Broker 0 keeps a value; broker 1 writes after it; broker 0's
	// read-only decision sees broker 1's write.
	one := func(bt *batcher[state.Usage], apply func(*state.Usage) bool) {
		t.Helper()
		if err := bt.do(natstest.Context(t, 10*time.Second), "bob.2026-12", apply, nil); err != nil {
			t.Fatal(err)
		}
	}
	one(brokers[0], func(cur *state.Usage) bool { cur.Calls++; return true })
	one(brokers[1], func(cur *state.Usage) bool { cur.Calls++; return true })
	var seen int64
	one(brokers[0], func(cur *state.Usage) bool { seen = cur.Calls; return false })
	if seen != 2 {
		t.Fatalf("a read-only batch saw %d calls, want the 2 written", seen)
	}
	brokers[0].mu.Lock()
	_, kept := brokers[0].last["ann.2026-12"]
	brokers[0].mu.Unlock()
	if !kept {
		t.Fatal("no value kept after a write")
	}
}
