package kv_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// fill writes n sandboxes, box-0 … box-(n-1), Ready.
func fill(t *testing.T, ctx context.Context, b *kv.Bucket[state.Sandbox], n int) {
	t.Helper()
	for i := range n {
		u := "box-" + strconv.Itoa(i)
		if _, err := b.Put(ctx, u, state.Sandbox{User: u, Phase: state.PhaseReady}); err != nil {
			t.Fatal(err)
		}
	}
}

// A bounded cache starts empty however full the bucket, reads a key on
// its first use and holds it from then on: the watch brings its changes
// (a deletion included) while passing over keys nobody used, which it
// does not even decode.
func TestBoundedCacheHoldsWhatIsUsed(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	fill(t, ctx, boxes, 500)
	cache, err := kv.NewCache(ctx, boxes, ">", quiet, kv.Bounded[state.Sandbox](100))
	if err != nil {
		t.Fatal(err)
	}
	if !cache.IsSynced() || cache.Len() != 0 {
		t.Fatalf("a bounded cache starts synced and empty: synced %v, %d entries", cache.IsSynced(), cache.Len())
	}
	if _, ok := cache.Get("box-7"); ok {
		t.Fatal("Get read the bucket")
	}
	read, absent, _ := kv.CacheLoads()
	if e, ok := cache.Load(ctx, "box-7"); !ok || e.Value.Phase != state.PhaseReady {
		t.Fatalf("Load of box-7: %+v %v", e, ok)
	}
	if _, ok := cache.Load(ctx, "nobody"); ok {
		t.Fatal("Load found a key the bucket does not have")
	}
	if r, a, _ := kv.CacheLoads(); r != read+1 || a != absent+1 {
		t.Fatalf("loads: %d read, %d absent; want %d and %d", r, a, read+1, absent+1)
	}
	// Held now: answered without a read.
	if _, ok := cache.Get("box-7"); !ok {
		t.Fatal("box-7 not held after its Load")
	}
	cache.Load(ctx, "nobody")
	if r, a, _ := kv.CacheLoads(); r != read+1 || a != absent+1 {
		t.Fatalf("a held key was read again: %d read, %d absent", r, a)
	}

	// Changes: to held keys applied, present or absent; others passed
	// over, a record no release reads among them (not decoded, so not
	// counted), with the same record on a held key as the control.
	newer := kv.NewerRecords()
	raw, err := js.KeyValue(ctx, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Put(ctx, "box-8", []byte(`{"v":99}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := boxes.Put(ctx, "box-7", state.Sandbox{User: "box-7", Phase: state.PhaseSuspended}); err != nil {
		t.Fatal(err)
	}
	if _, err := boxes.Put(ctx, "nobody", state.Sandbox{User: "nobody", Phase: state.PhaseWaking}); err != nil {
		t.Fatal(err)
	}
	wait := func(key string, done func(kv.Entry[state.Sandbox], bool) bool) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if e, ok, err := cache.Wait(wctx, key, done); err != nil {
			t.Fatalf("%s: %+v %v: %v", key, e, ok, err)
		}
	}
	wait("box-7", func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase == state.PhaseSuspended })
	wait("nobody", func(e kv.Entry[state.Sandbox], ok bool) bool { return ok && e.Value.Phase == state.PhaseWaking })
	if err := cache.CatchUp(ctx); err != nil {
		t.Fatal(err)
	}
	if _, ok := cache.Get("box-8"); ok || kv.NewerRecords() != newer || cache.Len() != 2 {
		t.Fatalf("an unused key's change was taken in: box-8 held %v, newer records %d→%d, %d held", ok, newer, kv.NewerRecords(), cache.Len())
	}
	if _, err := raw.Put(ctx, "box-7", []byte(`{"v":99}`)); err != nil {
		t.Fatal(err)
	}
	wait("box-7", func(_ kv.Entry[state.Sandbox], ok bool) bool { return !ok })
	if kv.NewerRecords() != newer+1 {
		t.Fatalf("the held key's newer record was not decoded: %d→%d", newer, kv.NewerRecords())
	}

	// A deletion of a held key anywhere is seen, and holds it absent.
	if err := boxes.Purge(ctx, "nobody"); err != nil {
		t.Fatal(err)
	}
	wait("nobody", func(_ kv.Entry[state.Sandbox], ok bool) bool { return !ok })
	r, a, _ := kv.CacheLoads()
	if _, ok := cache.Load(ctx, "nobody"); ok {
		t.Fatal("a deleted key came back")
	}
	if r2, a2, _ := kv.CacheLoads(); r2 != r || a2 != a {
		t.Fatal("a key held absent was read again")
	}
}

// Held keys stay within the limit, guessed (absent) keys forgotten before
// present ones; a key somebody waits on is never forgotten.
func TestBoundedCacheLimit(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	fill(t, ctx, boxes, 30)
	const limit = 20
	cache, err := kv.NewCache(ctx, boxes, ">", quiet, kv.Bounded[state.Sandbox](limit))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if _, ok := cache.Load(ctx, "box-"+strconv.Itoa(i)); !ok {
			t.Fatalf("box-%d not found", i)
		}
	}
	// A waiter on a key nobody wrote yet.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	waited := make(chan error, 1)
	go func() {
		_, _, err := cache.Wait(wctx, "late", func(_ kv.Entry[state.Sandbox], ok bool) bool { return ok })
		waited <- err
	}()
	for i := range 200 {
		cache.Load(ctx, "guess-"+strconv.Itoa(i))
	}
	if n := cache.Len(); n != 10 {
		t.Fatalf("%d present keys held after 200 guesses, want the 10 used", n)
	}
	for i := 10; i < 30; i++ {
		cache.Load(ctx, "box-"+strconv.Itoa(i))
	}
	if n := cache.Len(); n > limit {
		t.Fatalf("%d keys held, limit %d", n, limit)
	}
	if _, err := boxes.Put(ctx, "late", state.Sandbox{User: "late", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Fatalf("the waiter on late: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the key waited on was forgotten: its write never reached the waiter")
	}
	if ev := kv.CacheEvictions(); ev == 0 {
		t.Fatal("no evictions counted")
	}
}

// A note is held while the watch is behind it, and reads of one key at
// once are joined into one.
func TestBoundedCacheNoteAndJoinedLoads(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	fill(t, ctx, boxes, 1)
	cache, err := kv.NewCache(ctx, boxes, ">", quiet, kv.Bounded[state.Sandbox](100))
	if err != nil {
		t.Fatal(err)
	}
	rev, err := boxes.Put(ctx, "ann", state.Sandbox{User: "ann", Phase: state.PhaseWaking})
	if err != nil {
		t.Fatal(err)
	}
	cache.Note("ann", state.Sandbox{User: "ann", Phase: state.PhaseWaking}, rev)
	if _, err := boxes.Put(ctx, "ann", state.Sandbox{User: "ann", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	if err := cache.CatchUp(ctx); err != nil {
		t.Fatal(err)
	}
	// Either the note was kept and the watch brought the next write, or
	// the watch had passed it and nothing is held: never the old value.
	if e, ok := cache.Get("ann"); ok && e.Value.Phase != state.PhaseReady {
		t.Fatalf("ann held at %s after the watch passed its next write", e.Value.Phase)
	}
	// Past the watch: not held.
	cache.Note("box-0", state.Sandbox{User: "box-0", Phase: state.PhaseFailed}, 1)
	if _, ok := cache.Get("box-0"); ok {
		t.Fatal("a note the watch had passed was held")
	}

	read, _, _ := kv.CacheLoads()
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, ok := cache.Load(ctx, "box-0"); !ok {
				t.Error("box-0 not found")
			}
		}()
	}
	wg.Wait()
	if r, _, _ := kv.CacheLoads(); r-read > 2 {
		t.Fatalf("20 loads at once read the bucket %d times", r-read)
	}
}

// A bucket recreated under a bounded cache (NATS lost its data) makes it
// forget what it held, telling the subscribers; the new bucket's keys
// are read when used and followed from then on.
func TestBoundedCacheForgetsARecreatedBucket(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	fill(t, ctx, boxes, 3)
	var mu sync.Mutex
	var dropped []string
	cache, err := kv.NewCache(context.Background(), boxes, ">", quiet, kv.Bounded[state.Sandbox](100), kv.OnChange(func(key string, _ kv.Entry[state.Sandbox], deleted bool) {
		if deleted {
			mu.Lock()
			defer mu.Unlock()
			dropped = append(dropped, key)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	cache.Load(ctx, "box-0")
	cache.Load(ctx, "box-1")
	if err := js.DeleteKeyValue(ctx, state.BucketSandboxes); err != nil {
		t.Fatal(err)
	}
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	fresh := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	if _, err := fresh.Put(ctx, "box-1", state.Sandbox{User: "box-1", Phase: state.PhaseSuspended}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if n := cache.Reloads(); n != 1 {
			return fmt.Errorf("%d reloads", n)
		}
		return nil
	})
	mu.Lock()
	if len(dropped) != 2 {
		t.Errorf("subscribers heard of %v dropped, want box-0 and box-1", dropped)
	}
	mu.Unlock()
	if e, ok := cache.Load(ctx, "box-1"); !ok || e.Value.Phase != state.PhaseSuspended {
		t.Fatalf("box-1 from the new bucket: %+v %v", e, ok)
	}
	if _, ok := cache.Load(ctx, "box-0"); ok {
		t.Fatal("box-0 survived the loss of its bucket")
	}
	if _, err := fresh.Put(ctx, "box-1", state.Sandbox{User: "box-1", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, _, err := cache.Wait(wctx, "box-1", func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase == state.PhaseReady }); err != nil {
		t.Fatalf("the new bucket's writes are not followed: %v", err)
	}
}

// A read that fails holds nothing and says absent: the caller refuses.
func TestBoundedCacheFailedRead(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	raw, err := js.KeyValue(ctx, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Put(ctx, "future", []byte(`{"v":99}`)); err != nil {
		t.Fatal(err)
	}
	cache, err := kv.NewCache(ctx, boxes, ">", quiet, kv.Bounded[state.Sandbox](100))
	if err != nil {
		t.Fatal(err)
	}
	_, _, failed := kv.CacheLoads()
	if _, ok := cache.Load(ctx, "future"); ok {
		t.Fatal("a record of a newer schema was read")
	}
	if _, _, f := kv.CacheLoads(); f != failed+1 {
		t.Fatalf("failed reads %d→%d", failed, f)
	}
	// Not held: once the record is one this release reads, it is found.
	if _, err := boxes.Put(ctx, "future", state.Sandbox{User: "future", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	if _, ok := cache.Load(ctx, "future"); !ok {
		t.Fatal("a key whose read failed stayed held absent")
	}
}

// GetMatching finds a key by a wildcard, and not a deleted one.
func TestGetMatching(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	sessions := testutil.Open[state.Session](t, js, state.BucketSessions)
	if _, err := sessions.Put(ctx, "ann.abc", state.Session{User: "ann"}); err != nil {
		t.Fatal(err)
	}
	if _, err := sessions.Put(ctx, "bob.def", state.Session{User: "bob"}); err != nil {
		t.Fatal(err)
	}
	e, err := sessions.GetMatching(ctx, "*.def")
	if err != nil || e.Key != "bob.def" || e.Value.User != "bob" {
		t.Fatalf("*.def: %+v %v", e, err)
	}
	if err := sessions.Purge(ctx, "bob.def"); err != nil {
		t.Fatal(err)
	}
	if e, err := sessions.GetMatching(ctx, "*.def"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("a purged key: %+v %v", e, err)
	}
	if e, err := sessions.GetMatching(ctx, "*.nothing"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("no key: %+v %v", e, err)
	}
}

// Names loads every key of a bucket only when asked, keeps them sorted
// through writes and deletions, and counts them.
func TestNames(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	fill(t, ctx, boxes, 300)
	names := kv.NewNames(ctx, quiet, boxes.KeySource())
	if err := names.Load(ctx); err != nil {
		t.Fatal(err)
	}
	if n := names.Len(); n != 300 {
		t.Fatalf("%d names loaded, want 300", n)
	}
	if err := boxes.Purge(ctx, "box-7"); err != nil {
		t.Fatal(err)
	}
	if err := boxes.Delete(ctx, "box-8", 0); err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{"aa", "zz", "box-7"} {
		if _, err := boxes.Put(ctx, u, state.Sandbox{User: u}); err != nil {
			t.Fatal(err)
		}
	}
	if err := boxes.Purge(ctx, "zz"); err != nil {
		t.Fatal(err)
	}
	want := []string{"aa"}
	for i := range 300 {
		if i != 8 {
			want = append(want, "box-"+strconv.Itoa(i))
		}
	}
	slices.Sort(want)
	testutil.Eventually(t, 10*time.Second, func() error {
		if got := names.Range("", 0); !slices.Equal(got, want) || names.Len() != len(want) {
			return fmt.Errorf("%d names, %d counted", len(got), names.Len())
		}
		return nil
	})
	if got := names.Range("", 0); !slices.Equal(got, want) {
		t.Fatalf("sorted names: %d of them, first %v; want %d, first %v", len(got), got[:3], len(want), want[:3])
	}
	if got := names.Range("box-2", 3); !slices.Equal(got, []string{"box-2", "box-20", "box-200"}) {
		t.Fatalf("three names from box-2: %v", got)
	}
}

// Names over two buckets holds a key while either has it, once, and
// counts each bucket's keys apart: an account and its sandbox are one
// user, a sandbox without an account is a user too, and MAX_USERS counts
// accounts alone.
func TestNamesOfTwoBuckets(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	users := testutil.Open[state.User](t, js, state.BucketUsers)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	for _, u := range []string{"ann", "bob"} {
		if _, err := users.Put(ctx, u, state.User{Name: u}); err != nil {
			t.Fatal(err)
		}
	}
	for _, u := range []string{"bob", "cy"} {
		if _, err := boxes.Put(ctx, u, state.Sandbox{User: u}); err != nil {
			t.Fatal(err)
		}
	}
	names := kv.NewNames(ctx, quiet, users.KeySource(), boxes.KeySource())
	if err := names.Load(ctx); err != nil {
		t.Fatal(err)
	}
	check := func(want []string, accounts int) error {
		if got := names.Range("", 0); !slices.Equal(got, want) || names.Len() != len(want) || names.LenOf(0) != accounts {
			return fmt.Errorf("names %v (%d), %d accounts; want %v, %d accounts", got, names.Len(), names.LenOf(0), want, accounts)
		}
		return nil
	}
	if err := check([]string{"ann", "bob", "cy"}, 2); err != nil {
		t.Fatal(err)
	}
	// bob's account goes, his sandbox stays: still a user, one account
	// fewer; cy's sandbox goes: cy is gone.
	if err := users.Delete(ctx, "bob", 0); err != nil {
		t.Fatal(err)
	}
	if err := boxes.Purge(ctx, "cy"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error { return check([]string{"ann", "bob"}, 1) })
}

// A key the caller passes as a view of bytes it then reuses (a name read
// from a request the server recycles) is held under its own copy: after
// the bytes change, the key the cache was asked about is still held as
// read, and the key the bytes now spell is read for itself, not taken for
// the first (the race detector found an edge's name from an SSO header
// outliving its request).
func TestBoundedCacheKeepsItsOwnKeys(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	if _, err := boxes.Put(ctx, "bob", state.Sandbox{User: "bob", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	cache, err := kv.NewCache(ctx, boxes, ">", quiet, kv.Bounded[state.Sandbox](100))
	if err != nil {
		t.Fatal(err)
	}
	buf := []byte("ann")
	view := unsafe.String(&buf[0], len(buf))
	if _, ok := cache.Load(ctx, view); ok {
		t.Fatal("ann, who has no sandbox, read as present")
	}
	copy(buf, "bob") // the request's bytes, reused
	if e, ok := cache.Load(ctx, "bob"); !ok || e.Value.User != "bob" {
		t.Fatalf("bob read as %+v, %v after ann's name's bytes changed", e.Value, ok)
	}
	loads := func() uint64 { read, absent, failed := kv.CacheLoads(); return read + absent + failed }
	reads := loads()
	if _, ok := cache.Load(ctx, "ann"); ok {
		t.Fatal("ann read as present")
	}
	if again := loads(); again != reads {
		t.Fatalf("ann was read again (%d reads, then %d): the cache lost the key it held", reads, again)
	}
}
