package kv

import (
	"context"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/state"
)

// deadFirstWatch is a bucket whose first watch is made but never brings
// anything, as one made while NATS was going away can be (its consumer
// on a server that went, its answer lost); later watches are the real
// bucket's.
type deadFirstWatch struct {
	jetstream.KeyValue
	made atomic.Int32
}

func (d *deadFirstWatch) WatchFiltered(ctx context.Context, keys []string, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
	if d.made.Add(1) == 1 {
		return deadWatcher{make(chan jetstream.KeyValueEntry)}, nil
	}
	return d.KeyValue.WatchFiltered(ctx, keys, opts...)
}

type deadWatcher struct{ ch chan jetstream.KeyValueEntry }

func (w deadWatcher) Updates() <-chan jetstream.KeyValueEntry { return w.ch }
func (w deadWatcher) Stop() error                             { return nil }

// A full copy whose first watch never loads is replaced by the watchdog
// and loads: before, the watchdog looked only at synced caches, so such a
// copy stayed unsynced (and its process unready) for good. CI met it
// once: a cache made while NATS restarted never synced.
func TestAWatchThatNeverLoadsIsReplaced(t *testing.T) {
	ns := natstest.Start(t)
	_, js := natstest.Connect(t, ns.URL())
	ctx := natstest.Context(t, 30*time.Second)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	b, err := Open[state.Session](ctx, js, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		if _, err := b.Put(ctx, "u"+strconv.Itoa(i)+".s", state.Session{User: "u" + strconv.Itoa(i)}); err != nil {
			t.Fatal(err)
		}
	}
	dead := &deadFirstWatch{KeyValue: b.kv}
	b.kv = dead
	c, err := NewCache(ctx, b, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Synced():
	case <-ctx.Done():
		t.Fatalf("never synced (%d watches made): the watch that brought nothing was never replaced", dead.made.Load())
	}
	if c.Len() != 100 || dead.made.Load() != 2 || c.Resumes() != 1 {
		t.Fatalf("%d entries after %d watches and %d resumes, want 100 after the dead one and one replacement", c.Len(), dead.made.Load(), c.Resumes())
	}
}
