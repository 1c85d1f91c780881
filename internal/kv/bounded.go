package kv

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Bounded makes a cache that holds at most limit keys, read on a miss,
// instead of a copy of the whole bucket: what a process holds grows with
// the keys it uses, not with the bucket.
//
// It starts empty (no replay of the bucket's history: its start costs the
// same at ten keys or ten million) and watches changes only from then on.
// Load reads a key it does not hold from the bucket and holds it, present
// or absent, from then on: the watch applies every later change to a held
// key and passes over the others without decoding them, so a held key is
// as current as in a full copy (a deletion anywhere reaches it as fast),
// and Get answers it without a network round trip. Held keys beyond limit
// are forgotten, absent ones first, never one somebody waits on; a
// forgotten key costs one more read when next used.
//
// Range, Keys and Len see the held keys only, and CatchUp says nothing
// about keys not held: whoever must see every key needs a full copy.
func Bounded[T any](limit int) CacheOption[T] {
	return func(c *Cache[T]) {
		c.limit, c.absent, c.reading = max(limit, 1), map[string]uint64{}, map[string]struct{}{}
	}
}

// loadTimeout bounds one read of a key a bounded cache does not hold.
const loadTimeout = 5 * time.Second

// startBounded starts the watch of changes from now on. The cache holds
// nothing yet, so it is complete and current as of now; it notes the
// bucket's last sequence, so that a watch replaced after a stall resumes
// from there, not from the bucket's first revision.
func (c *Cache[T]) startBounded(ctx context.Context, filter string, started time.Time) error {
	last, created, err := c.status(ctx)
	if err != nil {
		return err
	}
	w, err := c.bucket.watch(ctx, []string{filter}, jetstream.UpdatesOnly())
	if err != nil {
		return fmt.Errorf("watch %s: %w", c.bucket.name, err)
	}
	c.created = created
	c.last.Store(last)
	c.confirm(started)
	c.syncedOnce.Do(func() { close(c.synced) })
	go c.run(ctx, w, filter, started)
	return nil
}

// passOver reports whether the watch's change at rev to idx is of a key
// the cache does not hold, and if so counts it as applied: nothing else
// is done with it (not even decoding). Deciding and moving last under mu
// keeps Note's and load's look at both true.
func (c *Cache[T]) passOver(idx string, rev uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.items[idx]; ok {
		return false
	}
	if _, ok := c.absent[idx]; ok || len(c.waiters[idx]) > 0 {
		return false
	}
	if _, ok := c.reading[idx]; ok {
		return false
	}
	if rev > c.last.Load() {
		c.last.Store(rev)
		if c.moved != nil {
			close(c.moved)
			c.moved = nil
		}
	}
	if c.pending.seq != 0 && rev >= c.pending.seq {
		c.confirm(c.pending.at)
		c.pending = look{}
	}
	return true
}

// newerThanHeld is set's rule for a bounded cache's write of idx at rev:
// only over an older revision, present or deleted (a read may have put a
// newer one there while the watch trailed).
func (c *Cache[T]) newerThanHeld(idx string, rev uint64) func(Entry[T], bool) bool {
	return func(cur Entry[T], ok bool) bool {
		return (!ok || cur.Revision < rev) && c.absent[idx] < rev
	}
}

// keep records idx as held present or, deleted at rev, absent, and
// forgets keys beyond the limit; mu is held.
func (c *Cache[T]) keep(idx string, rev uint64, deleted bool) {
	if deleted {
		c.absent[idx] = rev
	} else {
		delete(c.absent, idx)
	}
	c.evict(idx)
}

// evict forgets held keys beyond the limit: absent ones first (what a
// client guessing keys fills), then present ones, never keep nor a key
// somebody waits on. Which ones is left to the map's iteration order, at
// random: no bookkeeping on the read path. mu is held.
func (c *Cache[T]) evict(keep string) {
	over := len(c.items) + len(c.absent) - c.limit
	for idx := range c.absent {
		if over <= 0 {
			return
		}
		if idx != keep && len(c.waiters[idx]) == 0 {
			delete(c.absent, idx)
			over--
			cacheEvictions.Add(1)
		}
	}
	for idx := range c.items {
		if over <= 0 {
			return
		}
		if idx != keep && len(c.waiters[idx]) == 0 {
			delete(c.items, idx)
			over--
			cacheEvictions.Add(1)
		}
	}
}

// Load is Get by the bucket's key, except that a bounded cache that does
// not hold key reads it from the bucket (reads of one key at once are
// joined) and holds it from then on. A read that fails (NATS unreachable,
// a record of a newer schema) reports key absent and holds nothing:
// callers refuse rather than act on what they could not read. In a full
// copy it is Get.
func (c *Cache[T]) Load(ctx context.Context, key string) (Entry[T], bool) {
	idx := c.index(key)
	// A held key (the hot path) allocates nothing: no read to describe.
	if e, ok, held := c.held(idx); held {
		return e, ok
	}
	e, ok, _ := c.LoadBy(ctx, idx, func(ctx context.Context) (Entry[T], error) { return c.bucket.Get(ctx, key) })
	return e, ok
}

// held is idx's entry and whether the cache's answer is final: a full
// copy's always is, a bounded cache's when it holds idx, present or
// absent.
func (c *Cache[T]) held(idx string) (e Entry[T], ok, final bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	e, ok = c.items[idx]
	_, known := c.absent[idx]
	return e, ok, ok || known || c.limit == 0
}

// LoadBy is Load of the entry held under idx (the key's IndexBy index),
// read by read when the cache does not hold it: a reader that finds the
// key another way (by a wildcard) holds it all the same. read answers
// ErrNotFound for an absent key; any other error is returned.
func (c *Cache[T]) LoadBy(ctx context.Context, idx string, read func(context.Context) (Entry[T], error)) (Entry[T], bool, error) {
	if e, ok, final := c.held(idx); final {
		return e, ok, nil
	}
	// What is held outlives the caller's string, which may be a view of
	// a request's bytes that the server reuses (a name from a header, a
	// path or a cookie): the maps keep a copy. A read from NATS follows,
	// so the copy costs nothing that counts.
	idx = strings.Clone(idx)
	v, err, _ := c.flights.Do(idx, func() (any, error) { return c.load(ctx, idx, read) })
	if err != nil {
		return Entry[T]{}, false, err
	}
	got := v.(loaded[T])
	return got.e, got.ok, nil
}

type loaded[T any] struct {
	e  Entry[T]
	ok bool
}

// load reads key from the bucket for Load. The key is marked reading
// meanwhile, so a change the watch brings is applied, and the read's
// answer is kept only if nothing newer came. The answer is Load's either
// way.
func (c *Cache[T]) load(ctx context.Context, idx string, read func(context.Context) (Entry[T], error)) (loaded[T], error) {
	c.mu.Lock()
	if e, ok := c.items[idx]; ok {
		c.mu.Unlock()
		return loaded[T]{e, true}, nil
	}
	if _, ok := c.absent[idx]; ok {
		c.mu.Unlock()
		return loaded[T]{}, nil
	}
	c.reading[idx] = struct{}{}
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), loadTimeout)
	defer cancel()
	e, err := read(ctx)
	if err == nil {
		cacheLoads[loadRead].Add(1)
		// The key stops being read under the same lock that files the
		// answer, so no change can pass between the two unseen.
		c.set(e.Key, idx, e, false, func(cur Entry[T], ok bool) bool {
			delete(c.reading, idx)
			return (!ok || cur.Revision < e.Revision) && c.absent[idx] < e.Revision
		})
		c.mu.RLock()
		defer c.mu.RUnlock()
		if cur, ok := c.items[idx]; ok {
			return loaded[T]{cur, true}, nil
		}
		if c.absent[idx] > e.Revision {
			return loaded[T]{}, nil // deleted since the read
		}
		return loaded[T]{e, true}, nil // forgotten meanwhile: still the bucket's answer
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.reading, idx)
	if !errors.Is(err, ErrNotFound) {
		cacheLoads[loadFailed].Add(1)
		c.log.Warn("key not read", "err", err)
		return loaded[T]{}, err
	}
	cacheLoads[loadAbsent].Add(1)
	cur, ok := c.items[idx] // the watch may have brought it since
	// Held absent, unless an index stands for the key: another key with
	// the same index may be there (a session's hash under another user).
	if _, known := c.absent[idx]; !ok && !known && !c.indexed {
		c.absent[idx] = 0
		c.evict(idx)
	}
	return loaded[T]{cur, ok}, nil
}

// Writing is how a process that is about to write key keeps what it
// writes: the key is held from now on (the watch applies every change to
// it), and done files the write (v at rev; rev 0 when nothing was
// written) unless something newer came first. Unlike Note, the written
// value is held however far the watch is: no change after it can pass
// unseen. In a full copy, done is Note.
func (c *Cache[T]) Writing(key string) (done func(v T, rev uint64)) {
	idx := strings.Clone(c.index(key)) // held past the caller (LoadBy)
	if c.limit == 0 {
		return func(v T, rev uint64) {
			if rev > 0 {
				c.Note(key, v, rev)
			}
		}
	}
	c.mu.Lock()
	c.reading[idx] = struct{}{}
	c.mu.Unlock()
	return func(v T, rev uint64) {
		if rev == 0 {
			c.mu.Lock()
			delete(c.reading, idx)
			c.mu.Unlock()
			return
		}
		c.set(key, idx, Entry[T]{Key: key, Value: v, Revision: rev}, false, func(cur Entry[T], ok bool) bool {
			delete(c.reading, idx)
			return (!ok || cur.Revision < rev) && c.absent[idx] < rev
		})
	}
}

// forgetAll drops every held key of a bounded cache whose bucket was
// recreated (NATS lost its data, or a restore): the new bucket's
// revisions start over, and each key is read from it when next used.
// Subscribers hear of each present key as deleted, as after a full
// copy's reload (watch goroutine only).
func (c *Cache[T]) forgetAll(created time.Time, last uint64, at time.Time) {
	c.mu.Lock()
	gone, waiters := c.items, c.waiters
	c.items, c.absent, c.waiters = map[string]Entry[T]{}, map[string]uint64{}, map[string][]chan struct{}{}
	clear(c.reading) // their reads are of the old bucket: not kept
	c.mu.Unlock()
	c.created, c.pending = created, look{}
	c.last.Store(last)
	for _, ws := range waiters {
		for _, ch := range ws {
			close(ch)
		}
	}
	for _, e := range gone {
		for _, fn := range c.subs {
			fn(e.Key, e, true, Entry[T]{Key: e.Key}, true)
		}
	}
	c.updates.Add(1)
	c.reloads.Add(1)
	cacheReloads.Add(1)
	c.confirm(at)
	c.log.Warn("bucket was recreated (NATS lost its data, or a restore); forgot the keys held", "dropped", len(gone))
}

// The outcomes of bounded caches' reads, for CacheLoads.
const (
	loadRead = iota
	loadAbsent
	loadFailed
)

var (
	cacheLoads     [3]atomic.Uint64
	cacheEvictions atomic.Uint64
)

// CacheLoads is how many keys this process's bounded caches read on a
// miss: found, not in the bucket, and not read (aaas_kv_cache_loads_total).
func CacheLoads() (read, absent, failed uint64) {
	return cacheLoads[loadRead].Load(), cacheLoads[loadAbsent].Load(), cacheLoads[loadFailed].Load()
}

// CacheEvictions is how many held keys this process's bounded caches
// forgot to stay within their limits (aaas_kv_cache_evictions_total).
func CacheEvictions() uint64 { return cacheEvictions.Load() }
