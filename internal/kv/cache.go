package kv

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/singleflight"
)

// Cache is a local copy of a bucket kept current by a watch. Lookups are
// map reads: no network round trip. While NATS is unreachable the cache
// keeps serving what it had; the watch resumes where it left off.
//
// The watch is an ordered consumer, which lives on one NATS node: when
// that node dies the client notices only after missed heartbeats and a
// new consumer (10-20 s, while every write meanwhile stays invisible
// here). A watchdog compares the bucket's last sequence with the last
// revision applied and, when the watch has stopped moving while the
// bucket has not, replaces it with one resuming after that revision. The
// same looks say how current the cache is (Current): a reader that must
// not act on an old copy (the edge routing to a pod address) can refuse
// to once it has not been confirmed for too long.
type Cache[T any] struct {
	bucket *Bucket[T]
	index  func(key string) string
	log    *slog.Logger

	mu      sync.RWMutex
	items   map[string]Entry[T]
	waiters map[string][]chan struct{}
	subs    []replaced[T]

	synced     chan struct{}
	syncedOnce sync.Once
	turnOnce   sync.Once
	updates    atomic.Uint64
	resumes    atomic.Uint64
	// last is the highest revision applied (revisions are the bucket
	// stream's sequence numbers, increasing across keys; only the watch
	// goroutine writes it).
	last atomic.Uint64
	// confirmed is Current in Unix nanoseconds (0: never); pending is a
	// look at the bucket the watch had not caught up with yet (watch
	// goroutine only).
	confirmed atomic.Int64
	pending   look
	// moved is closed when last next advances; made by the first CatchUp
	// waiting for it (nil: nobody waits), guarded by mu.
	moved chan struct{}
	// created is when the bucket's stream was made, as first seen;
	// reloading, while a recreated bucket loads, holds the (indexed) keys
	// it brought (nil otherwise). Both watch goroutine only.
	created   time.Time
	reloading map[string]struct{}
	reloads   atomic.Uint64

	// limit is Bounded's (0: a full copy); the rest is a bounded cache's.
	limit int
	// absent holds the (indexed) keys the cache holds as missing from the
	// bucket, with the revision of the deletion that said so (0: a read
	// did). Guarded by mu.
	absent map[string]uint64
	// reading holds the keys being read for Load (guarded by mu).
	reading map[string]struct{}
	// indexed is set by IndexBy: Wait cannot read such a key by its index.
	indexed bool
	flights singleflight.Group
}

// look is the bucket's last sequence as read at a moment.
type look struct {
	seq uint64
	at  time.Time
}

// CacheOption adjusts a cache.
type CacheOption[T any] func(*Cache[T])

// IndexBy stores entries under index(key) instead of key, for lookups by a
// part of the key (sessions are looked up by sid hash alone).
func IndexBy[T any](index func(key string) string) CacheOption[T] {
	return func(c *Cache[T]) { c.index, c.indexed = index, true }
}

// OnChange registers fn to run (in the watch goroutine) after every change.
func OnChange[T any](fn func(key string, e Entry[T], deleted bool)) CacheOption[T] {
	return OnReplace(func(key string, _ Entry[T], _ bool, e Entry[T], deleted bool) { fn(key, e, deleted) })
}

// OnReplace is OnChange told also the entry the change replaced (had:
// there was one): a count of the entries by a field needs no copy of its
// own of what each was, to take it back. A Note runs it too, in the
// noting goroutine; each change's was and e are read together, so the
// changes' deltas add up whatever order they are told in. A bounded
// cache's evictions are not changes: count over a full copy.
func OnReplace[T any](fn func(key string, was Entry[T], had bool, e Entry[T], deleted bool)) CacheOption[T] {
	return func(c *Cache[T]) { c.subs = append(c.subs, fn) }
}

// replaced is an OnReplace function.
type replaced[T any] func(key string, was Entry[T], had bool, e Entry[T], deleted bool)

// NewCache starts watching b (keys matching filter, ">" for all) until ctx
// ends. Synced is closed once the initial contents are loaded: a full
// copy loads in its turn (one at a time per process) and keeps trying
// while NATS cannot start its watch.
func NewCache[T any](ctx context.Context, b *Bucket[T], filter string, log *slog.Logger, opts ...CacheOption[T]) (*Cache[T], error) {
	c := &Cache[T]{
		bucket:  b,
		index:   func(k string) string { return k },
		log:     log.With("bucket", b.name),
		items:   map[string]Entry[T]{},
		waiters: map[string][]chan struct{}{},
		synced:  make(chan struct{}),
	}
	for _, o := range opts {
		o(c)
	}
	// The initial contents are the bucket's as of some moment after this
	// one: once loaded, the cache is current as of it.
	if c.limit > 0 {
		return c, c.startBounded(ctx, filter, time.Now())
	}
	go c.start(ctx, filter)
	return c, nil
}

// replaying paces the full copies' initial loads: one at a time in a
// process, so that a process starting against large buckets never has
// several replays in flight at once (which once got an edge cut off as a
// slow consumer). A load that takes longer than replayTurn lets the next
// one start beside it rather than hold it back.
var replaying = make(chan struct{}, 1)

const replayTurn = 30 * time.Second

// start starts a full copy's watch in its turn, trying again (with a
// growing pause) while the watch cannot be made, and runs it: a cache
// that cannot start yet is not synced (readiness says so), never an
// error that ends the process.
func (c *Cache[T]) start(ctx context.Context, filter string) {
	select {
	case replaying <- struct{}{}:
	case <-ctx.Done():
		return
	}
	loadsInTurn(1)
	turn := time.AfterFunc(replayTurn, func() { c.endTurn() })
	go func() {
		select {
		case <-c.synced:
		case <-ctx.Done():
		}
		if turn.Stop() {
			c.endTurn()
		}
	}()
	for attempt := 1; ; attempt++ {
		started := time.Now()
		w, err := c.bucket.watch(ctx, []string{filter})
		if err == nil {
			if filter == ">" {
				// Which stream this is, so that its loss is noticed
				// (else the first look says).
				if _, created, ok := c.peek(ctx); ok {
					c.created = created
				}
			}
			c.run(ctx, w, filter, started)
			return
		}
		c.log.Warn("cache not started; trying again", "attempt", attempt, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(min(time.Duration(attempt)*time.Second, 10*time.Second)):
		}
	}
}

// endTurn lets the next full copy load.
func (c *Cache[T]) endTurn() {
	c.turnOnce.Do(func() {
		loadsInTurn(-1)
		<-replaying
	})
}

// loading is how many full copies are loading in their turn now, and
// loadingMost the most there ever were at once (for tests).
var loading, loadingMost atomic.Int64

func loadsInTurn(d int64) {
	if n := loading.Add(d); n > loadingMost.Load() {
		loadingMost.Store(n)
	}
}

// watchdogEvery is how often the watchdog compares; a watch that has not
// moved over two looks while the bucket has is replaced.
const watchdogEvery = 2 * time.Second

func (c *Cache[T]) run(ctx context.Context, w jetstream.KeyWatcher, filter string, started time.Time) {
	defer func() { _ = w.Stop() }()
	tick := time.NewTicker(watchdogEvery)
	defer tick.Stop()
	var dog watchdog
	updates := w.Updates()
	// reloadedAt is when the current reload's watch started (zero: none).
	var reloadedAt time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			// Only a watch of every key must reach the stream's last
			// sequence.
			if filter != ">" {
				continue
			}
			asked := time.Now()
			last, created, ok := c.peek(ctx)
			// Before its first load a watch is watched too: one made
			// while NATS was going away may never bring anything, and
			// the cache would never be synced (nor its process ready).
			synced := c.IsSynced()
			if synced && ok && c.recreated(last, created) {
				// NATS lost the bucket and setup made it again (or a
				// restore replaced it): revisions start over, so the
				// watch starts over too, and what the new bucket does
				// not hold is dropped once it is loaded.
				if c.limit > 0 {
					nw, err := c.bucket.watch(ctx, []string{filter}, jetstream.UpdatesOnly())
					if err != nil {
						c.log.Warn("recreated bucket not followed", "err", err)
						continue
					}
					_ = w.Stop()
					w, updates, dog = nw, nw.Updates(), watchdog{}
					c.forgetAll(created, last, asked)
					continue
				}
				nw, err := c.bucket.watch(ctx, []string{filter})
				if err != nil {
					c.log.Warn("recreated bucket not reloaded", "err", err)
					continue
				}
				_ = w.Stop()
				w, updates, dog, reloadedAt = nw, nw.Updates(), watchdog{}, asked
				c.beginReload(created)
				c.log.Warn("bucket was recreated (NATS lost its data, or a restore); reloading it")
				continue
			}
			if synced && ok {
				c.looked(look{seq: last, at: asked})
			}
			if updates != nil && !dog.stalled(last, c.last.Load()) {
				continue
			}
			from := c.last.Load() + 1
			nw, err := c.bucket.watch(ctx, []string{filter}, jetstream.ResumeFromRevision(from))
			if err != nil {
				// Still stalled: tried again at the next look.
				c.log.Warn("stalled watch not replaced", "err", err)
				continue
			}
			dog.resumed()
			_ = w.Stop()
			w, updates = nw, nw.Updates()
			c.resumes.Add(1)
			c.log.Warn("watch stalled behind the bucket; resumed on a new one", "from_revision", from)
		case e, ok := <-updates:
			if !ok {
				// A watch of every key is replaced at the next look
				// (its stream may have gone with NATS's data); any
				// other ends here, as it always did.
				if filter != ">" {
					return
				}
				updates = nil
				continue
			}
			if e == nil {
				c.syncedOnce.Do(func() {
					c.confirm(started)
					close(c.synced)
				})
				if !reloadedAt.IsZero() {
					c.endReload(reloadedAt)
					reloadedAt = time.Time{}
				}
				continue
			}
			c.apply(e)
		}
	}
}

// recreated reports whether the bucket's stream is not the one the cache
// has followed: created at another moment, or ending before the revision
// the cache has applied. The first look only notes when it was created.
func (c *Cache[T]) recreated(last uint64, created time.Time) bool {
	if c.created.IsZero() {
		c.created = created
		return false
	}
	return !created.Equal(c.created) || last < c.last.Load()
}

// beginReload forgets the old bucket's revisions and starts noting the
// keys the new watch brings (watch goroutine only).
func (c *Cache[T]) beginReload(created time.Time) {
	c.created = created
	c.pending = look{}
	c.last.Store(0)
	c.reloading = map[string]struct{}{}
}

// endReload drops every entry the recreated bucket did not bring, telling
// the subscribers, once its initial load is in.
func (c *Cache[T]) endReload(started time.Time) {
	c.mu.Lock()
	var gone []Entry[T]
	var idxs []string
	for idx, e := range c.items {
		if _, ok := c.reloading[idx]; !ok {
			gone, idxs = append(gone, e), append(idxs, idx)
		}
	}
	c.mu.Unlock()
	c.reloading = nil
	for i, e := range gone {
		c.set(e.Key, idxs[i], Entry[T]{}, true, nil)
	}
	c.reloads.Add(1)
	cacheReloads.Add(1)
	c.confirm(started)
	c.log.Warn("recreated bucket reloaded", "dropped", len(gone))
}

// status is the bucket's last sequence and its stream's creation time; an
// error means the stream cannot say (NATS unreachable, no leader right
// now: nothing to compare with).
func (c *Cache[T]) status(ctx context.Context) (uint64, time.Time, error) {
	return c.bucket.status(ctx)
}

func (b *Bucket[T]) status(ctx context.Context) (uint64, time.Time, error) {
	st, err := b.kv.Status(ctx)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("status of %s: %w", b.name, err)
	}
	s, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok {
		return 0, time.Time{}, fmt.Errorf("status of %s: unexpected type %T", b.name, st)
	}
	return s.StreamInfo().State.LastSeq, s.StreamInfo().Created, nil
}

// peek is status within half a watchdog period, for the watchdog.
func (c *Cache[T]) peek(ctx context.Context) (uint64, time.Time, bool) {
	ctx, cancel := context.WithTimeout(ctx, watchdogEvery/2)
	defer cancel()
	last, created, err := c.status(ctx)
	return last, created, err == nil
}

// looked takes in what the bucket said at l.at: the cache is current as
// of then once it has applied l.seq. The oldest look not yet caught up
// with is kept, so a watch that always trails by a little still confirms.
func (c *Cache[T]) looked(l look) {
	switch {
	case c.last.Load() >= l.seq:
		c.confirm(l.at)
		c.pending = look{}
	case c.pending.seq == 0:
		c.pending = l
	}
}

func (c *Cache[T]) confirm(at time.Time) {
	if n := at.UnixNano(); n > c.confirmed.Load() {
		c.confirmed.Store(n)
	}
}

// Current is the latest moment at which the cache is known to have held
// every write the bucket had: its initial load, then each watchdog look
// (every watchdogEvery) whose sequence the watch has applied. Whatever the
// cache says was true then, or later. It is kept for a watch of every key
// (filter ">") and is zero before the initial load; while NATS cannot be
// reached it stays where it was.
func (c *Cache[T]) Current() time.Time {
	n := c.confirmed.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// watchdog decides from successive looks whether a watch is stuck.
type watchdog struct {
	applied uint64 // the revision applied at the previous look
	behind  bool   // the previous look found the bucket ahead
	last    uint64 // the bucket's last sequence at the previous look
	// resumedAt is the bucket's last sequence when the watch was last
	// replaced: a sequence the stream removed before anyone saw it (a
	// per-key TTL) would otherwise look like a stall forever.
	resumedAt uint64
}

// stalled reports whether the watch, at applied, has not moved since the
// previous look while the bucket, at last, is ahead of it both times. It
// keeps saying so at every look until resumed.
func (d *watchdog) stalled(last, applied uint64) bool {
	behind := last > applied && last != d.resumedAt
	stuck := behind && d.behind && applied == d.applied
	d.applied, d.behind, d.last = applied, behind, last
	return stuck
}

// resumed records that the watch was replaced after the look that found
// it stalled.
func (d *watchdog) resumed() { d.resumedAt, d.behind = d.last, false }

// Note puts an entry read or written by this process (at rev) into the
// cache without waiting for the watch to bring it: the writer's next
// lookup must find it even while the watch lags (a node loss). It is kept
// only while the watch is behind rev: once the watch has passed rev, the
// cache already says what became of the key since (a deletion included),
// and a noted value must not undo that.
//
// In a bounded cache the same rule holds the key from then on: the watch,
// not yet at rev, brings every later change to it. Once the watch has
// passed rev, a key the cache did not hold then is left to the next Load.
func (c *Cache[T]) Note(key string, v T, rev uint64) {
	idx := c.index(key)
	c.set(key, idx, Entry[T]{Key: key, Value: v, Revision: rev}, false, func(cur Entry[T], ok bool) bool {
		return c.last.Load() < rev && (!ok || cur.Revision < rev) && c.absent[idx] < rev
	})
}

func (c *Cache[T]) apply(e jetstream.KeyValueEntry) {
	key := e.Key()
	if c.limit > 0 && c.passOver(c.index(key), e.Revision()) {
		return // a bounded cache sees every change, and holds few
	}
	// A key is a slice of its message's subject ("$KV.<bucket>.<key>"):
	// held as it is, it would keep the whole subject alive, three times
	// its own size for a user's name. Copied only once it is to be held.
	key = strings.Clone(key)
	idx := c.index(key)
	if c.reloading != nil {
		c.reloading[idx] = struct{}{}
	}
	deleted := e.Operation() != jetstream.KeyValuePut
	var entry Entry[T]
	if !deleted {
		if err := decodeInto(e.Value(), &entry.Value); err != nil {
			// Left out, not kept as it was: a newer release's record must
			// not be acted on in an older schema, nor the record it
			// replaced in its stead (readers that miss ask the bucket,
			// which refuses it too, saying why).
			c.log.Warn("value left out", "key", key, "revision", e.Revision(), "err", err)
			deleted = true
		}
	}
	entry.Key, entry.Revision = key, e.Revision()

	// Stored before last moves on: a CatchUp that sees last reach this
	// revision must find the entry. A bounded cache's reads may have put
	// a newer revision there already.
	var newer func(Entry[T], bool) bool
	if c.limit > 0 {
		newer = c.newerThanHeld(idx, entry.Revision)
	}
	c.set(key, idx, entry, deleted, newer)
	if r := e.Revision(); r > c.last.Load() {
		c.mu.Lock()
		c.last.Store(r)
		if c.moved != nil {
			close(c.moved)
			c.moved = nil
		}
		c.mu.Unlock()
		if c.pending.seq != 0 && r >= c.pending.seq {
			c.confirm(c.pending.at)
			c.pending = look{}
		}
	}
}

// set stores (or, deleted, drops) the entry under idx when newer (nil:
// always) agrees with what is there, wakes the key's waiters and tells
// the subscribers.
func (c *Cache[T]) set(key, idx string, entry Entry[T], deleted bool, newer func(cur Entry[T], ok bool) bool) {
	c.mu.Lock()
	was, had := c.items[idx]
	if newer != nil && !newer(was, had) {
		c.mu.Unlock()
		return
	}
	if deleted {
		delete(c.items, idx)
	} else {
		c.items[idx] = entry
	}
	if c.limit > 0 {
		c.keep(idx, entry.Revision, deleted)
	}
	ws := c.waiters[idx]
	delete(c.waiters, idx)
	c.mu.Unlock()
	c.updates.Add(1)

	for _, ch := range ws {
		close(ch)
	}
	for _, fn := range c.subs {
		fn(key, was, had, entry, deleted)
	}
}

// CatchUp returns once the cache holds every write the bucket had when it
// was called: it asks the bucket's last sequence and waits for the watch
// to apply it. A reader that misses a key another process wrote a moment
// ago, and cannot name the key to read it itself, asks this instead. It
// costs one request to the stream; an error means the bucket could not
// say or ctx ended first.
func (c *Cache[T]) CatchUp(ctx context.Context) error {
	want, _, err := c.status(ctx)
	if err != nil {
		return err
	}
	for {
		c.mu.Lock()
		if c.last.Load() >= want {
			c.mu.Unlock()
			return nil
		}
		if c.moved == nil {
			c.moved = make(chan struct{})
		}
		ch := c.moved
		c.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("catching up with %s at %d: %w", c.bucket.name, want, ctx.Err())
		}
	}
}

// Synced is closed once the cache holds the bucket's contents as of the
// moment the watch started.
func (c *Cache[T]) Synced() <-chan struct{} { return c.synced }

// IsSynced reports whether Synced is closed.
func (c *Cache[T]) IsSynced() bool {
	select {
	case <-c.synced:
		return true
	default:
		return false
	}
}

// Get looks up an entry by its (indexed) key.
func (c *Cache[T]) Get(key string) (Entry[T], bool) {
	c.mu.RLock()
	e, ok := c.items[key]
	c.mu.RUnlock()
	return e, ok
}

// GetBytes is Get for a key held in a byte slice. It does not allocate,
// which matters on the per-request authentication path.
func (c *Cache[T]) GetBytes(key []byte) (Entry[T], bool) {
	c.mu.RLock()
	e, ok := c.items[string(key)]
	c.mu.RUnlock()
	return e, ok
}

// Len is the number of entries.
func (c *Cache[T]) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.items)
}

// Keys lists the keys of every entry.
func (c *Cache[T]) Keys() []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	keys := make([]string, 0, len(c.items))
	for _, e := range c.items {
		keys = append(keys, e.Key)
	}
	return keys
}

// Updates counts changes applied since start (for metrics and tests).
func (c *Cache[T]) Updates() uint64 { return c.updates.Load() }

// Resumes counts the watches the watchdog replaced (for metrics and tests).
func (c *Cache[T]) Resumes() uint64 { return c.resumes.Load() }

// Reloads counts the times the bucket was found recreated and loaded
// afresh (for tests).
func (c *Cache[T]) Reloads() uint64 { return c.reloads.Load() }

// cacheReloads counts every cache's reloads in this process.
var cacheReloads atomic.Uint64

// CacheReloads is how many times this process's caches found their bucket
// recreated and loaded it afresh (aaas_kv_cache_reloads_total).
func CacheReloads() uint64 { return cacheReloads.Load() }

// Range calls fn for every entry until it returns false. fn must not call
// back into the cache.
func (c *Cache[T]) Range(fn func(Entry[T]) bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, e := range c.items {
		if !fn(e) {
			return
		}
	}
}

// Wait blocks until done(entry, present) holds for key, or ctx ends. It
// checks the current entry first, then re-checks after every change to key.
//
// A bounded cache first holds key (Load), so that the watch brings its
// changes, and keeps it while anyone waits; a key of an IndexBy cache
// must be held already.
func (c *Cache[T]) Wait(ctx context.Context, key string, done func(e Entry[T], ok bool) bool) (Entry[T], bool, error) {
	if c.limit > 0 && !c.indexed {
		c.Load(ctx, key)
	}
	for {
		c.mu.Lock()
		e, ok := c.items[key]
		if done(e, ok) {
			c.mu.Unlock()
			return e, ok, nil
		}
		ch := make(chan struct{})
		c.waiters[key] = append(c.waiters[key], ch)
		c.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			c.dropWaiter(key, ch)
			return e, ok, ctx.Err()
		}
	}
}

func (c *Cache[T]) dropWaiter(key string, ch chan struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ws := c.waiters[key]
	for i, w := range ws {
		if w == ch {
			c.waiters[key] = append(ws[:i], ws[i+1:]...)
			break
		}
	}
	if len(c.waiters[key]) == 0 {
		delete(c.waiters, key)
	}
}
