// Package kv is generic typed storage on NATS JetStream key-value
// buckets: typed accessors with compare-and-set and per-key TTLs,
// watch-backed local caches that answer lookups without a network round
// trip (and let callers wait for a change), and leases for
// one-active-replica roles. What the buckets hold is defined in state.
package kv

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Errors callers test for with errors.Is.
var (
	ErrNotFound = errors.New("key not found")
	ErrExists   = errors.New("key already exists")
	// ErrConflict is a compare-and-set failure: someone wrote the key since
	// the revision the caller read.
	ErrConflict = errors.New("revision conflict")
	// ErrFull is a write the bucket refused because it is at its cap
	// (state.BucketsConfig: EXPECTED_ACCOUNTS and the records' sizes), or
	// the server's store is: nothing is written until records go or an
	// operator grows it, and asking again changes nothing.
	ErrFull = errors.New("the bucket is full")
)

// Bucket is a typed view of one key-value bucket; values are JSON.
type Bucket[T any] struct {
	kv   jetstream.KeyValue
	js   jetstream.JetStream
	name string
	// failover is how long a read keeps trying while the bucket has no
	// leader (the JetStream handle's, when it has one: natsconn's).
	failover time.Duration
}

// Open returns a typed view of an existing bucket.
func Open[T any](ctx context.Context, js jetstream.JetStream, name string) (*Bucket[T], error) {
	kv, err := js.KeyValue(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("open bucket %s: %w", name, err)
	}
	b := &Bucket[T]{kv: kv, js: js, name: name}
	if f, ok := js.(interface{ FailoverWait() time.Duration }); ok {
		b.failover = f.FailoverWait()
	}
	return b, nil
}

// watchMade bounds the making of a watch: the request that creates its
// consumer can go unanswered (sent while NATS restarts, or over a link
// that drops it), and nats.go waits for that answer until the deadline of
// the watch's context (its own 5 s only when there is none). Under a far
// deadline a cache stayed unloaded, and its watchdog unstarted, that long.
const watchMade = 5 * time.Second

// watch starts a watch of the keys matching filters. Its context must
// outlive the watch (nats.go ends the watch's subscription when it ends),
// so the bound on its making is a cancel of a context of its own, which
// Stop releases.
func (b *Bucket[T]) watch(ctx context.Context, filters []string, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
	return watch(ctx, b.kv, b.name, filters, opts...)
}

func watch(ctx context.Context, kv jetstream.KeyValue, bucket string, filters []string, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
	what := strings.Join(filters, ",")
	ctx, cancel := context.WithCancel(ctx)
	late := time.AfterFunc(watchMade, cancel)
	// WatchFiltered writes the bucket's prefix into the slice it is given.
	w, err := kv.WatchFiltered(ctx, slices.Clone(filters), opts...)
	if !late.Stop() {
		if err == nil {
			_ = w.Stop()
		}
		cancel()
		return nil, fmt.Errorf("watch %s/%s: not made within %v", bucket, what, watchMade)
	}
	if err != nil {
		cancel()
		return nil, fmt.Errorf("watch %s/%s: %w", bucket, what, err)
	}
	return stoppable{w, cancel}, nil
}

// stoppable is a watch whose Stop also releases its context.
type stoppable struct {
	jetstream.KeyWatcher
	cancel context.CancelFunc
}

func (s stoppable) Stop() error {
	defer s.cancel()
	return s.KeyWatcher.Stop()
}

// Leaderless reports whether err means the stream had no leader to answer
// (or lost it mid-request), as opposed to a refusal: worth asking again
// while a NATS node's streams elect new leaders.
func Leaderless(ctx context.Context, err error) bool {
	switch {
	case errors.Is(err, jetstream.ErrNoStreamResponse), errors.Is(err, nats.ErrNoResponders), errors.Is(err, nats.ErrTimeout):
		return true
	case errors.Is(err, context.DeadlineExceeded):
		return ctx.Err() == nil // the attempt's own timeout, not the caller's
	}
	return false
}

// Name is the bucket name.
func (b *Bucket[T]) Name() string { return b.name }

// Entry is a value with the revision it was read at.
type Entry[T any] struct {
	Key      string
	Value    T
	Revision uint64
}

// Get reads key; ErrNotFound when absent or deleted. While the bucket has
// no leader it asks again, for up to the handle's failover wait.
func (b *Bucket[T]) Get(ctx context.Context, key string) (Entry[T], error) {
	e, err := b.kv.Get(ctx, key)
	for deadline, attempt := time.Now().Add(b.failover), 1; err != nil && Leaderless(ctx, err) && time.Now().Before(deadline); attempt++ {
		if serr := sleepCtx(ctx, min(time.Duration(attempt)*100*time.Millisecond, time.Second)); serr != nil {
			break
		}
		e, err = b.kv.Get(ctx, key)
	}
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
			return Entry[T]{}, fmt.Errorf("get %s/%s: %w", b.name, key, ErrNotFound)
		}
		return Entry[T]{}, fmt.Errorf("get %s/%s: %w", b.name, key, err)
	}
	return b.decode(e)
}

func (b *Bucket[T]) decode(e jetstream.KeyValueEntry) (Entry[T], error) {
	var v T
	if err := decodeInto(e.Value(), &v); err != nil {
		return Entry[T]{}, fmt.Errorf("decode %s/%s: %w", b.name, e.Key(), err)
	}
	return Entry[T]{Key: e.Key(), Value: v, Revision: e.Revision()}, nil
}

// WriteOption adjusts a write.
type WriteOption func(*writeOpts)

type writeOpts struct{ ttl time.Duration }

// WithTTL makes the server remove the key after d unless it is written
// again. The bucket must have been created with per-key TTLs enabled.
func WithTTL(d time.Duration) WriteOption { return func(o *writeOpts) { o.ttl = d } }

func writeOptions(opts []WriteOption) writeOpts {
	var o writeOpts
	for _, f := range opts {
		f(&o)
	}
	return o
}

// Writes, deletes and purges go through the JetStream handle the bucket
// was opened with (not the KV client's own), so a handle that rides
// through leader elections (natsconn's) covers them.

// Put writes key unconditionally.
func (b *Bucket[T]) Put(ctx context.Context, key string, v T, opts ...WriteOption) (uint64, error) {
	return b.publish(ctx, key, v, -1, writeOptions(opts).ttl)
}

// Create writes key only if it does not exist (or was deleted); ErrExists
// otherwise.
func (b *Bucket[T]) Create(ctx context.Context, key string, v T, opts ...WriteOption) (uint64, error) {
	o := writeOptions(opts)
	rev, err := b.publish(ctx, key, v, 0, o.ttl)
	if !errors.Is(err, ErrConflict) {
		return rev, err
	}
	// The key has a last message: a value (it exists) or a delete or purge
	// marker (it may be created again). The KV client tells which.
	data, err := encode(v)
	if err != nil {
		return 0, fmt.Errorf("create %s/%s: %w", b.name, key, err)
	}
	var copts []jetstream.KVCreateOpt
	if o.ttl > 0 {
		copts = append(copts, jetstream.KeyTTL(o.ttl))
	}
	rev, err = b.kv.Create(ctx, key, data, copts...)
	if err != nil {
		switch {
		case errors.Is(err, jetstream.ErrKeyExists):
			return 0, fmt.Errorf("create %s/%s: %w", b.name, key, ErrExists)
		case isFull(err):
			return 0, fmt.Errorf("create %s/%s: %w (%w)", b.name, key, ErrFull, err)
		}
		return 0, fmt.Errorf("create %s/%s: %w", b.name, key, err)
	}
	return rev, nil
}

// Update writes key only if its current revision is rev; ErrConflict
// otherwise.
func (b *Bucket[T]) Update(ctx context.Context, key string, v T, rev uint64, opts ...WriteOption) (uint64, error) {
	return b.publish(ctx, key, v, int64(rev), writeOptions(opts).ttl)
}

// publish writes through the bucket's subject directly, which is what
// jetstream.KeyValue does internally, so that an update can also carry a
// TTL (the library's Update cannot). expect < 0 means unconditional.
func (b *Bucket[T]) publish(ctx context.Context, key string, v T, expect int64, ttl time.Duration) (uint64, error) {
	data, err := encode(v)
	if err != nil {
		return 0, fmt.Errorf("write %s/%s: %w", b.name, key, err)
	}
	var opts []jetstream.PublishOpt
	if expect >= 0 {
		opts = append(opts, jetstream.WithExpectLastSequencePerSubject(uint64(expect)))
	}
	if ttl > 0 {
		opts = append(opts, jetstream.WithMsgTTL(ttl))
	}
	ack, err := b.js.PublishMsg(ctx, &nats.Msg{Subject: "$KV." + b.name + "." + key, Data: data}, opts...)
	if err != nil {
		switch {
		case isWrongLastSeq(err):
			return 0, fmt.Errorf("update %s/%s at revision %d: %w", b.name, key, expect, ErrConflict)
		case isFull(err):
			return 0, fmt.Errorf("write %s/%s: %w (%w)", b.name, key, ErrFull, err)
		}
		return 0, fmt.Errorf("write %s/%s: %w", b.name, key, err)
	}
	return ack.Sequence, nil
}

// Delete removes key, leaving a delete marker that watchers see. With
// rev > 0 it only deletes if the key is still at that revision.
func (b *Bucket[T]) Delete(ctx context.Context, key string, rev uint64) error {
	var opts []jetstream.PublishOpt
	if rev > 0 {
		opts = append(opts, jetstream.WithExpectLastSequencePerSubject(rev))
	}
	if err := b.mark(ctx, key, opDelete, opts...); err != nil {
		if isWrongLastSeq(err) {
			return fmt.Errorf("delete %s/%s at revision %d: %w", b.name, key, rev, ErrConflict)
		}
		return fmt.Errorf("delete %s/%s: %w", b.name, key, err)
	}
	return nil
}

// Purge removes key and its history; watchers see the purge.
func (b *Bucket[T]) Purge(ctx context.Context, key string) error {
	if err := b.mark(ctx, key, opPurge); err != nil {
		return fmt.Errorf("purge %s/%s: %w", b.name, key, err)
	}
	return nil
}

// The KV protocol's markers: a message with this header on the key's
// subject (a purge also rolls the subject up, dropping its history).
const (
	kvOperation = "KV-Operation"
	opDelete    = "DEL"
	opPurge     = "PURGE"
)

// mark writes a delete or purge marker as the KV client does, but through
// the bucket's JetStream handle like every other write, so that it too
// rides through a leader election.
func (b *Bucket[T]) mark(ctx context.Context, key, op string, opts ...jetstream.PublishOpt) error {
	m := nats.NewMsg("$KV." + b.name + "." + key)
	m.Header.Set(kvOperation, op)
	if op == opPurge {
		m.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	}
	_, err := b.js.PublishMsg(ctx, m, opts...)
	return err
}

// PurgePrefix purges every key that starts with prefix + "." (for example
// all sessions of one user). Each key gets its own purge marker, so watch
// caches on every replica drop them. It returns how many keys it purged.
func (b *Bucket[T]) PurgePrefix(ctx context.Context, prefix string) (int, error) {
	keys, err := b.Keys(ctx, prefix+".>")
	if err != nil {
		return 0, err
	}
	for _, k := range keys {
		if err := b.Purge(ctx, k); err != nil {
			return 0, err
		}
	}
	return len(keys), nil
}

// Keys lists the live keys matching a subject-style filter (">" for all).
func (b *Bucket[T]) Keys(ctx context.Context, filter string) ([]string, error) {
	var keys []string
	err := b.EachKey(ctx, filter, func(k string) { keys = append(keys, k) })
	return keys, err
}

// EachKey calls fn with each live key matching a subject-style filter
// (">" for all) as the listing brings it, and holds none of them: a pass
// over every session key costs their time, not their memory. A listing
// cut short is an error, never a shorter list (a caller may take a key it
// was not told of for gone).
func (b *Bucket[T]) EachKey(ctx context.Context, filter string, fn func(key string)) error {
	return b.each(ctx, []string{filter}, func(e jetstream.KeyValueEntry) error {
		fn(e.Key())
		return nil
	}, jetstream.IgnoreDeletes(), jetstream.MetaOnly())
}

// List reads the live entries whose keys match any of the subject-style
// filters (all of one user's sessions: "<user>.*"; a page of users'), in
// one consumer of the stream.
func (b *Bucket[T]) List(ctx context.Context, filters ...string) ([]Entry[T], error) {
	var out []Entry[T]
	err := b.each(ctx, filters, func(e jetstream.KeyValueEntry) error {
		v, err := b.decode(e)
		if err == nil {
			out = append(out, v)
		}
		return err
	}, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, err
	}
	return out, nil
}

// each calls fn with every live entry matching filters, in one watch of
// them that ends once their values as of its start are in.
func (b *Bucket[T]) each(ctx context.Context, filters []string, fn func(jetstream.KeyValueEntry) error, opts ...jetstream.WatchOpt) error {
	what := strings.Join(filters, ",")
	w, err := b.watch(ctx, filters, opts...)
	if err != nil {
		return fmt.Errorf("list: %w", err)
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("list %s/%s: %w", b.name, what, ctx.Err())
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				return fmt.Errorf("list %s/%s: the watch ended", b.name, what)
			case e == nil:
				return nil
			}
			if err := fn(e); err != nil {
				return err
			}
		}
	}
}

// GetMatching reads the newest entry whose key matches a subject-style
// filter with wildcards (a session by its hash under any user:
// "*.<hash>"), ErrNotFound when it is absent or deleted. The server
// looks through the keys the filter can match: for rare reads only.
func (b *Bucket[T]) GetMatching(ctx context.Context, filter string) (Entry[T], error) {
	s, err := b.js.Stream(ctx, "KV_"+b.name)
	if err != nil {
		return Entry[T]{}, fmt.Errorf("get %s/%s: %w", b.name, filter, err)
	}
	m, err := s.GetLastMsgForSubject(ctx, "$KV."+b.name+"."+filter)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return Entry[T]{}, fmt.Errorf("get %s/%s: %w", b.name, filter, ErrNotFound)
	case err != nil:
		return Entry[T]{}, fmt.Errorf("get %s/%s: %w", b.name, filter, err)
	case m.Header.Get(kvOperation) != "", m.Header.Get(jetstream.MarkerReasonHeader) != "":
		return Entry[T]{}, fmt.Errorf("get %s/%s: %w", b.name, filter, ErrNotFound)
	}
	var v T
	if err := decodeInto(m.Data, &v); err != nil {
		return Entry[T]{}, fmt.Errorf("decode %s/%s: %w", b.name, m.Subject, err)
	}
	key := strings.TrimPrefix(m.Subject, "$KV."+b.name+".")
	return Entry[T]{Key: key, Value: v, Revision: m.Sequence}, nil
}

// Mutate applies fn to the current value of key (ok=false when absent) and
// writes the result with compare-and-set, retrying on conflicts. fn returns
// write=false to leave the key alone. It returns the final entry.
func (b *Bucket[T]) Mutate(ctx context.Context, key string, fn func(cur T, ok bool) (next T, write bool, err error), opts ...WriteOption) (Entry[T], error) {
	start := time.Now()
	for attempt := 0; ; attempt++ {
		cur, err := b.Get(ctx, key)
		ok := err == nil
		if err != nil && !errors.Is(err, ErrNotFound) {
			return Entry[T]{}, err
		}
		next, write, err := fn(cur.Value, ok)
		if err != nil || !write {
			return cur, err
		}
		var rev uint64
		if ok {
			rev, err = b.Update(ctx, key, next, cur.Revision, opts...)
		} else {
			rev, err = b.Create(ctx, key, next, opts...)
		}
		if err == nil {
			return Entry[T]{Key: key, Value: next, Revision: rev}, nil
		}
		if !(errors.Is(err, ErrConflict) || errors.Is(err, ErrExists)) {
			return Entry[T]{}, err
		}
		// A conflict that outlasts the attempts is most likely not another
		// writer: reads are served by any replica, and during a leader
		// election a lagging one keeps answering an old revision. That is
		// ridden out as long as an election is (NATS_FAILOVER_WAIT), like
		// a read that finds no leader (TestNATSNodeLoss saw a signup
		// refused after 8 s of conflicts, before the wait was spent).
		if attempt >= maxMutateAttempts && time.Since(start) >= b.failover {
			return Entry[T]{}, err
		}
		// Jittered: writers that collided once (forty signups behind one
		// NAT on the rate-limit key) must not collide again in lockstep.
		if err := sleepCtx(ctx, rand.N(min(time.Duration(attempt+1)*10*time.Millisecond, 500*time.Millisecond))); err != nil {
			return Entry[T]{}, err
		}
	}
}

// maxMutateAttempts bounds Mutate's retries of a contended key (about
// five seconds of jittered waiting in all).
const maxMutateAttempts = 32

func isWrongLastSeq(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence || apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// Store failures the server answers a write with when the stream is at
// its MaxBytes or MaxMsgs (JSStreamStoreFailedF, the store's error as
// its description) or its server's store cannot take more
// (JSInsufficientResourcesErr).
const (
	errCodeStoreFailed           jetstream.ErrorCode = 10077
	errCodeInsufficientResources jetstream.ErrorCode = 10023
)

func isFull(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	return apiErr.ErrorCode == errCodeInsufficientResources ||
		apiErr.ErrorCode == errCodeStoreFailed && (strings.Contains(apiErr.Description, "maximum bytes exceeded") || strings.Contains(apiErr.Description, "maximum messages exceeded"))
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
