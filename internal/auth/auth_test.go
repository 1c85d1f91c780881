package auth_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/state"
)

func setup(t testing.TB) (*auth.Store, *ratelimit.Limiter) { return setupCap(t, 10_000) }

func setupCap(t testing.TB, maxPerUser int) (*auth.Store, *ratelimit.Limiter) {
	t.Helper()
	js := bus(t)
	lim, err := ratelimit.New(natstest.Context(t, time.Minute), js, 3, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return newStore(t, context.Background(), js, maxPerUser), lim
}

// bus is a NATS server with the buckets.
func bus(t testing.TB) jetstream.JetStream {
	t.Helper()
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	if err := state.EnsureBuckets(natstest.Context(t, time.Minute), js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	return js
}

// newStore is a Store whose watch ends with ctx.
func newStore(t testing.TB, ctx context.Context, js jetstream.JetStream, maxPerUser int) *auth.Store {
	return newStoreAt(t, ctx, js, maxPerUser, nil)
}

// newStoreAt is newStore whose budgets and miss memory read now.
func newStoreAt(t testing.TB, ctx context.Context, js jetstream.JetStream, maxPerUser int, now func() time.Time) *auth.Store {
	t.Helper()
	store, err := auth.NewStore(ctx, js, auth.StoreOptions{TTL: time.Hour, MaxPerUser: maxPerUser, Limit: 10_000, Log: slog.New(slog.DiscardHandler), Now: now})
	if err != nil {
		t.Fatal(err)
	}
	return store
}

// fakeClock is a clock the test moves by hand: budgets refill and misses
// fade only when it says so, however slow the machine.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_800_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// A session cookie without the cookie naming its user (set by an earlier
// release), on a request that names none (the gateway's own pages), finds
// its session under any user,
// the instant it was created on another edge, and whatever the watch of
// the edge asked (here: stopped); an unknown id is a verdict, not an
// error.
func TestFetchWithoutAUserFindsTheSessionUnderAnyUser(t *testing.T) {
	js := bus(t)
	ctx := natstest.Context(t, time.Minute)
	here := newStore(t, context.Background(), js, 100)
	there := newStore(t, context.Background(), js, 100)
	frozen, freeze := context.WithCancel(context.Background())
	lagging := newStore(t, frozen, js, 100)
	freeze()
	for i := range 50 {
		cookie, err := here.Create(ctx, "bob", "login")
		if err != nil {
			t.Fatal(err)
		}
		// A client each: one client's read budget is a burst of 20.
		for _, edge := range []*auth.Store{there, lagging} {
			sess, ok, err := edge.Fetch(ctx, fmt.Sprintf("10.0.%d.1", i), "", sumOf(cookie))
			if !ok || err != nil || sess.User != "bob" {
				t.Fatalf("session %d from another edge: %+v %v %v", i, sess, ok, err)
			}
		}
	}
	if _, ok, err := there.Fetch(ctx, "10.0.0.1", "", sha256.Sum256([]byte(ident.NewSecret()))); ok || err != nil {
		t.Fatalf("an unknown id: %v %v", ok, err)
	}
}

// An edge that never served a session reads it once, by the key its
// cookies name, and then holds it: the next request costs no read, and a
// revocation on another edge reaches it.
func TestAnotherEdgeReadsASessionOnce(t *testing.T) {
	js := bus(t)
	ctx := natstest.Context(t, time.Minute)
	here := newStore(t, context.Background(), js, 10)
	there := newStore(t, context.Background(), js, 10)
	cookie, err := here.Create(ctx, "bob", "login")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := there.Lookup([]byte(cookie)); ok {
		t.Fatal("the other edge holds a session it never served")
	}
	read, _, _ := kv.CacheLoads()
	if sess, ok, err := there.Fetch(ctx, "10.0.0.1", "bob", sumOf(cookie)); !ok || err != nil || sess.User != "bob" {
		t.Fatalf("fetch under the user cookie's name: %+v %v %v", sess, ok, err)
	}
	for range 3 {
		if _, ok := there.Lookup([]byte(cookie)); !ok {
			t.Fatal("the session read is not held")
		}
	}
	if r, _, _ := kv.CacheLoads(); r != read+1 {
		t.Fatalf("%d reads for one session used four times", r-read)
	}
	if err := here.Revoke(ctx, "bob", sumOf(cookie)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if _, ok := there.Lookup([]byte(cookie)); ok {
			return errors.New("the revocation has not reached the edge that holds the session")
		}
		return nil
	})
}

// An edge whose watch lags finds a session created elsewhere by reading
// the bucket under the user the request names, and nowhere else; an id
// it did not find is not read again until the miss fades; and a client's
// unknown ids beyond its read budget are an error, not a verdict, while
// another client's session is still read.
func TestFetchReadsWhatTheWatchHasNotBrought(t *testing.T) {
	js := bus(t)
	ctx := natstest.Context(t, time.Minute)
	clock := newFakeClock()
	here := newStore(t, context.Background(), js, 10)
	frozen, freeze := context.WithCancel(context.Background())
	lagging := newStoreAt(t, frozen, js, 10, clock.Now)
	freeze() // its cache hears of nothing from now on

	sid, err := here.Create(ctx, "bob", "login")
	if err != nil {
		t.Fatal(err)
	}
	sum := sumOf(sid)
	if _, ok := lagging.LookupSum(sum); ok {
		t.Fatal("the frozen cache saw the new session; the test proves nothing")
	}
	if _, ok, err := lagging.Fetch(ctx, "10.0.0.1", "ann", sum); ok || err != nil {
		t.Fatalf("fetch under another user: %v %v", ok, err)
	}
	sess, ok, err := lagging.Fetch(ctx, "10.0.0.1", "bob", sum)
	if !ok || err != nil || sess.User != "bob" {
		t.Fatalf("fetch = %+v %v %v", sess, ok, err)
	}
	if _, ok := lagging.LookupSum(sum); !ok {
		t.Fatal("a fetched session is not kept while the watch is behind it")
	}

	// A miss is remembered: the session written under it right after is
	// not seen until the memory (2 s) fades, on the store's clock.
	b, err := kv.Open[state.Session](ctx, js, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	late := sha256.Sum256([]byte(ident.NewSecret()))
	if _, ok, err := lagging.Fetch(ctx, "10.0.0.1", "bob", late); ok || err != nil {
		t.Fatalf("fetch of an unknown id: %v %v", ok, err)
	}
	if _, err := b.Put(ctx, state.SessionKey("bob", hex.EncodeToString(late[:])), state.Session{User: "bob", Created: time.Now(), Expires: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	clock.Add(1900 * time.Millisecond)
	if _, ok, _ := lagging.Fetch(ctx, "10.0.0.1", "bob", late); ok {
		t.Fatal("a remembered miss was read again before it faded")
	}
	clock.Add(100 * time.Millisecond)
	if _, ok, err := lagging.Fetch(ctx, "10.0.0.1", "bob", late); !ok || err != nil {
		t.Fatalf("not found once the miss faded: %v %v", ok, err)
	}

	// One client's random ids, 10,000 at one instant: its budget (a burst
	// of 20) runs out and says so; another client
	// still reads the session just created elsewhere, and the first gets
	// 10 more reads a second later.
	clock.Add(time.Hour) // every budget full again
	spam := func(n int) (read, refused int) {
		for range n {
			switch _, ok, err := lagging.Fetch(ctx, "203.0.113.7", "bob", sha256.Sum256([]byte(ident.NewSecret()))); {
			case ok:
				t.Fatal("a random id was found")
			case err != nil:
				refused++
			default:
				read++
			}
		}
		return read, refused
	}
	if read, refused := spam(10_000); read != 20 || refused != 10_000-20 {
		t.Fatalf("10,000 random ids from one client at once: %d read, %d refused; want 20 read", read, refused)
	}
	fresh, err := here.Create(ctx, "bob", "login")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := lagging.Fetch(ctx, "198.51.100.9", "bob", sumOf(fresh)); !ok || err != nil {
		t.Fatalf("another client's new session, after one client spent its budget: %v %v", ok, err)
	}
	clock.Add(time.Second)
	if read, _ := spam(100); read != 10 {
		t.Fatalf("a second later the client read %d more, want 10", read)
	}
}

func TestStoreCreateLookupRevoke(t *testing.T) {
	store, _ := setup(t)
	ctx := natstest.Context(t, time.Minute)
	sid, err := store.Create(ctx, "bob", "login")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if s, ok := store.Lookup([]byte(sid)); !ok || s.User != "bob" {
			return context.DeadlineExceeded
		}
		return nil
	})
	for _, bad := range []string{"", "x", sid[:42], sid + "x", strings.Repeat("!", 43)} {
		if _, ok := store.Lookup([]byte(bad)); ok {
			t.Errorf("lookup of %q succeeded", bad)
		}
	}
	other, _ := store.Create(ctx, "bob", "login")
	if err := store.Revoke(ctx, "bob", sumOf(sid)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if _, ok := store.Lookup([]byte(sid)); ok {
			return context.DeadlineExceeded
		}
		return nil
	})
	if _, ok := store.Lookup([]byte(other)); !ok {
		t.Fatal("revoking one session revoked another")
	}
	if _, err := store.RevokeAll(ctx, "bob"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if _, ok := store.Lookup([]byte(other)); ok {
			return context.DeadlineExceeded
		}
		return nil
	})
}

// A user holds at most the cap of sessions: each new one beyond it ends
// the oldest, and only the oldest.
func TestSessionCapEndsTheOldest(t *testing.T) {
	store, _ := setupCap(t, 3)
	ctx := natstest.Context(t, time.Minute)
	var sids []string
	for i := 0; i < 5; i++ {
		sid, err := store.Create(ctx, "bob", "login")
		if err != nil {
			t.Fatal(err)
		}
		sids = append(sids, sid)
		time.Sleep(5 * time.Millisecond) // distinct creation times
	}
	carol, _ := store.Create(ctx, "carol", "login")
	testutil.Eventually(t, 5*time.Second, func() error {
		for i, sid := range sids {
			if _, ok := store.Lookup([]byte(sid)); ok != (i >= 2) {
				return fmt.Errorf("session %d valid=%v", i, ok)
			}
		}
		return nil
	})
	// Counted at once, as the admin list counts a page.
	n, err := store.Count(ctx, "bob", "carol", "nobody")
	if err != nil || n["bob"] != 3 || n["carol"] != 1 || n["nobody"] != 0 {
		t.Fatalf("counts %v: %v", n, err)
	}
	if _, ok := store.Lookup([]byte(carol)); !ok {
		t.Fatal("carol's session is not found")
	}
}

// BenchmarkSessionLookup is the per-request cost of authenticating a
// cookie: validation, SHA-256 and a cache read.
func BenchmarkSessionLookup(b *testing.B) {
	store, _ := setup(b)
	ctx := context.Background()
	sids := make([][]byte, 1000)
	for i := range sids {
		sid, err := store.Create(ctx, "bob", "login")
		if err != nil {
			b.Fatal(err)
		}
		sids[i] = []byte(sid)
	}
	for store.Len() < len(sids) {
		time.Sleep(10 * time.Millisecond)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, ok := store.Lookup(sids[i%len(sids)]); !ok {
			b.Fatal("miss")
		}
	}
}

// sumOf is the SHA-256 of a session id, what the store keys it by.
func sumOf(sid string) [32]byte { return sha256.Sum256([]byte(sid)) }
