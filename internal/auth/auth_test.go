package auth_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/embednats/natstest"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testutil"
)

func TestValidateUser(t *testing.T) {
	good := []string{"bob", "al", "x9", "a-b", "carol-2", strings.Repeat("a", 32)}
	bad := []string{
		"", "a", strings.Repeat("a", 33), "Bob", "BOB", "..", "a..b", "a.b", "a/b", "a b", "-ab", "ab-", "a--b", "9ab",
		"bоb",       // Cyrillic о
		"bob\u200b", // zero-width space
		"dsh-bob", "dsh", "dshbob", "admin", "pool", "bob\n",
	}
	for _, n := range good {
		if err := auth.ValidateUser(n); err != nil {
			t.Errorf("%q refused: %v", n, err)
		}
	}
	for _, n := range bad {
		if auth.ValidateUser(n) == nil {
			t.Errorf("%q accepted", n)
		}
	}
}

func TestTokens(t *testing.T) {
	tok := auth.NewToken("bob")
	if u, ok := auth.TokenUser(tok); !ok || u != "bob" {
		t.Fatalf("TokenUser(%q) = %q %v", tok, u, ok)
	}
	h := auth.HashHex(tok)
	if !auth.TokenMatches(tok, h) || auth.TokenMatches(auth.NewToken("bob"), h) || auth.TokenMatches(tok, "") {
		t.Fatal("token matching is wrong")
	}
	sid := auth.NewSessionID()
	if _, ok := auth.TokenUser(sid); ok {
		t.Fatal("a session id passes as a token")
	}
	for _, bad := range []string{"", "bob", "bob.", "Bob." + strings.Repeat("a", 43), "bob.short"} {
		if _, ok := auth.TokenUser(bad); ok {
			t.Errorf("%q parsed as a token", bad)
		}
	}
}

func setup(t testing.TB) (*auth.Store, *auth.Limiter) { return setupCap(t, 10_000) }

func setupCap(t testing.TB, maxPerUser int) (*auth.Store, *auth.Limiter) {
	t.Helper()
	js := bus(t)
	lim, err := auth.NewLimiter(natstest.Context(t, time.Minute), js, 3, time.Minute)
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

// newStore is a Store whose cache has synced; its watch ends with ctx.
func newStore(t testing.TB, ctx context.Context, js jetstream.JetStream, maxPerUser int) *auth.Store {
	return newStoreAt(t, ctx, js, maxPerUser, nil)
}

// newStoreAt is newStore whose budgets and miss memory read now.
func newStoreAt(t testing.TB, ctx context.Context, js jetstream.JetStream, maxPerUser int, now func() time.Time) *auth.Store {
	t.Helper()
	store, err := auth.NewStore(ctx, js, auth.StoreOptions{TTL: time.Hour, MaxPerUser: maxPerUser, Log: slog.New(slog.DiscardHandler), Now: now})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if !store.Synced() {
			return context.DeadlineExceeded
		}
		return nil
	})
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

// A request that names no user (the gateway's own pages) right after
// signing in on another edge finds the session: the edge's cache catches
// up with the bucket first. Each session is asked for the instant it was
// created; TestCacheCatchUp shows the watch alone is often behind then.
// A cache that cannot catch up says the session cannot be checked, not
// that there is none.
func TestFetchWithoutAUserCatchesUp(t *testing.T) {
	js := bus(t)
	ctx := natstest.Context(t, time.Minute)
	here := newStore(t, context.Background(), js, 100)
	there := newStore(t, context.Background(), js, 100)
	for i := range 50 {
		sid, err := here.Create(ctx, "bob", "login")
		if err != nil {
			t.Fatal(err)
		}
		// A client each: one client's read budget is a burst of 20.
		sess, ok, err := there.Fetch(ctx, fmt.Sprintf("10.0.%d.1", i), "", sha256.Sum256([]byte(sid)))
		if !ok || err != nil || sess.User != "bob" {
			t.Fatalf("session %d from the other edge: %+v %v %v", i, sess, ok, err)
		}
	}
	if _, ok, err := there.Fetch(ctx, "10.0.0.1", "", sha256.Sum256([]byte(auth.NewSessionID()))); ok || err != nil {
		t.Fatalf("an unknown id: %v %v", ok, err)
	}

	frozen, freeze := context.WithCancel(context.Background())
	lagging := newStore(t, frozen, js, 100)
	freeze()
	sid, err := here.Create(ctx, "bob", "login")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := lagging.Fetch(ctx, "10.0.0.1", "", sha256.Sum256([]byte(sid))); ok || err == nil {
		t.Fatalf("a cache whose watch stopped gave a verdict: %v %v", ok, err)
	}
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
	sum := sha256.Sum256([]byte(sid))
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
	late := sha256.Sum256([]byte(auth.NewSessionID()))
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
			switch _, ok, err := lagging.Fetch(ctx, "203.0.113.7", "bob", sha256.Sum256([]byte(auth.NewSessionID()))); {
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
	if _, ok, err := lagging.Fetch(ctx, "198.51.100.9", "bob", sha256.Sum256([]byte(fresh))); !ok || err != nil {
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
	if err := store.Revoke(ctx, "bob", sha256.Sum256([]byte(sid))); err != nil {
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
	if err := store.RevokeAll(ctx, "bob"); err != nil {
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
	if _, ok := store.Lookup([]byte(carol)); !ok || store.Count("bob") != 3 || store.Count("carol") != 1 {
		t.Fatalf("counts bob %d carol %d", store.Count("bob"), store.Count("carol"))
	}
}

func TestLimiter(t *testing.T) {
	_, lim := setup(t)
	ctx := natstest.Context(t, time.Minute)
	for i := 0; i < 3; i++ {
		if v, err := lim.Allow(ctx, "10.0.0.1"); !v.Allowed || err != nil {
			t.Fatalf("attempt %d refused: %v", i+1, err)
		}
	}
	v, err := lim.Allow(ctx, "10.0.0.1")
	if v.Allowed || !v.Audit || err != nil || v.RetryAfter <= 0 || v.RetryAfter > time.Minute {
		t.Fatalf("4th attempt: %+v err=%v", v, err)
	}
	// Only the first refusal in the window is the one to audit, whichever
	// way it was refused.
	if v, _ := lim.Allow(ctx, "10.0.0.1"); v.Allowed || v.Audit {
		t.Fatalf("5th attempt: %+v", v)
	}
	if first, err := lim.Refused(ctx, "10.0.0.1"); first || err != nil {
		t.Fatalf("a refusal after the audited one is audited again: %v %v", first, err)
	}
	if v, _ := lim.Allow(ctx, "10.0.0.2"); !v.Allowed {
		t.Fatal("another client was limited")
	}
	if first, _ := lim.Refused(ctx, "10.0.0.2"); !first {
		t.Fatal("another client's first refusal is not audited")
	}
	if first, _ := lim.Refused(ctx, "10.0.0.2"); first {
		t.Fatal("its second is")
	}
}

// The window slides: once the oldest attempt leaves it, exactly one more
// attempt fits, wherever a fixed window's boundary would have fallen.
func TestLimiterWindowSlides(t *testing.T) {
	_, js := natstest.Connect(t, natstest.Start(t).URL())
	ctx := natstest.Context(t, time.Minute)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	const window = 2 * time.Second
	lim, err := auth.NewLimiter(ctx, js, 3, window)
	if err != nil {
		t.Fatal(err)
	}
	allow := func(what string, want bool) time.Duration {
		t.Helper()
		v, err := lim.Allow(ctx, "10.0.0.3")
		if err != nil || v.Allowed != want {
			t.Fatalf("%s: allowed=%v err=%v, want allowed=%v", what, v.Allowed, err, want)
		}
		return v.RetryAfter
	}
	allow("first", true)
	time.Sleep(window / 2)
	allow("second", true)
	allow("third", true)
	retry := allow("fourth", false)
	if retry <= 0 || retry > window/2+100*time.Millisecond {
		t.Fatalf("retry after %s, want about %s (when the first attempt leaves)", retry, window/2)
	}
	time.Sleep(retry + 50*time.Millisecond)
	allow("after the first left", true)
	allow("while the second and third are in the window", false)
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

func TestSSOName(t *testing.T) {
	for _, tt := range []struct{ login, want string }{
		{"alice", "alice"},
		{"AliceSmith", "alicesmith"},
		{" Bob ", "bob"},
		{"alice.smith", "alice-smith-"},
		{"alice_smith", "alice-smith-"},
		{"admin", "admin-"},
		{"dshuser", "u-dshuser-"},
		{"9lives", "u-9lives-"},
		{"x", "x-"},
		{"ünïcode", "n-code-"},
		{"---", "u-"},
		{strings.Repeat("long", 20), "longlonglonglonglonglongl-"},
	} {
		got := auth.SSOName(tt.login)
		if err := auth.ValidateUser(got); err != nil {
			t.Errorf("SSOName(%q) = %q, not an account name: %v", tt.login, got, err)
		}
		if got != tt.want && !(strings.HasSuffix(tt.want, "-") && strings.HasPrefix(got, tt.want) && len(got) == len(tt.want)+6) {
			t.Errorf("SSOName(%q) = %q, want %q", tt.login, got, tt.want)
		}
		if again := auth.SSOName(tt.login); again != got {
			t.Errorf("SSOName(%q) is not deterministic: %q then %q", tt.login, got, again)
		}
	}
	if auth.SSOName("alice.smith") == auth.SSOName("alice_smith") {
		t.Error("two logins that differ in a dropped character share an account name")
	}
	if auth.SSOName("AliceSmith") != auth.SSOName("alicesmith") {
		t.Error("logins that differ only in case got different accounts")
	}
}

// An ADMIN_USERS entry names an account and the identity it is bound to;
// a name alone, or an identity that is not a SHA-256, is refused.
func TestParseAdmin(t *testing.T) {
	h := auth.HashHex(auth.NewToken("ops"))
	if a, err := auth.ParseAdmin(" ops:" + strings.ToUpper(h) + " "); err != nil || a.Name != "ops" || a.Identity != h {
		t.Fatalf("ParseAdmin = %+v %v", a, err)
	}
	for _, bad := range []string{"ops", "ops:", ":" + h, "ops:" + h[:63], "ops:" + h + "0", "ops:" + strings.Repeat("g", 64), "Ops:" + h, "root:" + h, "ops:" + h + ":x"} {
		if a, err := auth.ParseAdmin(bad); err == nil {
			t.Errorf("%q accepted as %+v", bad, a)
		}
	}
}
