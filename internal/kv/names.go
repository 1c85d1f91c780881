package kv

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Names is the set of one or more buckets' keys, without their values
// (a key is in it while any of the buckets has it): what a view of every
// key needs (the admin list, a count against a cap) at a few dozen bytes a
// key, where a bounded cache holds only the keys in use. It loads when
// first asked for (Load), by a watch of each bucket's keys' headers only,
// and is kept by those watches from then on: a process that never asks
// pays nothing.
//
// Reads merge on read: the keys in order are a sorted base, less the base
// keys gone since, plus the keys added since (kept sorted). A read of a
// page costs a binary search and the page, whatever the count, and a
// write costs a binary insertion into the few changes; the changes fold
// into the base once they outgrow a small share of it (compactAt), so
// that folding costs a few key moves per change, not a merge of every
// key after each one.
type Names struct {
	sources []KeySource
	log     *slog.Logger
	// ctx is the watches' life, from the first Load on.
	ctx context.Context

	start  sync.Once
	loaded chan struct{}

	mu      sync.Mutex
	in      map[string]uint8 // the sources (a bit each) that have the key
	counts  []int            // keys per source
	base    []string         // sorted; less gone, plus added, is the set
	added   []string         // keys not in base; sorted unless unsorted
	gone    map[string]struct{}
	replays int    // replays under way: added is appended to, unsorted
	unsort  bool   // added needs sorting before it is read
	first   []bool // the sources whose first replay has ended
}

// KeySource is a bucket whose keys a Names follows.
type KeySource struct {
	kv   jetstream.KeyValue
	name string
}

// Keys is b as a source of keys for NewNames.
func (b *Bucket[T]) KeySource() KeySource { return KeySource{b.kv, b.name} }

// maxSources bounds the buckets one Names follows (a bit each).
const maxSources = 8

// NewNames is the (not yet loaded) union of the sources' keys, whose
// watches, once started, run until ctx ends.
func NewNames(ctx context.Context, log *slog.Logger, sources ...KeySource) *Names {
	if len(sources) == 0 || len(sources) > maxSources {
		panic(fmt.Sprintf("kv.NewNames: %d sources, want 1 to %d", len(sources), maxSources))
	}
	n := &Names{sources: sources, log: log, ctx: ctx, loaded: make(chan struct{}),
		in: map[string]uint8{}, counts: make([]int, len(sources)), gone: map[string]struct{}{}, first: make([]bool, len(sources))}
	return n
}

// namesRetry is how long a names watch that ended waits to start again.
const namesRetry = time.Second

// Load starts the watch (once) and waits, until wait ends, for the keys
// the bucket had when it started.
func (n *Names) Load(wait context.Context) error {
	n.start.Do(func() {
		for i, src := range n.sources {
			log := n.log.With("bucket", src.name)
			go rewatch(n.ctx, log, "names", func(ctx context.Context) error { return n.watch(ctx, i) })
		}
	})
	select {
	case <-n.loaded:
		return nil
	case <-wait.Done():
		return fmt.Errorf("the keys of %s are still loading: %w", n.sources[0].name, wait.Err())
	}
}

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
		w, err := b.watch(ctx, []string{">"}, jetstream.MetaOnly(), jetstream.UpdatesOnly())
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

// watch follows source i's keys until the watch ends. A new watch
// replays every key, so what it does not bring is gone (the bucket was
// recreated, or deletions passed while none ran).
func (n *Names) watch(ctx context.Context, i int) error {
	src := n.sources[i]
	w, err := watch(ctx, src.kv, src.name, []string{">"}, jetstream.MetaOnly())
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	n.replaying(1)
	seen := map[string]struct{}{}
	defer func() {
		if seen != nil {
			n.replaying(-1) // ended mid-replay
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				return fmt.Errorf("watch of %s closed", src.name)
			case e == nil:
				n.replayed(i, seen)
				seen = nil
			default:
				// A key is a slice of its message's subject: held as it
				// is, it would keep the whole subject alive.
				key := strings.Clone(e.Key())
				if seen != nil {
					seen[key] = struct{}{}
				}
				n.apply(key, i, e.Operation() == jetstream.KeyValuePut)
			}
		}
	}
}

// replaying counts a replay starting (+1) or ending (-1). While one runs,
// keys arrive by the million in no order: they are appended, and sorted
// once when it ends, rather than inserted one by one.
func (n *Names) replaying(d int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.replays += d; n.replays == 0 {
		n.sortAdded()
		n.compactIfDue()
	}
}

// apply records that source i has key (present) or not.
func (n *Names) apply(key string, i int, present bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	was := n.in[key]
	now := was &^ (1 << i)
	if present {
		now |= 1 << i
	}
	if now == was {
		return
	}
	if present {
		n.counts[i]++
	} else {
		n.counts[i]--
	}
	if now == 0 {
		delete(n.in, key)
	} else {
		n.in[key] = now
	}
	switch {
	case was != 0 && now != 0: // still in the set: the order holds
	case now != 0:
		if _, ok := n.gone[key]; ok {
			delete(n.gone, key) // still in base
		} else {
			n.add(key)
		}
	default:
		if j, ok := n.findAdded(key); ok {
			n.added = slices.Delete(n.added, j, j+1)
		} else {
			n.gone[key] = struct{}{}
		}
	}
	n.compactIfDue()
}

// add puts key, in no list yet, into added: in order, but for a replay's.
func (n *Names) add(key string) {
	if n.replays > 0 || n.unsort {
		n.added, n.unsort = append(n.added, key), true
		return
	}
	j, _ := slices.BinarySearch(n.added, key)
	n.added = slices.Insert(n.added, j, key)
}

// findAdded is where key is in added.
func (n *Names) findAdded(key string) (int, bool) {
	if n.unsort {
		j := slices.Index(n.added, key)
		return j, j >= 0
	}
	return slices.BinarySearch(n.added, key)
}

func (n *Names) sortAdded() {
	if n.unsort {
		slices.Sort(n.added)
		n.unsort = false
	}
}

// compactAt is how many changes the base carries before they fold into
// it: a share of the base (so folding costs a few moves per change at any
// size), never fewer than a floor (so a small set is not rebuilt on
// every write).
func compactAt(base int) int { return max(4096, base/16) }

// compactIfDue folds the changes into the base when they have outgrown
// it, unless a replay is under way (it folds when it ends).
func (n *Names) compactIfDue() {
	if n.replays > 0 || len(n.added)+len(n.gone) <= compactAt(len(n.base)) {
		return
	}
	n.sortAdded()
	merged := n.merge("", 0)
	n.base, n.added = merged, nil
	clear(n.gone)
}

// replayed drops what source i's new watch's replay did not bring, and
// says the set is loaded once every source's first replay has ended.
func (n *Names) replayed(i int, seen map[string]struct{}) {
	n.mu.Lock()
	var gone []string
	for k, in := range n.in {
		if _, ok := seen[k]; !ok && in&(1<<i) != 0 {
			gone = append(gone, k)
		}
	}
	n.mu.Unlock()
	for _, k := range gone {
		n.apply(k, i, false)
	}
	n.replaying(-1)
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.first[i] {
		return
	}
	n.first[i] = true
	if !slices.Contains(n.first, false) {
		close(n.loaded)
	}
}

// Loaded reports whether Load has loaded every source's keys.
func (n *Names) Loaded() bool {
	select {
	case <-n.loaded:
		return true
	default:
		return false
	}
}

// Has reports whether any source has key.
func (n *Names) Has(key string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.in[key] != 0
}

// Len is how many keys there are in any source (as far as loaded).
func (n *Names) Len() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.in)
}

// LenOf is how many keys source i (in NewNames' order) has.
func (n *Names) LenOf(i int) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.counts[i]
}

// Range is up to limit keys (0: no limit) in order from the first at or
// after from ("": the first of all), merged from the base and the
// changes on read. The slice is the caller's.
func (n *Names) Range(from string, limit int) []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.sortAdded()
	return n.merge(from, limit)
}

// merge is up to limit keys (0: all) in order from the first at or after
// from: base's, less gone, merged with added (sorted).
func (n *Names) merge(from string, limit int) []string {
	i, _ := slices.BinarySearch(n.base, from)
	j, _ := slices.BinarySearch(n.added, from)
	size := len(n.in)
	if limit > 0 {
		size = min(size, limit)
	}
	out := make([]string, 0, size)
	for (i < len(n.base) || j < len(n.added)) && (limit <= 0 || len(out) < limit) {
		if j == len(n.added) || i < len(n.base) && n.base[i] < n.added[j] {
			if _, gone := n.gone[n.base[i]]; !gone {
				out = append(out, n.base[i])
			}
			i++
			continue
		}
		out = append(out, n.added[j])
		j++
	}
	return out
}
