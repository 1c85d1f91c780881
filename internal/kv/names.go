package kv

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Names is the set of a bucket's keys, without their values: what a view
// of every key needs (the admin list, a count against a cap) at a few
// dozen bytes a key, where a bounded cache holds only the keys in use.
// It loads when first asked for (Load), by a watch of the keys' headers
// only, and is kept by that watch from then on: a process that never
// asks pays nothing. The sorted list is rebuilt after changes by one
// merge, not a sort of every key.
type Names struct {
	kv   jetstream.KeyValue
	name string
	log  *slog.Logger
	// ctx is the watch's life, from the first Load on.
	ctx context.Context

	start  sync.Once
	loaded chan struct{}

	mu      sync.Mutex
	set     map[string]struct{}
	sorted  []string            // every key when fresh; else before added and removed
	added   []string            // keys new since sorted was built
	removed map[string]struct{} // keys gone since sorted was built
	updates atomic.Uint64
}

// NewNames is the (not yet loaded) set of b's keys, whose watch, once
// started, runs until ctx ends.
func NewNames[T any](ctx context.Context, b *Bucket[T], log *slog.Logger) *Names {
	return &Names{kv: b.kv, name: b.name, log: log.With("bucket", b.name), ctx: ctx, loaded: make(chan struct{}),
		set: map[string]struct{}{}, removed: map[string]struct{}{}}
}

// namesRetry is how long a names watch that ended waits to start again.
const namesRetry = time.Second

// Load starts the watch (once) and waits, until wait ends, for the keys
// the bucket had when it started.
func (n *Names) Load(wait context.Context) error {
	n.start.Do(func() { go n.run(n.ctx) })
	select {
	case <-n.loaded:
		return nil
	case <-wait.Done():
		return fmt.Errorf("the keys of %s are still loading: %w", n.name, wait.Err())
	}
}

func (n *Names) run(ctx context.Context) { rewatch(ctx, n.log, "names", n.watch) }

// rewatch runs watch until ctx ends, starting it again namesRetry after
// each end.
func rewatch(ctx context.Context, log *slog.Logger, what string, watch func(context.Context) error) {
	for ctx.Err() == nil {
		if err := watch(ctx); err != nil && ctx.Err() == nil {
			log.Warn(what+" watch ended; starting again", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(namesRetry):
		}
	}
}

// Follow calls changed with every key put (present) or deleted, purged
// or expired (the buckets keep limit markers) from the moment it starts
// until ctx ends, from a watch of headers only: a follower pays for the
// changes, not for the keys there are. The watch rides out NATS restarts
// (an ordered consumer resumes where it was); when it ends, or the bucket
// is found recreated (NATS lost its data), it starts again, and the
// changes in between went unseen: restarted is called then (a follower
// that must miss none looks at everything once).
func (b *Bucket[T]) Follow(ctx context.Context, log *slog.Logger, changed func(key string, present bool), restarted func()) {
	log = log.With("bucket", b.name)
	first := true
	rewatch(ctx, log, "follow", func(ctx context.Context) error {
		_, created, err := b.status(ctx)
		if err != nil {
			return err
		}
		w, err := b.kv.Watch(ctx, ">", jetstream.MetaOnly(), jetstream.UpdatesOnly())
		if err != nil {
			return err
		}
		defer func() { _ = w.Stop() }()
		// Told once the new watch runs, so that nothing falls between
		// the follower's look at everything and the watch.
		if !first {
			restarted()
		}
		first = false
		look := time.NewTicker(watchdogEvery)
		defer look.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-look.C:
				sctx, cancel := context.WithTimeout(ctx, watchdogEvery/2)
				_, now, err := b.status(sctx)
				cancel()
				if err == nil && !now.Equal(created) {
					return fmt.Errorf("bucket %s recreated", b.name)
				}
			case e, ok := <-w.Updates():
				switch {
				case !ok:
					return fmt.Errorf("watch of %s closed", b.name)
				case e != nil:
					changed(e.Key(), e.Operation() == jetstream.KeyValuePut)
				}
			}
		}
	})
}

// watch follows the bucket's keys until the watch ends. A new watch
// replays every key, so what it does not bring is gone (the bucket was
// recreated, or deletions passed while none ran).
func (n *Names) watch(ctx context.Context) error {
	w, err := n.kv.Watch(ctx, ">", jetstream.MetaOnly())
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	seen := map[string]struct{}{}
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				return fmt.Errorf("watch of %s closed", n.name)
			case e == nil:
				n.replayed(seen)
				seen = nil
			default:
				if seen != nil {
					seen[e.Key()] = struct{}{}
				}
				n.apply(e.Key(), e.Operation() == jetstream.KeyValuePut)
			}
		}
	}
}

func (n *Names) apply(key string, present bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	_, had := n.set[key]
	switch {
	case present && !had:
		n.set[key] = struct{}{}
		if _, ok := n.removed[key]; ok {
			delete(n.removed, key) // still in sorted
		} else {
			n.added = append(n.added, key)
		}
	case !present && had:
		delete(n.set, key)
		if i := slices.Index(n.added, key); i >= 0 {
			n.added = slices.Delete(n.added, i, i+1)
		} else {
			n.removed[key] = struct{}{}
		}
	default:
		return
	}
	n.updates.Add(1)
}

// replayed drops what a new watch's replay did not bring, and says the
// set is loaded.
func (n *Names) replayed(seen map[string]struct{}) {
	n.mu.Lock()
	var gone []string
	for k := range n.set {
		if _, ok := seen[k]; !ok {
			gone = append(gone, k)
		}
	}
	n.mu.Unlock()
	for _, k := range gone {
		n.apply(k, false)
	}
	select {
	case <-n.loaded:
	default:
		close(n.loaded)
	}
}

// Len is how many keys the bucket has (as far as loaded).
func (n *Names) Len() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.set)
}

// Updates counts the changes applied, so a reader can keep what it made
// of Sorted until the next one.
func (n *Names) Updates() uint64 { return n.updates.Load() }

// Sorted is every key in order. The slice is shared: callers must not
// change it.
func (n *Names) Sorted() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.added) == 0 && len(n.removed) == 0 {
		return n.sorted
	}
	slices.Sort(n.added)
	merged := make([]string, 0, len(n.set))
	i, j := 0, 0
	for i < len(n.sorted) || j < len(n.added) {
		if j == len(n.added) || i < len(n.sorted) && n.sorted[i] < n.added[j] {
			if _, gone := n.removed[n.sorted[i]]; !gone {
				merged = append(merged, n.sorted[i])
			}
			i++
			continue
		}
		merged = append(merged, n.added[j])
		j++
	}
	n.sorted, n.added = merged, nil
	clear(n.removed)
	return n.sorted
}
