package auth_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// The session-fetch budget is per client (security review S12): one
// client sending 10,000 random well-formed cookies to an edge whose watch
// lags spends its own budget, and sessions created on another edge 50 ms
// before their browsers (other clients) reach this edge still open there,
// in the middle of the flood. The flood is proved to have reached the
// budget: the flooding client is told to retry.
func TestOneClientsRandomCookiesDoNotLockOutAnothersNewSession(t *testing.T) {
	js := bus(t)
	ctx := natstest.Context(t, time.Minute)
	other := newStore(t, context.Background(), js, 10)
	frozen, freeze := context.WithCancel(context.Background())
	lagging := newStore(t, frozen, js, 10)
	freeze() // this edge's watch brings nothing from now on
	ub, err := kv.Open[state.User](ctx, js, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	users, err := kv.NewCache(context.Background(), ub, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	a := auth.New(auth.Options{Store: lagging, Users: users, CookieName: "sid", Metrics: prometheus.NewRegistry()})
	app := flooded(t, a)

	ask := func(client, sid string) int {
		req := httptest.NewRequest(http.MethodGet, "/u/bob/", nil)
		req.Header.Set("X-Forwarded-For", client)
		req.Header.Set("Cookie", "sid="+sid)
		resp, err := app.Test(req, -1)
		if err != nil {
			t.Error(err)
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	const flood = 10_000
	var sent, retry, refused atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 16 {
		wg.Go(func() {
			b := make([]byte, 32)
			for sent.Add(1) <= flood {
				_, _ = rand.Read(b)
				switch st := ask("203.0.113.7", base64.RawURLEncoding.EncodeToString(b)); st {
				case http.StatusServiceUnavailable:
					retry.Add(1)
				case http.StatusUnauthorized:
					refused.Add(1)
				default:
					t.Errorf("a random cookie: %d", st)
					return
				}
			}
		})
	}
	// Five browsers, each signed in on the other edge 50 ms before it
	// reaches this one, at five points of the flood.
	var victims []string
	for i := range 5 {
		for sent.Load() < int64(flood*(i+1)/10) {
			time.Sleep(time.Millisecond)
		}
		sid, err := other.Create(ctx, "bob", "login")
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // the browser follows the redirect to this edge
		if _, ok := lagging.LookupSum(sumOf(sid)); ok {
			t.Fatal("this edge's frozen cache holds the new session; the test proves nothing")
		}
		during := sent.Load()
		if st := ask(fmt.Sprintf("198.51.100.%d", i+1), sid); st != http.StatusOK {
			victims = append(victims, fmt.Sprintf("browser %d, after %d of the flood's cookies: %d", i+1, during, st))
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	if len(victims) > 0 {
		t.Fatalf("sessions created on another edge 50 ms earlier, refused here: %v", victims)
	}
	if retry.Load() == 0 {
		t.Fatalf("%d random cookies from one client were all read from the bucket: the flood never reached the budget", flood)
	}
	t.Logf("%d random cookies in %s: %d read and refused, %d told to retry", flood, elapsed.Round(time.Millisecond), refused.Load(), retry.Load())
}

// flooded is a fiber app that answers /u/<user>/ with the status of
// AuthenticateFor, behind the edge's client policy (any X-Forwarded-For
// is believed: app.Test's peer is 0.0.0.0).
func flooded(t *testing.T, a *auth.Authenticator) *fiber.App {
	t.Helper()
	clients, err := httpguard.NewPolicy(httpguard.Options{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/32")}, PublicHosts: []string{"*"}})
	if err != nil {
		t.Fatal(err)
	}
	app := fiber.New(fiber.Config{DisableStartupMessage: true})
	app.Use(clients.Middleware)
	app.Get("/u/:user/", func(c *fiber.Ctx) error {
		if _, err := a.AuthenticateFor(c, c.Params("user")); err != nil {
			return c.SendStatus(web.AsError(err).Status)
		}
		return c.SendStatus(http.StatusOK)
	})
	return app
}
