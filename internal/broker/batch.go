package broker

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/kv"
)

// batcher combines the changes to one key of a bucket that arrive while a
// write of that key is under way into the next write: one
// compare-and-set for all of them. A user's calls all change the same
// two keys (their slots, their month's total); written one by one, N
// calls in flight on one broker race N compare-and-sets against each
// other, and the losers back off and retry (200 streams of one user took
// seconds to be admitted). Batched, a broker's own writes never conflict;
// only another broker's can, which Mutate rides out as before. The value
// a write left is kept, so the next write of the key is one
// compare-and-set on that revision, without reading it first; another
// broker's write in between makes it a conflict, and the batch is then
// applied to a fresh read.
type batcher[T any] struct {
	bucket *kv.Bucket[T]
	// ctx and attempt bound each write: it serves many callers, so no
	// one caller's context ends it.
	ctx     context.Context
	attempt time.Duration
	opts    []kv.WriteOption

	mu sync.Mutex
	// queues holds each key's changes waiting for the next write; a key
	// is present while its writer runs.
	queues map[string][]*change[T]
	// last is the value (encoded) and revision each key's last write
	// left, at most maxLast of them.
	last map[string]written
}

type written struct {
	data []byte
	rev  uint64
}

// maxLast bounds batcher.last: past it the kept values are forgotten,
// which costs the next write of each key one read.
const maxLast = 10_000

// change is one caller's change: apply edits cur in place and reports
// whether it changed anything. It must only assign what it records (a
// write that meets another broker's is applied again, to the newer value).
type change[T any] struct {
	apply func(cur *T) bool
	done  chan error
}

func newBatcher[T any](ctx context.Context, b *kv.Bucket[T], attempt time.Duration, opts ...kv.WriteOption) *batcher[T] {
	return &batcher[T]{bucket: b, ctx: context.WithoutCancel(ctx), attempt: attempt, opts: opts, queues: map[string][]*change[T]{}, last: map[string]written{}}
}

// do applies apply to key's value in the next write and returns that
// write's error. When ctx ends first it returns ctx's error at once, and
// the change is applied all the same: undo, if not nil, then runs once it
// has been, to take it back.
func (b *batcher[T]) do(ctx context.Context, key string, apply func(cur *T) bool, undo func()) error {
	c := &change[T]{apply: apply, done: make(chan error, 1)}
	b.mu.Lock()
	q, running := b.queues[key]
	b.queues[key] = append(q, c)
	b.mu.Unlock()
	if !running {
		go b.run(key)
	}
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		go func() {
			if err := <-c.done; err == nil && undo != nil {
				undo()
			}
		}()
		return ctx.Err()
	}
}

// run writes key's queued changes, a batch at a time, until none is left.
func (b *batcher[T]) run(key string) {
	for {
		b.mu.Lock()
		batch := b.queues[key]
		if len(batch) == 0 {
			delete(b.queues, key)
			b.mu.Unlock()
			return
		}
		b.queues[key] = []*change[T]{}
		last, kept := b.last[key]
		delete(b.last, key)
		b.mu.Unlock()
		ctx, cancel := context.WithTimeout(b.ctx, b.attempt)
		err := b.write(ctx, key, batch, last, kept)
		cancel()
		for _, c := range batch {
			c.done <- err
		}
	}
}

// write applies batch to key: to the value last left, when kept, with
// one compare-and-set on its revision; else, when another writer got
// there first, or when the batch changes nothing, to a fresh read
// (Mutate).
func (b *batcher[T]) write(ctx context.Context, key string, batch []*change[T], last written, kept bool) error {
	apply := func(cur *T) bool {
		changed := false
		for _, c := range batch {
			changed = c.apply(cur) || changed
		}
		return changed
	}
	if kept {
		var cur T
		// A batch that changes nothing decides on the value as it is (a
		// slot refused as the last one is taken): that needs a fresh read,
		// as the kept value may be another broker's write behind.
		if json.Unmarshal(last.data, &cur) == nil && apply(&cur) {
			rev, err := b.bucket.Update(ctx, key, cur, last.rev, b.opts...)
			switch {
			case err == nil:
				b.keepValue(key, cur, rev)
				return nil
			case !errors.Is(err, kv.ErrConflict):
				return err
			}
		}
	}
	e, err := b.bucket.Mutate(ctx, key, func(cur T, _ bool) (T, bool, error) { return cur, apply(&cur), nil }, b.opts...)
	if err == nil && e.Revision > 0 {
		b.keepValue(key, e.Value, e.Revision)
	}
	return err
}

func (b *batcher[T]) keepValue(key string, v T, rev uint64) {
	if data, err := json.Marshal(v); err == nil {
		b.keep(key, written{data: data, rev: rev})
	}
}

func (b *batcher[T]) keep(key string, w written) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.last) >= maxLast {
		clear(b.last)
	}
	b.last[key] = w
}
