// Package proxy is the edge's hot path: it streams HTTP, SSE and WebSocket
// traffic under /u/<user>/ to that user's DSH pod, wakes sleeping
// sandboxes on connect, performs the DSH handshake through lifecycle,
// enforces the per-user limits, and reports activity. A request for a Ready
// sandbox with a cached handshake costs no NATS round trip.
package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/web"
)

// Identity is who a request authenticated as.
type Identity struct {
	User string
	// Ambient is true for credentials a browser attaches by itself (the
	// session cookie, an SSO header), which need same-origin checks.
	Ambient bool
	// Valid reports whether the credentials still hold; WebSockets and
	// streamed responses end when it turns false. nil means always.
	Valid func() bool
}

// Authenticator resolves a request's identity. An error with an
// HTTPStatus() int method answers with that status, any other with 401.
type Authenticator func(*fiber.Ctx) (Identity, error)

// ValidUser reports whether a path segment can be an account name.
type ValidUser func(string) bool

// Options wires a Proxy.
type Options struct {
	Authenticate Authenticator
	ValidUser    ValidUser
	Sandboxes    *kv.Cache[kv.Sandbox]
	Handshakes   *kv.Cache[kv.Handshake]
	Publisher    *events.Publisher
	Sealer       *handshake.Sealer
	Edge         string

	// Slots is the per-user in-flight cap, shared with the status streams.
	Slots            *Slots
	WakeTimeout      time.Duration
	HandshakeTimeout time.Duration
	MaxBody          int64
	WSMaxMessage     int64
	HeaderAllowlist  []string
	// IdentityHeaders are the SSO headers, never forwarded to DSH.
	IdentityHeaders []string
	BeaconInterval  time.Duration
	// ReadTimeout bounds how long a request body may stall; WriteTimeout
	// how long one write to the browser may block (both per chunk, so
	// long streams are fine). Revalidate is how often long-lived exchanges
	// re-check their credentials.
	ReadTimeout  time.Duration
	WriteTimeout time.Duration
	Revalidate   time.Duration
	// Changes signals a change to sessions or accounts: a moment to
	// re-check at once.
	Changes <-chan struct{}
	Log     *slog.Logger
	Metrics prometheus.Registerer
}

// Proxy serves /u/<user>/**.
type Proxy struct {
	o         Options
	m         *metrics
	headers   headerPolicy
	transport *http.Transport
	dialer    *websocket.Dialer
	tracker   *tracker
	draining  atomic.Bool
	live      live
}

// New returns a Proxy; Run must be running for beacons to go out and for
// revoked credentials to end long-lived exchanges.
func New(o Options) *Proxy {
	dialer := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	return &Proxy{
		o:       o,
		m:       newMetrics(o.Metrics),
		headers: newHeaderPolicy(o.HeaderAllowlist, o.IdentityHeaders),
		transport: &http.Transport{
			DialContext:           dialer.DialContext,
			MaxIdleConns:          4096,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			ExpectContinueTimeout: time.Second,
			// Bodies pass through as DSH encoded them.
			DisableCompression: true,
			WriteBufferSize:    32 << 10,
			ReadBufferSize:     32 << 10,
		},
		dialer: &websocket.Dialer{
			NetDialContext: dialer.DialContext, HandshakeTimeout: 10 * time.Second,
			ReadBufferSize: 32 << 10, WriteBufferSize: 32 << 10,
		},
		tracker: newTracker(o.Publisher, o.Edge, o.BeaconInterval, o.Log),
		live:    live{m: map[*exchange]struct{}{}},
	}
}

// Register mounts the proxy routes.
func (p *Proxy) Register(app *fiber.App) {
	app.All("/u/*", p.serve)
}

// Run publishes activity beacons and re-checks the credentials of
// long-lived exchanges until ctx ends.
func (p *Proxy) Run(ctx context.Context) {
	go p.revalidate(ctx, p.o.Revalidate)
	p.tracker.run(ctx)
}

// Drain stops taking new proxied requests and closes every WebSocket with
// 1001 (going away) so browsers reconnect through another edge.
func (p *Proxy) Drain() {
	p.draining.Store(true)
	for _, x := range p.live.snapshot() {
		if x.ws != nil {
			closeWith(x.ws, websocket.CloseGoingAway, "edge shutting down")
		}
	}
}

// authenticate resolves the request's identity, or the status to refuse it
// with.
func (p *Proxy) authenticate(c *fiber.Ctx) (Identity, int, error) {
	id, err := p.o.Authenticate(c)
	if err != nil {
		status := fiber.StatusUnauthorized
		var s interface{ HTTPStatus() int }
		if errors.As(err, &s) {
			status = s.HTTPStatus()
		}
		return id, status, err
	}
	return id, 0, nil
}

// splitUserPath takes /u/<user>/<rest> apart on the raw path, exactly as
// it arrived: the user that is authorised is the user whose pod gets the
// request, and the rest is forwarded unchanged, so no encoding trick can
// move a request from one user's prefix to another's pod.
func splitUserPath(raw string) (user, rest string, ok bool) {
	tail, ok := strings.CutPrefix(raw, "/u/")
	if !ok {
		return "", "", false
	}
	user, rest, found := strings.Cut(tail, "/")
	if !found {
		return user, "", true
	}
	return user, "/" + rest, true
}

func (p *Proxy) serve(c *fiber.Ctx) error {
	user, rest, ok := splitUserPath(string(c.Request().URI().PathOriginal()))
	if !ok || !p.o.ValidUser(user) {
		return p.reject(c, fiber.StatusNotFound, "No such sandbox", "There is no sandbox at this address.")
	}
	if rest == "" {
		loc := "/u/" + user + "/"
		if q := c.Request().URI().QueryString(); len(q) > 0 {
			loc += "?" + string(q)
		}
		code := fiber.StatusMovedPermanently
		if c.Method() != fiber.MethodGet && c.Method() != fiber.MethodHead {
			code = fiber.StatusPermanentRedirect
		}
		return c.Redirect(loc, code)
	}
	if p.draining.Load() {
		c.Set(fiber.HeaderConnection, "close")
		c.Set(fiber.HeaderRetryAfter, "1")
		return p.reject(c, fiber.StatusServiceUnavailable, "Edge shutting down", "This gateway replica is shutting down; retry.")
	}
	if websocket.FastHTTPIsWebSocketUpgrade(c.Context()) {
		return p.serveWebSocket(c, user, rest)
	}
	return p.serveHTTP(c, user, rest)
}

// reject counts a request refused before it took a slot and answers it.
func (p *Proxy) reject(c *fiber.Ctx, status int, title, detail string) error {
	p.m.requests.WithLabelValues(class(status)).Inc()
	return p.problem(c, status, title, detail)
}

// problem answers an error as JSON for API clients and as a page for
// browsers.
func (p *Proxy) problem(c *fiber.Ctx, status int, title, detail string) error {
	c.Status(status)
	c.Set(fiber.HeaderCacheControl, "no-store")
	if !strings.Contains(c.Get(fiber.HeaderAccept), "text/html") {
		return c.JSON(fiber.Map{"error": detail})
	}
	c.Type("html")
	return web.RenderProblem(c, web.Problem{Status: status, Title: title, Detail: detail, SignIn: status == fiber.StatusUnauthorized})
}

// requestIDs are a random per-process prefix and a counter: unique across
// replicas without a random draw per request.
var (
	requestPrefix = func() string {
		b := make([]byte, 4)
		_, _ = rand.Read(b)
		return hex.EncodeToString(b) + "-"
	}()
	requestCounter atomic.Uint64
)

// requestID names a request in logs and in the response.
func requestID(c *fiber.Ctx) string {
	id := requestPrefix + strconv.FormatUint(requestCounter.Add(1), 10)
	c.Set("X-Request-Id", id)
	return id
}

var errClientGone = errors.New("client closed the request")
