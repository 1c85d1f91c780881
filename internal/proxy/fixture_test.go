package proxy

import (
	"context"
	"crypto/rand"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// fixture is the proxy on a real NATS server (a fresh one per test, as
// nats.go's own tests do) with its caches, in front of an httptest
// upstream that plays DSH. It plays lifecycle too, by writing the
// sandboxes and handshakes buckets, so the hot path is tested in
// milliseconds without a control plane.
type fixture struct {
	t        testing.TB
	url      string // the edge, http://127.0.0.1:port
	nats     *embednats.Server
	natsURL  string
	metrics  *prometheus.Registry
	js       jetstream.JetStream
	boxes    *kv.Bucket[state.Sandbox]
	hs       *kv.Bucket[state.Handshake]
	boxCache *kv.Cache[state.Sandbox]
	hsCache  *kv.Cache[state.Handshake]
	sealer   *handshake.Sealer
	upstream *httptest.Server
	proxy    *Proxy
	// cookie is the DSH auth cookie the upstream accepts now; onRefuse,
	// when set, runs for every request it refuses.
	cookie   atomic.Pointer[string]
	onRefuse func()
	// upstreamConns counts the connections the upstream accepted.
	upstreamConns atomic.Int64
}

const (
	fixtureUser  = "bob"
	fixturePod   = "pod-1"
	fixtureToken = "Bearer good"
	// fixtureGateway is the gateway's host and fixtureDomain the
	// SANDBOX_DOMAIN in subdomain mode; gatewayStatus is what the
	// gateway's stand-in routes answer.
	fixtureGateway = "gw.test"
	fixtureDomain  = "sbx.test"
	gatewayStatus  = 299
)

// newFixture starts everything; upstream answers requests that carry the
// current cookie (see dsh), mutate adjusts the proxy's options.
func newFixture(t testing.TB, upstream http.Handler, mutate func(*Options)) *fixture {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ns := natstest.Start(t)
	_, js := natstest.Connect(t, ns.URL())
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	f := &fixture{t: t, js: js, nats: ns, natsURL: ns.URL(), metrics: prometheus.NewRegistry()}
	f.boxes = testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	f.hs = testutil.Open[state.Handshake](t, js, state.BucketHandshakes)
	boxes, err := kv.NewCache(ctx, f.boxes, ">", log)
	if err != nil {
		t.Fatal(err)
	}
	f.boxCache = boxes
	handshakes, err := kv.NewCache(ctx, f.hs, ">", log)
	if err != nil {
		t.Fatal(err)
	}
	f.hsCache = handshakes
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	if f.sealer, err = handshake.NewSealer(key); err != nil {
		t.Fatal(err)
	}

	f.upstream = httptest.NewUnstartedServer(f.dsh(upstream))
	f.upstream.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			f.upstreamConns.Add(1)
		}
	}
	f.upstream.Start()
	t.Cleanup(f.upstream.Close)
	f.rotate("dsh-auth=first")
	f.putBox(state.Sandbox{User: fixtureUser, Phase: state.PhaseReady, PodUID: fixturePod, Address: f.upstream.Listener.Addr().String()})

	o := Options{
		Auth:      bearerOnly{},
		Sandboxes: boxes, Handshakes: handshakes, Publisher: events.NewPublisher(js, "edge-test", log),
		Sealer: f.sealer, Edge: "edge-test", Slots: NewSlots(64),
		WakeTimeout: 5 * time.Second, HandshakeTimeout: 5 * time.Second,
		MaxBody: 1 << 20, WSMaxMessage: 1 << 20,
		BeaconInterval: time.Second, BeaconTTL: 3 * time.Second, ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second, Revalidate: time.Second,
		Log: log, Metrics: f.metrics,
	}
	if mutate != nil {
		mutate(&o)
	}
	f.proxy = New(o)
	go f.proxy.Run(ctx)

	// In subdomain mode (a mutate that sets SandboxDomain) the gateway is
	// fixtureGateway, as the edge refuses * with a sandbox domain.
	public := []string{"*"}
	if o.SandboxDomain != "" {
		public = []string{fixtureGateway}
	}
	clients, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: public, SandboxDomain: o.SandboxDomain})
	if err != nil {
		t.Fatal(err)
	}
	go clients.Run(ctx)
	app := fiber.New(fiber.Config{DisableStartupMessage: true, StreamRequestBody: true, BodyLimit: int(o.MaxBody),
		ReadBufferSize: 16 << 10, CaseSensitive: true, StrictRouting: true})
	app.Server().KeepHijackedConns = true // as the edge's (internal/edge)
	app.Use(clients.Access(o.Log), httpguard.ConsumeBody, httpguard.Recover(log), clients.Middleware, f.proxy.Origins)
	f.proxy.Register(app)
	// Stand-ins for the gateway's own routes, which a sandbox origin must
	// never reach.
	for _, path := range []string{"/", "/login", "/users", "/_/*"} {
		app.All(path, func(c *fiber.Ctx) error { return c.Status(gatewayStatus).SendString("gateway route") })
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = app.Listener(ln) }()
	t.Cleanup(func() { _ = app.ShutdownWithTimeout(time.Second) })
	f.url = "http://" + ln.Addr().String()
	f.seal(strings.TrimPrefix(f.url, "http://"))
	return f
}

var errUnauthorized = web.Refuse(http.StatusUnauthorized, "sign in first")

// bearerOnly admits fixtureToken as bob, for good.
type bearerOnly struct{}

func (bearerOnly) AuthenticateFor(c *fiber.Ctx, _ string) (auth.Identity, error) {
	if c.Get(fiber.HeaderAuthorization) != fixtureToken {
		return auth.Identity{}, errUnauthorized
	}
	return auth.Identity{User: fixtureUser, Method: auth.MethodBearer}, nil
}

func (bearerOnly) Valid(auth.Identity) bool { return true }

// dsh refuses requests without the current cookie, as DSH does.
func (f *fixture) dsh(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Cookie") != *f.cookie.Load() {
			if f.onRefuse != nil {
				f.onRefuse()
			}
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// rotate makes the upstream accept only cookie from now on.
func (f *fixture) rotate(cookie string) { f.cookie.Store(&cookie) }

// putBox writes a sandbox record and waits until the proxy's cache has it.
func (f *fixture) putBox(b state.Sandbox) {
	rev, err := f.boxes.Put(context.Background(), b.User, b)
	if err != nil {
		f.t.Fatal(err)
	}
	cached(f.t, f.boxCache, b.User, rev)
}

// cached waits until c holds key at revision rev or later.
func cached[T any](t testing.TB, c *kv.Cache[T], key string, rev uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, _, err := c.Wait(ctx, key, func(e kv.Entry[T], ok bool) bool { return ok && e.Revision >= rev }); err != nil {
		t.Fatal(err)
	}
}

// seal stores the current cookie as the handshake for host, as lifecycle
// does after a handshake, and returns its revision.
func (f *fixture) seal(host string) uint64 {
	key := state.HandshakeKey(fixtureUser, fixturePod, host)
	rev, err := f.hs.Put(context.Background(), key, state.Handshake{
		User: fixtureUser, PodUID: fixturePod, Host: host, Sealed: f.sealer.Seal([]byte(*f.cookie.Load()), []byte(key)), At: time.Now(),
	})
	if err != nil {
		f.t.Fatal(err)
	}
	cached(f.t, f.hsCache, key, rev)
	return rev
}

// do sends one request to the edge as bob (the token), with extra header
// pairs.
func (f *fixture) do(method, path string, body io.Reader, header ...string) *http.Response {
	f.t.Helper()
	req, err := http.NewRequest(method, f.url+path, body)
	if err != nil {
		f.t.Fatal(err)
	}
	req.Header.Set("Authorization", fixtureToken)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { resp.Body.Close() })
	return resp
}
