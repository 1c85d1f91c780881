package auth_test

import (
	"bufio"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/state"
)

const (
	fuzzCookie = "__Host-dsh_gw_session"
	// bobToken is bob's bearer token; {SID} in a fuzzed header block is
	// alice's session id, {TOKEN} bob's token.
	bobToken = "bob.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
)

// FuzzCredentials sends a request with a fuzzed header block (after a
// fixed request line, as fasthttp parses it for the edge) to the real
// Authenticator, which knows one session (alice's) and one account with
// a bearer token (bob's), and reads the same request with net/http, as
// a strict server would. The Authenticator admits alice only when the
// request's session cookie (the first one of that name) is alice's id
// and it carries no Authorization header, bob only when its one
// Authorization header is "Bearer " and bob's token, nobody else ever,
// and every other request is an error; an Authorization header that fails
// never falls back to the cookie.
func FuzzCredentials(f *testing.F) {
	for _, s := range []string{
		"Cookie: " + fuzzCookie + "={SID}\r\n",
		"Cookie: a=1; " + fuzzCookie + "={SID}; b=2\r\n",
		"Cookie: " + fuzzCookie + "=\"{SID}\"\r\n",
		"Cookie: " + fuzzCookie + "=x; " + fuzzCookie + "={SID}\r\n",
		"Cookie: " + fuzzCookie + "={SID}\r\nCookie: " + fuzzCookie + "=x\r\n",
		"Cookie: " + strings.ToLower(fuzzCookie) + "={SID}\r\n",
		"Cookie: " + fuzzCookie + " = {SID}\r\n",
		"Authorization: Bearer {TOKEN}\r\n",
		"Authorization: bearer {TOKEN}\r\n",
		"Authorization: Bearer  {TOKEN}\r\n",
		"Authorization: Basic Ym9iOng=\r\nCookie: " + fuzzCookie + "={SID}\r\n",
		"Authorization: Bearer alice.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\r\n",
		"authorization: Bearer {TOKEN}x\r\n",
	} {
		f.Add([]byte(s))
	}
	a, sid := authenticator(f)
	app := fiber.New()
	f.Fuzz(func(t *testing.T, block []byte) {
		raw := "GET /u/alice/ HTTP/1.1\r\nHost: gw.example\r\n" + strings.NewReplacer("{SID}", sid, "{TOKEN}", bobToken).Replace(string(block)) + "\r\n\r\n"
		var rc fasthttp.RequestCtx
		if err := rc.Request.Header.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			return // the edge answers 400
		}
		c := app.AcquireCtx(&rc)
		defer app.ReleaseCtx(c)
		id, err := a.Authenticate(c)

		strict, serr := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
		if err != nil {
			return // refused: nothing to hold against a strict reader
		}
		if serr != nil {
			t.Fatalf("admitted %s (%s) from a request net/http refuses (%v):\n%s", id.User, id.Method, serr, raw)
		}
		cookie, cerr := strict.Cookie(fuzzCookie)
		var authz []string // the Authorization headers that say anything
		for _, v := range strict.Header.Values("Authorization") {
			if v != "" {
				authz = append(authz, v)
			}
		}
		switch {
		case id.User == "alice" && id.Method == auth.MethodCookie:
			// Spaces around the value are the client's own doing (browsers
			// send none): the value is still alice's id.
			if len(authz) > 0 || cerr != nil || strings.TrimSpace(cookie.Value) != sid {
				t.Fatalf("admitted alice by her cookie; net/http reads Authorization %q and the cookie %v (%v):\n%s", authz, cookie, cerr, raw)
			}
		case id.User == "bob" && id.Method == auth.MethodBearer:
			if len(authz) != 1 || authz[0] != "Bearer "+bobToken {
				t.Fatalf("admitted bob by his token; net/http reads Authorization %q:\n%s", authz, raw)
			}
		default:
			t.Fatalf("admitted %q by %q:\n%s", id.User, id.Method, raw)
		}
	})
}

// authenticator is an Authenticator on a NATS server of its own with
// alice's session (its id returned) and bob's account and token.
func authenticator(t testing.TB) (*auth.Authenticator, string) {
	js := bus(t)
	lim, err := ratelimit.New(natstest.Context(t, time.Minute), js, 3, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	store := newStore(t, context.Background(), js, 10)
	sid, err := store.Create(context.Background(), "alice", "signup")
	if err != nil {
		t.Fatal(err)
	}
	users, err := kv.Open[state.User](context.Background(), js, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := users.Put(context.Background(), "bob", state.User{Name: "bob", TokenHash: ident.HashHex(bobToken), Managed: true}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	cache, err := kv.NewCache(ctx, users, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if _, ok := cache.Get("bob"); !ok {
			return errors.New("bob's account not seen yet")
		}
		if _, ok := store.LookupSum(sumOf(sid)); !ok {
			return errors.New("alice's session not seen yet")
		}
		return nil
	})
	return auth.New(auth.Options{Store: store, Limiter: lim, Users: cache, CookieName: fuzzCookie, Metrics: prometheus.NewRegistry()}), sid
}
