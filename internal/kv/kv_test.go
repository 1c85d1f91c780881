package kv_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var quiet = slog.New(slog.DiscardHandler)

func setup(t testing.TB) (string, jetstream.JetStream) {
	t.Helper()
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	if err := state.EnsureBuckets(natstest.Context(t, 10*time.Second), js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	return s.URL(), js
}

func TestCreateUpdateDelete(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	users := testutil.Open[state.User](t, js, state.BucketUsers)

	rev, err := users.Create(ctx, "bob", state.User{Name: "bob", Managed: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := users.Create(ctx, "bob", state.User{Name: "bob"}); !errors.Is(err, kv.ErrExists) {
		t.Fatalf("second create: %v, want ErrExists", err)
	}
	rev2, err := users.Update(ctx, "bob", state.User{Name: "bob", Claim: "dsh-bob"}, rev)
	if err != nil {
		t.Fatal(err)
	}
	// A writer that read the old revision loses.
	if _, err := users.Update(ctx, "bob", state.User{Name: "bob", Claim: "stale"}, rev); !errors.Is(err, kv.ErrConflict) {
		t.Fatalf("stale update: %v, want ErrConflict", err)
	}
	e, err := users.Get(ctx, "bob")
	if err != nil || e.Value.Claim != "dsh-bob" || e.Revision != rev2 {
		t.Fatalf("get = %+v, %v", e, err)
	}
	if err := users.Delete(ctx, "bob", rev); !errors.Is(err, kv.ErrConflict) {
		t.Fatalf("delete at stale revision: %v, want ErrConflict", err)
	}
	if err := users.Delete(ctx, "bob", rev2); err != nil {
		t.Fatal(err)
	}
	if _, err := users.Get(ctx, "bob"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("get after delete: %v", err)
	}
	// A deleted key can be created again.
	if _, err := users.Create(ctx, "bob", state.User{Name: "bob"}); err != nil {
		t.Fatalf("create after delete: %v", err)
	}
}

// counting is a JetStream handle that counts the publishes made through
// it (natsconn's failover handle is one such wrapper).
type counting struct {
	jetstream.JetStream
	n atomic.Int32
}

func (c *counting) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	c.n.Add(1)
	return c.JetStream.PublishMsg(ctx, m, opts...)
}

// Deletes and purges are writes like the others: they go through the
// handle the bucket was opened with (so a failover handle covers them),
// and keep the KV protocol's meaning: each leaves its own marker, which
// the KV client reads as gone.
func TestDeleteAndPurgeGoThroughTheBucketsHandle(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	h := &counting{JetStream: js}
	users, err := kv.Open[state.User](ctx, h, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"del", "pur"} {
		for range 2 {
			if _, err := users.Put(ctx, k, state.User{Name: k}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := users.Delete(ctx, "del", 0); err != nil {
		t.Fatal(err)
	}
	if err := users.Purge(ctx, "pur"); err != nil {
		t.Fatal(err)
	}
	if n := h.n.Load(); n != 6 {
		t.Fatalf("%d publishes through the bucket's handle, want 6 (4 puts, a delete, a purge)", n)
	}
	for _, k := range []string{"del", "pur"} {
		if _, err := users.Get(ctx, k); !errors.Is(err, kv.ErrNotFound) {
			t.Fatalf("get %s: %v, want ErrNotFound", k, err)
		}
	}
	if keys, err := users.Keys(ctx, ">"); err != nil || len(keys) != 0 {
		t.Fatalf("keys left: %v %v", keys, err)
	}
	raw, err := js.KeyValue(ctx, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string][]jetstream.KeyValueOp{
		"del": {jetstream.KeyValueDelete}, // the bucket keeps one revision
		"pur": {jetstream.KeyValuePurge},
	} {
		hist, err := raw.History(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		var got []jetstream.KeyValueOp
		for _, e := range hist {
			got = append(got, e.Operation())
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("history of %s: %v, want %v", k, got, want)
		}
	}
}

// TestMutateRetriesConflicts: concurrent read-modify-writes of one key
// lose no update, including forty at once (signups behind one NAT on the
// rate-limit key).
func TestMutateRetriesConflicts(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	logs := testutil.Open[state.Attempts](t, js, state.BucketRateLimit)
	for _, tc := range []struct{ writers, each int }{{4, 10}, {40, 1}} {
		key := fmt.Sprintf("client-%d", tc.writers)
		errs := make(chan error, tc.writers)
		for w := 0; w < tc.writers; w++ {
			go func() {
				for i := 0; i < tc.each; i++ {
					_, err := logs.Mutate(ctx, key, func(a state.Attempts, _ bool) (state.Attempts, bool, error) {
						a.At = append(a.At, int64(w*tc.each+i))
						return a, true, nil
					})
					if err != nil {
						errs <- err
						return
					}
				}
				errs <- nil
			}()
		}
		for w := 0; w < tc.writers; w++ {
			if err := <-errs; err != nil {
				t.Fatalf("%d writers: %v", tc.writers, err)
			}
		}
		e, err := logs.Get(ctx, key)
		if err != nil || len(e.Value.At) != tc.writers*tc.each {
			t.Fatalf("log holds %d entries (%v), want %d (no lost update)", len(e.Value.At), err, tc.writers*tc.each)
		}
	}
}

func TestKeyTTLExpiresAndCachesSeeIt(t *testing.T) {
	t.Parallel() // waits out TTLs
	_, js := setup(t)
	ctx := natstest.Context(t, 20*time.Second)
	sessions := testutil.Open[state.Session](t, js, state.BucketSessions)
	key := state.SessionKey("bob", "abc")
	// Whether the cache held the session, however briefly: a poll could
	// miss the second it lives on a loaded machine.
	var seen atomic.Bool
	cache, err := kv.NewCache(ctx, sessions, ">", quiet, kv.OnChange(func(k string, _ kv.Entry[state.Session], deleted bool) {
		if k == key && !deleted {
			seen.Store(true)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	if _, err := sessions.Create(ctx, key, state.Session{User: "bob"}, kv.WithTTL(time.Second)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if !seen.Load() {
			return errors.New("cache has not seen the session")
		}
		return nil
	})
	testutil.Eventually(t, 10*time.Second, func() error {
		if _, err := sessions.Get(ctx, key); !errors.Is(err, kv.ErrNotFound) {
			return fmt.Errorf("still there: %v", err)
		}
		if _, ok := cache.Get(key); ok {
			return errors.New("cache still holds the expired session")
		}
		return nil
	})
}

func TestUpdateWithTTLExtendsTheKey(t *testing.T) {
	t.Parallel() // waits out TTLs
	_, js := setup(t)
	ctx := natstest.Context(t, 20*time.Second)
	locks := testutil.Open[kv.Holder](t, js, state.BucketLocks)
	// Renewed at a tenth of the TTL, so a loaded machine may stall a
	// renewal for most of a TTL without the key expiring.
	const ttl = 2 * time.Second
	rev, err := locks.Create(ctx, "k", kv.Holder{ID: "a"}, kv.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for time.Since(start) < 5*ttl/2 {
		time.Sleep(ttl / 10)
		if rev, err = locks.Update(ctx, "k", kv.Holder{ID: "a"}, rev, kv.WithTTL(ttl)); err != nil {
			t.Fatalf("renew after %s: %v", time.Since(start), err)
		}
	}
	testutil.Eventually(t, 5*ttl, func() error {
		if _, err := locks.Get(ctx, "k"); !errors.Is(err, kv.ErrNotFound) {
			return fmt.Errorf("not expired: %v", err)
		}
		return nil
	})
}

func TestCacheSeesDeleteFromAnotherConnection(t *testing.T) {
	url, js := setup(t)
	ctx := natstest.Context(t, 20*time.Second)
	sessions := testutil.Open[state.Session](t, js, state.BucketSessions)
	for i := 0; i < 3; i++ {
		if _, err := sessions.Put(ctx, state.SessionKey("alice", strconv.Itoa(i)), state.Session{User: "alice"}); err != nil {
			t.Fatal(err)
		}
	}
	cache, err := kv.NewCache(ctx, sessions, ">", quiet, kv.IndexBy[state.Session](func(k string) string { return k[len("alice."):] }))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-cache.Synced():
	case <-ctx.Done():
		t.Fatal("cache never synced")
	}
	if cache.Len() != 3 {
		t.Fatalf("synced cache holds %d entries, want 3", cache.Len())
	}
	if e, ok := cache.Get("1"); !ok || e.Value.User != "alice" {
		t.Fatalf("indexed lookup = %+v %v", e, ok)
	}

	_, other := natstest.Connect(t, url)
	otherSessions := testutil.Open[state.Session](t, other, state.BucketSessions)
	n, err := otherSessions.PurgePrefix(ctx, "alice")
	if err != nil || n != 3 {
		t.Fatalf("purge prefix: %d %v", n, err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if cache.Len() != 0 {
			return fmt.Errorf("%d entries left", cache.Len())
		}
		return nil
	})
}

func TestCacheWait(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	cache, err := kv.NewCache(ctx, boxes, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	go func() {
		for _, p := range []state.Phase{state.PhaseSuspended, state.PhaseWaking, state.PhaseReady} {
			_, _ = boxes.Put(ctx, "bob", state.Sandbox{User: "bob", Phase: p})
		}
	}()
	e, ok, err := cache.Wait(ctx, "bob", func(e kv.Entry[state.Sandbox], ok bool) bool { return ok && e.Value.Phase == state.PhaseReady })
	if err != nil || !ok || e.Value.Phase != state.PhaseReady {
		t.Fatalf("wait = %+v %v %v", e, ok, err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, _, err := cache.Wait(short, "nobody", func(_ kv.Entry[state.Sandbox], ok bool) bool { return ok }); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait for a key that never comes: %v", err)
	}
}

// CatchUp returns only once the cache holds what the bucket held when it
// was asked: every write made on another connection just before is found
// right after it, while the watch alone, asked at once, is seen to be
// behind some of the time (the positive control; reported, not required,
// as how often depends on scheduling). A cache whose watch has stopped
// cannot catch up, and says so when its context ends.
func TestCacheCatchUp(t *testing.T) {
	url, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	_, other := natstest.Connect(t, url)
	writer := testutil.Open[state.Sandbox](t, other, state.BucketSandboxes)
	cache, err := kv.NewCache(ctx, boxes, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	behind := 0
	for i := range 200 {
		key := fmt.Sprintf("u%d", i)
		if _, err := writer.Put(ctx, key, state.Sandbox{User: key}); err != nil {
			t.Fatal(err)
		}
		if _, ok := cache.Get(key); !ok {
			behind++
		}
		if err := cache.CatchUp(ctx); err != nil {
			t.Fatal(err)
		}
		if _, ok := cache.Get(key); !ok {
			t.Fatalf("write %d not in the cache after CatchUp", i)
		}
	}
	t.Logf("the watch alone was behind the write %d times in 200", behind)

	stopped, stop := context.WithCancel(context.Background())
	frozen, err := kv.NewCache(stopped, boxes, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-frozen.Synced()
	stop()
	if _, err := writer.Put(ctx, "late", state.Sandbox{User: "late"}); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := frozen.CatchUp(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a stopped cache caught up: %v", err)
	}
}

// NATS loses a bucket and setup makes it again (or a restore replaces
// it): revisions start over, and the cache notices without a restart —
// it reloads the new bucket, drops what the new one does not hold (its
// subscribers hear of each), and follows the new bucket's writes.
func TestCacheReloadsARecreatedBucket(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	var mu sync.Mutex
	var dropped []string
	cache, err := kv.NewCache(context.Background(), boxes, ">", quiet, kv.OnChange(func(key string, _ kv.Entry[state.Sandbox], deleted bool) {
		if deleted {
			mu.Lock()
			defer mu.Unlock()
			dropped = append(dropped, key)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	for _, u := range []string{"ann", "bob", "cy"} {
		if _, err := boxes.Put(ctx, u, state.Sandbox{User: u, Phase: state.PhaseReady}); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if cache.Len() != 3 {
			return fmt.Errorf("%d entries before the loss", cache.Len())
		}
		return nil
	})
	if err := js.DeleteKeyValue(ctx, state.BucketSandboxes); err != nil {
		t.Fatal(err)
	}
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	fresh := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	if _, err := fresh.Put(ctx, "bob", state.Sandbox{User: "bob", Phase: state.PhaseSuspended}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if n := cache.Reloads(); n != 1 {
			return fmt.Errorf("%d reloads", n)
		}
		if e, ok := cache.Get("bob"); !ok || e.Value.Phase != state.PhaseSuspended {
			return fmt.Errorf("bob: %+v %v", e, ok)
		}
		if _, ok := cache.Get("ann"); ok {
			return errors.New("ann is still there")
		}
		return nil
	})
	mu.Lock()
	sort.Strings(dropped)
	if fmt.Sprint(dropped) != "[ann cy]" {
		t.Errorf("subscribers heard of the deletion of %v, want [ann cy]", dropped)
	}
	mu.Unlock()
	// The new bucket's writes keep coming.
	if _, err := fresh.Put(ctx, "dee", state.Sandbox{User: "dee", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	if err := cache.CatchUp(ctx); err != nil {
		t.Fatal(err)
	}
	if _, ok := cache.Get("dee"); !ok || cache.Len() != 2 {
		t.Fatalf("after the reload: dee %v, %d entries, want bob and dee", ok, cache.Len())
	}
}

// A writer notes its own write in its cache: found at once, never
// replaced by an older revision, and the watch's later copy of it (or a
// newer write) is what the cache then holds.
func TestCacheNote(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	cache, err := kv.NewCache(ctx, boxes, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	cache.Note("ann", state.Sandbox{User: "ann", Phase: state.PhaseReady}, 1000)
	if e, ok := cache.Get("ann"); !ok || e.Revision != 1000 || e.Value.Phase != state.PhaseReady {
		t.Fatalf("noted entry: %+v %v", e, ok)
	}
	cache.Note("ann", state.Sandbox{User: "ann", Phase: state.PhaseFailed}, 999)
	if e, _ := cache.Get("ann"); e.Value.Phase != state.PhaseReady {
		t.Fatalf("an older note replaced a newer entry: %+v", e)
	}
	rev, err := boxes.Put(ctx, "bob", state.Sandbox{User: "bob", Phase: state.PhaseWaking})
	if err != nil {
		t.Fatal(err)
	}
	cache.Note("bob", state.Sandbox{User: "bob", Phase: state.PhaseWaking}, rev)
	if _, err := boxes.Put(ctx, "bob", state.Sandbox{User: "bob", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cache.Wait(ctx, "bob", func(e kv.Entry[state.Sandbox], ok bool) bool { return ok && e.Value.Phase == state.PhaseReady }); err != nil {
		t.Fatalf("the watch's newer write did not replace the note: %v", err)
	}

	// A value read before a deletion the watch has since applied (a
	// revoked session fetched a moment too early) is not brought back.
	rev, err = boxes.Put(ctx, "cid", state.Sandbox{User: "cid", Phase: state.PhaseReady})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := cache.Wait(ctx, "cid", func(_ kv.Entry[state.Sandbox], ok bool) bool { return ok }); err != nil {
		t.Fatal(err)
	}
	if err := boxes.Purge(ctx, "cid"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cache.Wait(ctx, "cid", func(_ kv.Entry[state.Sandbox], ok bool) bool { return !ok }); err != nil {
		t.Fatal(err)
	}
	cache.Note("cid", state.Sandbox{User: "cid", Phase: state.PhaseReady}, rev)
	if e, ok := cache.Get("cid"); ok {
		t.Fatalf("a note older than the watch undid a deletion: %+v", e)
	}
}

func TestLease(t *testing.T) {
	t.Parallel() // waits out TTLs
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	locks := testutil.Open[kv.Holder](t, js, state.BucketLocks)
	const ttl = 2 * time.Second
	a := kv.NewLease(locks, "sweeper", "a", ttl, quiet)
	b := kv.NewLease(locks, "sweeper", "b", ttl, quiet)

	if ok, err := a.TryAcquire(ctx); !ok || err != nil {
		t.Fatalf("a acquire: %v %v", ok, err)
	}
	if ok, err := b.TryAcquire(ctx); ok || err != nil {
		t.Fatalf("b took a held lease: %v %v", ok, err)
	}
	// Renewing keeps it past several TTLs (at an eighth of the TTL, so a
	// loaded machine may stall one for most of a TTL).
	for i := 0; i < 16; i++ {
		time.Sleep(ttl / 8)
		if err := a.Renew(ctx); err != nil {
			t.Fatalf("renew %d: %v", i, err)
		}
		if ok, _ := b.TryAcquire(ctx); ok {
			t.Fatal("b took a lease that was being renewed")
		}
	}
	// Release: b gets it at once.
	if err := a.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, err := b.TryAcquire(ctx); !ok || err != nil {
		t.Fatalf("b after release: %v %v", ok, err)
	}
	if err := a.Renew(ctx); !errors.Is(err, kv.ErrLeaseLost) {
		t.Fatalf("a renewed a released lease: %v", err)
	}
	// Handover: b passes it to a.
	if err := b.Handover(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := b.Renew(ctx); !errors.Is(err, kv.ErrLeaseLost) {
		t.Fatalf("b still holds after handover: %v", err)
	}
	if ok, err := a.TryAcquire(ctx); !ok || err != nil {
		t.Fatalf("a did not adopt the handed-over lease: %v %v", ok, err)
	}
	// Expiry: a stops renewing; b gets it once the TTL passes.
	testutil.Eventually(t, 5*ttl, func() error {
		if ok, err := b.TryAcquire(ctx); !ok {
			return fmt.Errorf("not yet (%v)", err)
		}
		return nil
	})
	if h, _ := a.Holder(ctx); h != "b" {
		t.Fatalf("holder = %q", h)
	}
}

func TestLeaseRunFailsOver(t *testing.T) {
	t.Parallel() // waits out TTLs
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	locks := testutil.Open[kv.Holder](t, js, state.BucketLocks)
	const ttl = 3 * time.Second
	// a's renewals, as the bucket records them.
	var renewals atomic.Int32
	if _, err := kv.NewCache(ctx, locks, "role", quiet, kv.OnChange(func(_ string, e kv.Entry[kv.Holder], deleted bool) {
		if !deleted && e.Value.ID == "a" {
			renewals.Add(1)
		}
	})); err != nil {
		t.Fatal(err)
	}
	leading := make(chan string, 4)
	run := func(ctx context.Context, id string) {
		kv.NewLease(locks, "role", id, ttl, quiet).Run(ctx, func(ctx context.Context) {
			leading <- id
			<-ctx.Done()
		})
	}
	actx, stopA := context.WithCancel(ctx)
	go run(actx, "a")
	if got := <-leading; got != "a" {
		t.Fatalf("first leader %s", got)
	}
	go run(ctx, "b")
	// b campaigns every quarter of the TTL, a renews every third: for three
	// of a's renewals (a TTL, however long the machine takes for it) b
	// tries several times and must never lead.
	from := renewals.Load()
	for renewals.Load() < from+3 {
		select {
		case id := <-leading:
			t.Fatalf("%s led while a held the lease (renewed %d times since b started)", id, renewals.Load()-from)
		case <-ctx.Done():
			t.Fatalf("a renewed %d times in a minute", renewals.Load()-from)
		case <-time.After(50 * time.Millisecond):
		}
	}
	stopA()
	select {
	case id := <-leading:
		if id != "b" {
			t.Fatalf("leader after a stopped: %s", id)
		}
	case <-time.After(5 * ttl):
		t.Fatal("b never took over")
	}
}

func TestClusterKeepsAcknowledgedWritesThroughANodeOutage(t *testing.T) {
	c := natstest.StartCluster(t, 3, embednats.Options{})
	_, js := natstest.Connect(t, c.URLs())
	ctx := natstest.Context(t, 90*time.Second)
	cfg := state.DefaultBucketsConfig()
	cfg.Replicas = 3
	natstest.Provision(t, ctx, func(ctx context.Context) error { return state.EnsureBuckets(ctx, js, cfg) })
	users := testutil.Open[state.User](t, js, state.BucketUsers)
	acked := map[string]bool{}
	// Each write is tried until acknowledged: right after a node stops,
	// its streams elect new leaders (seconds) and writes find none.
	write := func(n int) {
		for i := 0; i < n; i++ {
			k := fmt.Sprintf("u%d", len(acked))
			for deadline := time.Now().Add(30 * time.Second); !acked[k] && time.Now().Before(deadline); {
				wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				if _, err := users.Put(wctx, k, state.User{Name: k}); err == nil {
					acked[k] = true
				}
				cancel()
			}
		}
	}
	// Kill the node leading the bucket's stream, and see another lead it.
	const stream = "KV_" + state.BucketUsers
	killLeader := func() int {
		t.Helper()
		var leader string
		testutil.Eventually(t, 30*time.Second, func() error {
			if leader, _ = streamLeader(ctx, js, stream); leader == "" {
				return errors.New("no leader")
			}
			return nil
		})
		i := nodeIndex(t, leader)
		c.Kill(i)
		testutil.Eventually(t, 30*time.Second, func() error {
			now, _ := streamLeader(ctx, js, stream)
			if now == "" || now == leader {
				return fmt.Errorf("%s led the stream, now %q", leader, now)
			}
			t.Logf("killed %s, the stream's leader; %s leads it now", leader, now)
			return nil
		})
		return i
	}
	write(20)
	first := killLeader()
	before := len(acked)
	write(20)
	if len(acked)-before != 20 {
		t.Fatalf("only %d of 20 writes were acknowledged with the leader's node down", len(acked)-before)
	}
	if err := c.Restart(first); err != nil {
		t.Fatal(err)
	}
	killLeader() // and lose the next leader, so the restarted node must serve
	write(5)
	for k := range acked {
		testutil.Eventually(t, 10*time.Second, func() error {
			e, err := users.Get(ctx, k)
			if err != nil {
				return err
			}
			if e.Value.Name != k {
				return fmt.Errorf("%s = %+v", k, e.Value)
			}
			return nil
		})
	}
}

func BenchmarkCachedSessionLookup(b *testing.B) {
	_, js := setup(b)
	ctx := context.Background()
	sessions := testutil.Open[state.Session](b, js, state.BucketSessions)
	// Index by the raw hash so a lookup needs no hex encoding.
	cache, err := kv.NewCache(ctx, sessions, ">", quiet, kv.IndexBy[state.Session](func(k string) string {
		raw, _ := hex.DecodeString(k[strings.IndexByte(k, '.')+1:])
		return string(raw)
	}))
	if err != nil {
		b.Fatal(err)
	}
	sids := make([]string, 10000)
	for i := range sids {
		sids[i] = fmt.Sprintf("session-id-%032d", i)
		sum := sha256.Sum256([]byte(sids[i]))
		if _, err := sessions.Put(ctx, state.SessionKey(fmt.Sprintf("user%d", i), hex.EncodeToString(sum[:])), state.Session{User: "u"}); err != nil {
			b.Fatal(err)
		}
	}
	<-cache.Synced()
	for cache.Len() < len(sids) {
		time.Sleep(10 * time.Millisecond)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sum := sha256.Sum256([]byte(sids[i%len(sids)]))
		if _, ok := cache.GetBytes(sum[:]); !ok {
			b.Fatal("miss")
		}
	}
}

// A holder cut off from NATS without noticing (a blackholed connection)
// stops leading before its key can expire, so the standby that takes the
// key then never leads beside it: within a TTL of sending the last renewal
// the server acknowledged (its Holder.Since), less the margin.
func TestLeaseHolderStepsDownBeforeItsKeyCanExpire(t *testing.T) {
	t.Parallel() // waits out TTLs
	url, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	faults := testenv.NewFaults(t)
	_, cutJS := natstest.Connect(t, faults.Links("a", []string{strings.TrimPrefix(url, "nats://")}))
	// The holder steps down a tenth of the TTL before its key can expire:
	// at 5 s, half a second for the test's goroutines to be scheduled on a
	// loaded machine.
	const ttl = 5 * time.Second
	a := kv.NewLease(testutil.Open[kv.Holder](t, cutJS, state.BucketLocks), "role", "a", ttl, quiet)

	// Everything a's writes put in the key, as another client sees it.
	locks := testutil.Open[kv.Holder](t, js, state.BucketLocks)
	var mu sync.Mutex
	var lastSince, expired time.Time
	renewals := 0
	if _, err := kv.NewCache(ctx, locks, "role", quiet, kv.OnChange(func(_ string, e kv.Entry[kv.Holder], deleted bool) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case deleted && expired.IsZero():
			expired = time.Now()
		case !deleted && e.Value.ID == "a":
			lastSince = e.Value.Since
			renewals++
		}
	})); err != nil {
		t.Fatal(err)
	}

	leading, stopped := make(chan struct{}), make(chan time.Time, 1)
	actx, stopA := context.WithCancel(ctx)
	defer stopA()
	go a.Run(actx, func(lctx context.Context) {
		select {
		case <-leading:
		default:
			close(leading)
		}
		<-lctx.Done()
		select {
		case stopped <- time.Now():
		default:
		}
	})
	<-leading
	testutil.Eventually(t, 5*ttl, func() error { // a few renewals
		mu.Lock()
		defer mu.Unlock()
		if renewals < 3 {
			return fmt.Errorf("%d records of a", renewals)
		}
		return nil
	})
	faults.Blackhole("a")
	cut := time.Now()

	var stepDown time.Time
	select {
	case stepDown = <-stopped:
	case <-time.After(5 * ttl):
		t.Fatal("a kept leading, cut off from NATS")
	}
	testutil.Eventually(t, 5*ttl, func() error {
		mu.Lock()
		defer mu.Unlock()
		if expired.IsZero() {
			return errors.New("a's key has not expired")
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	t.Logf("last renewal sent %s before the cut; a stepped down %s after it, the key expired %s after it",
		cut.Sub(lastSince).Round(time.Millisecond), stepDown.Sub(lastSince).Round(time.Millisecond), expired.Sub(lastSince).Round(time.Millisecond))
	if !stepDown.Before(expired) || stepDown.After(lastSince.Add(ttl)) {
		t.Fatalf("a led until %s after its last acknowledged renewal was sent, the key expired at %s: two leaders could overlap",
			stepDown.Sub(lastSince), expired.Sub(lastSince))
	}
}

// nodeIndex is the index in c.Nodes of the node named name ("n2").
func nodeIndex(t testing.TB, name string) int {
	t.Helper()
	var i int
	if _, err := fmt.Sscanf(name, "n%d", &i); err != nil {
		t.Fatalf("node name %q: %v", name, err)
	}
	return i
}

// streamLeader is the node leading stream now ("" while it has none).
func streamLeader(ctx context.Context, js jetstream.JetStream, stream string) (string, []string) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil || s.CachedInfo().Cluster == nil {
		return "", nil
	}
	c := s.CachedInfo().Cluster
	peers := []string{c.Leader}
	for _, r := range c.Replicas {
		peers = append(peers, r.Name)
	}
	return c.Leader, peers
}

// The watch of a cache is an ordered consumer on one NATS node. When that
// node dies, the client, connected elsewhere, notices only after missed
// heartbeats (10 s and more); the watchdog sees the bucket move on without
// the watch and replaces it, resuming after the last revision applied, so
// the cache catches up before then (tests review T23).
func TestCacheCatchesUpWhenItsWatchsNodeDies(t *testing.T) {
	// Four nodes, the bucket on three: the client's node holds no replica
	// (as clients of a larger cluster often do), so the consumer is
	// elsewhere and the client keeps its connection when that node dies.
	c := natstest.StartCluster(t, 4, embednats.Options{NoAdvertise: true})
	_, admin := natstest.Connect(t, c.URLs())
	ctx := natstest.Context(t, 3*time.Minute)
	cfg := state.DefaultBucketsConfig()
	cfg.Replicas = 3
	natstest.Provision(t, ctx, func(ctx context.Context) error { return state.EnsureBuckets(ctx, admin, cfg) })
	const stream = "KV_" + state.BucketSessions
	_, peers := streamLeader(ctx, admin, stream)
	client := -1
	for i := range c.Nodes {
		if !strings.Contains(" "+strings.Join(peers, " ")+" ", fmt.Sprintf(" n%d ", i)) {
			client = i
		}
	}
	if len(peers) != 3 || client < 0 {
		t.Fatalf("the bucket's peers are %v: want 3 of the 4 nodes", peers)
	}
	_, js := natstest.Connect(t, c.Nodes[client].URL())
	sessions := testutil.Open[state.Session](t, js, state.BucketSessions)
	cache, err := kv.NewCache(ctx, sessions, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	if _, err := sessions.Put(ctx, "ann.1", state.Session{User: "ann"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cache.Wait(ctx, "ann.1", func(_ kv.Entry[state.Session], ok bool) bool { return ok }); err != nil {
		t.Fatal(err)
	}

	// The node that delivers the watch: its consumer is the bucket's only
	// one.
	var host string
	testutil.Eventually(t, 30*time.Second, func() error {
		s, err := admin.Stream(ctx, stream)
		if err != nil {
			return err
		}
		var hosts []string
		l := s.ListConsumers(ctx)
		for ci := range l.Info() {
			if ci.Cluster != nil {
				hosts = append(hosts, ci.Cluster.Leader)
			}
		}
		if len(hosts) != 1 || hosts[0] == "" {
			return fmt.Errorf("consumers on %v (%v), want the watch's alone", hosts, l.Err())
		}
		host = hosts[0]
		return nil
	})
	if nodeIndex(t, host) == client {
		t.Fatalf("the watch's consumer is on the client's node %s, which holds no replica", host)
	}
	// Writes go on without an election: the stream is led elsewhere.
	testutil.Eventually(t, 30*time.Second, func() error {
		leader, _ := streamLeader(ctx, admin, stream)
		if leader != "" && leader != host {
			return nil
		}
		if leader == host {
			_, _ = admin.Conn().Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 5*time.Second)
		}
		return fmt.Errorf("the stream is led by %q, the watch's node", leader)
	})

	c.Kill(nodeIndex(t, host))
	killed := time.Now()
	// A write the dead consumer can never deliver.
	testutil.Eventually(t, 30*time.Second, func() error {
		_, err := sessions.Put(ctx, "bob.1", state.Session{User: "bob"})
		return err
	})
	var resumed time.Duration
	testutil.Eventually(t, 60*time.Second, func() error {
		if resumed == 0 && cache.Resumes() > 0 {
			resumed = time.Since(killed)
		}
		if _, ok := cache.Get("bob.1"); !ok {
			return errors.New("the cache has not seen the write made after its watch's node died")
		}
		return nil
	})
	caughtUp := time.Since(killed)
	if cache.Resumes() == 0 {
		t.Fatalf("the cache caught up %s after the kill without the watchdog: the client's own heartbeat check came first", caughtUp.Round(time.Millisecond))
	}
	t.Logf("watch of %s killed: the watchdog replaced it after %s, the cache caught up after %s",
		host, resumed.Round(time.Millisecond), caughtUp.Round(time.Millisecond))
	// The replacement lives on a node that is up, and resumed where the
	// old one stopped: nothing written before is missing.
	if _, ok := cache.Get("ann.1"); !ok || cache.Len() != 2 {
		t.Fatalf("cache holds %d entries after the resume, want ann.1 and bob.1", cache.Len())
	}
}

// EachKey brings each live key the filter matches, none deleted, and
// says when its context ended the listing early.
func TestEachKeyStreamsTheLiveKeys(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	sessions, err := kv.Open[state.Session](ctx, js, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ann.a", "ann.b", "bob.a", "cat.a"} {
		if _, err := sessions.Put(ctx, k, state.Session{User: k[:3]}); err != nil {
			t.Fatal(err)
		}
	}
	if err := sessions.Purge(ctx, "cat.a"); err != nil {
		t.Fatal(err)
	}
	for filter, want := range map[string][]string{">": {"ann.a", "ann.b", "bob.a"}, "ann.*": {"ann.a", "ann.b"}, "dan.*": nil} {
		var got []string
		if err := sessions.EachKey(ctx, filter, func(k string) { got = append(got, k) }); err != nil {
			t.Fatalf("%s: %v", filter, err)
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Fatalf("%s: keys %v, want %v", filter, got, want)
		}
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	if err := sessions.EachKey(ended, ">", func(string) {}); !errors.Is(err, context.Canceled) {
		t.Fatalf("a listing whose context ended: %v, want context.Canceled", err)
	}
}

// OnReplace tells each change with what it replaced, so a count kept from
// the deltas alone (no copy of its own) always says what a walk of the
// cache says: through puts, deletes, purges and Notes, from the watch and
// from another goroutine.
func TestOnReplaceCountsWithoutACopy(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	var mu sync.Mutex
	byPhase := map[state.Phase]int{}
	cache, err := kv.NewCache(ctx, boxes, ">", quiet, kv.OnReplace(func(_ string, was kv.Entry[state.Sandbox], had bool, e kv.Entry[state.Sandbox], deleted bool) {
		mu.Lock()
		defer mu.Unlock()
		if had {
			byPhase[was.Value.Phase]--
		}
		if !deleted {
			byPhase[e.Value.Phase]++
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 600 {
		key := "u" + strconv.Itoa(rng.IntN(40))
		switch rng.IntN(6) {
		case 0:
			_ = boxes.Delete(ctx, key, 0)
		case 1:
			_ = boxes.Purge(ctx, key)
		default:
			b := state.Sandbox{User: key, Phase: state.Phases[rng.IntN(len(state.Phases))]}
			rev, err := boxes.Put(ctx, key, b)
			if err != nil {
				t.Fatal(err)
			}
			if i%3 == 0 {
				cache.Note(key, b, rev) // as a writer does, before its watch brings it
			}
		}
	}
	if err := cache.CatchUp(ctx); err != nil {
		t.Fatal(err)
	}
	walk := map[state.Phase]int{}
	cache.Range(func(e kv.Entry[state.Sandbox]) bool {
		walk[e.Value.Phase]++
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	for _, p := range state.Phases {
		if byPhase[p] != walk[p] {
			t.Fatalf("counted from the changes %v, walked %v", byPhase, walk)
		}
	}
	if cache.Len() == 0 || cache.Len() == 40 {
		t.Fatalf("%d keys left: the changes never both made and removed some", cache.Len())
	}
}

// A bucket at its cap refuses writes with ErrFull, whichever way they
// come (Put, Create over a delete marker, Update), and stores nothing;
// a delete (a marker, under the cap's discard policy) still goes, and
// the bucket takes writes again once records went.
func TestAFullBucketRefusesWritesWithErrFull(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "small", MaxBytes: 4 << 10, History: 1}); err != nil {
		t.Fatal(err)
	}
	small := testutil.Open[state.Session](t, js, "small")
	big := state.Session{User: strings.Repeat("u", 300)}
	var kept []string
	var full error
	for i := 0; full == nil; i++ {
		if i > 100 {
			t.Fatal("a 4 KiB bucket took 100 records of 300 bytes")
		}
		key := "k" + strconv.Itoa(i)
		if _, full = small.Put(ctx, key, big); full == nil {
			kept = append(kept, key)
		}
	}
	if !errors.Is(full, kv.ErrFull) || len(kept) == 0 {
		t.Fatalf("after %d records: %v, want ErrFull", len(kept), full)
	}
	e, err := small.Get(ctx, kept[0])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := small.Create(ctx, "another", big); !errors.Is(err, kv.ErrFull) {
		t.Fatalf("create in a full bucket: %v, want ErrFull", err)
	}
	if _, err := small.Update(ctx, kept[0], state.Session{User: strings.Repeat("v", 300)}, e.Revision); !errors.Is(err, kv.ErrFull) {
		t.Fatalf("update in a full bucket: %v, want ErrFull", err)
	}
	if keys, err := small.Keys(ctx, ">"); err != nil || len(keys) != len(kept) {
		t.Fatalf("the refused writes stored something: %d keys, want %d (%v)", len(keys), len(kept), err)
	}
	for _, k := range kept[:len(kept)/2+1] {
		if err := small.Purge(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := small.Put(ctx, "after", big); err != nil {
		t.Fatalf("a write once records went: %v", err)
	}
}
