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
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Authenticator is what the proxy needs of authentication
// (auth.Authenticator): who a request for a user's sandbox is, and
// whether that still holds. An error with an HTTPStatus() int method
// answers with that status, any other with 401.
type Authenticator interface {
	AuthenticateFor(c *fiber.Ctx, user string) (auth.Identity, error)
	Valid(id auth.Identity) bool
}

// ValidUser reports whether a path segment can be an account name.
type ValidUser func(string) bool

// Options wires a Proxy.
type Options struct {
	Auth       Authenticator
	ValidUser  ValidUser
	Sandboxes  *kv.Cache[state.Sandbox]
	Handshakes *kv.Cache[state.Handshake]
	// Queue shows a user whose wake waits for a place their position.
	Queue     capacity.Queue
	Publisher *events.Publisher
	Sealer    *handshake.Sealer
	Edge      string

	// Slots is the per-user in-flight cap, shared with the status streams.
	Slots            *Slots
	WakeTimeout      time.Duration
	HandshakeTimeout time.Duration
	MaxBody          int64
	WSMaxMessage     int64
	HeaderAllowlist  []string
	// IdentityHeaders are the SSO headers, never forwarded to DSH.
	IdentityHeaders []string
	// BeaconInterval and BeaconTTL are the activity beacons' period while
	// busy and how long each is trusted.
	BeaconInterval, BeaconTTL time.Duration
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
	o          Options
	m          *metrics
	headers    headerPolicy
	resolver   *Resolver
	upstream   *upstream
	dialer     *websocket.Dialer
	tracker    *tracker
	departures departures
	draining   atomic.Bool
	live       live
}

// New returns a Proxy; Run must be running for beacons to go out, for
// clients that leave to cancel their requests, and for revoked credentials
// to end long-lived exchanges.
func New(o Options) *Proxy {
	m := newMetrics(o.Metrics)
	up := newUpstream()
	return &Proxy{
		o:       o,
		m:       m,
		headers: newHeaderPolicy(o.HeaderAllowlist, o.IdentityHeaders),
		resolver: &Resolver{
			Sandboxes: o.Sandboxes, Queue: o.Queue, Handshakes: o.Handshakes, Commands: o.Publisher, Sealer: o.Sealer,
			WakeTimeout: o.WakeTimeout, HandshakeTimeout: o.HandshakeTimeout, m: m,
		},
		upstream: up,
		dialer: &websocket.Dialer{
			NetDialContext: up.dialer.DialContext, HandshakeTimeout: 10 * time.Second,
			ReadBufferSize: wsReadBufferSize, WriteBufferSize: wsWriteBufferSize, WriteBufferPool: wsWriteBuffers,
		},
		tracker:    newTracker(o.Publisher, o.Edge, o.BeaconInterval, o.BeaconTTL, o.Log),
		departures: departures{m: map[*request]net.Conn{}},
		live:       live{m: map[*exchange]struct{}{}},
	}
}

// Register mounts the proxy routes.
func (p *Proxy) Register(app *fiber.App) {
	app.All("/u/*", p.serve)
}

// Run publishes activity beacons, cancels the requests of clients that
// left and re-checks the credentials of long-lived exchanges until ctx
// ends.
func (p *Proxy) Run(ctx context.Context) {
	go p.revalidate(ctx, p.o.Revalidate)
	go p.departures.run(ctx)
	p.tracker.run(ctx)
	p.upstream.closeIdle()
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

// serve is the route: everything that decides whether a request may go to
// a sandbox at all, then HTTP or WebSocket. Refusals take one error path
// (fail, or close codes for WebSockets).
func (p *Proxy) serve(c *fiber.Ctx) error {
	rid := requestID(c)
	user, rest, ok := splitUserPath(string(c.Request().URI().PathOriginal()))
	if !ok || !p.o.ValidUser(user) {
		return p.refuse(c, rid, false, errNoSandbox)
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
	ws := websocket.FastHTTPIsWebSocketUpgrade(c.Context())
	// A request that still reaches a draining edge (on a front's pooled
	// connection, or before the endpoint list catches up) is served, and
	// its connection closed so the next request goes elsewhere: a 503 here
	// would reach the browser, as fronts do not retry on it. A new
	// WebSocket would be cut at once, so it is told to go away (1001) and
	// reconnects through another edge.
	if p.draining.Load() {
		c.Context().SetConnectionClose()
		if ws {
			return p.refuse(c, rid, ws, errDraining)
		}
	}
	id, err := p.o.Auth.AuthenticateFor(c, user)
	switch {
	case err != nil:
		return p.refuse(c, rid, ws, authFailed(err))
	case id.User != user:
		return p.refuse(c, rid, ws, errNotYours)
	// Credentials the browser attaches by itself (the session cookie, the
	// SSO proxy's header) must not let another site drive the agent: a
	// state-changing request, or any WebSocket that names an origin, needs
	// our own origin. Bearer tokens are sent on purpose and need none.
	case id.Ambient() && ws && c.Get(fiber.HeaderOrigin) != "" && !httpguard.SameOrigin(c),
		id.Ambient() && !ws && !safeMethod(c.Method()) && !httpguard.SameOrigin(c):
		return p.refuse(c, rid, ws, errCrossSite)
	}
	if !p.o.Slots.Acquire(user) {
		c.Set(fiber.HeaderRetryAfter, "1")
		return p.refuse(c, rid, ws, errBusy)
	}
	r := p.begin(c, rid, user, rest, id)
	if ws {
		return p.serveWebSocket(r)
	}
	return p.serveHTTP(r)
}

// refuse counts and answers a request refused before it took a slot.
func (p *Proxy) refuse(c *fiber.Ctx, rid string, ws bool, err *proxyError) error {
	if ws {
		p.m.count(fiber.StatusSwitchingProtocols)
		return p.closeAtOnce(c, closeCode(err), err.Detail)
	}
	p.m.count(p.fail(c, rid, err))
	return nil
}

// fail is the one error path of proxied HTTP requests: err becomes the
// status and the page or problem document the browser gets; causes the
// browser must not see are logged with the request id it does see. It
// returns the status.
func (p *Proxy) fail(c *fiber.Ctx, rid string, err error) int {
	var starting *sandboxStarting
	if errors.As(err, &starting) {
		c.Status(fiber.StatusServiceUnavailable)
		c.Set(fiber.HeaderRetryAfter, "2")
		c.Set(fiber.HeaderCacheControl, "no-store")
		c.Type("html")
		_ = web.RenderStarting(c, web.Starting{User: starting.User, Phase: string(starting.Phase), Reason: starting.Reason})
		return fiber.StatusServiceUnavailable
	}
	pe := asProxyError(err)
	switch {
	case pe.Status == statusClientClosed:
		p.o.Log.Info("client closed request", "request_id", rid, "method", c.Method(), "status", statusClientClosed)
		c.Status(statusClientClosed)
		return statusClientClosed
	case pe.Err != nil && pe.Status >= 500:
		p.o.Log.Warn("proxy error", "request_id", rid, "status", pe.Status, "err", pe.Err)
	}
	// Every refusal for want of a sandbox or a control plane is worth
	// retrying shortly, and says so.
	if pe.Status == fiber.StatusServiceUnavailable && len(c.Response().Header.Peek(fiber.HeaderRetryAfter)) == 0 {
		c.Set(fiber.HeaderRetryAfter, "2")
	}
	detail := pe.Detail
	if pe.Status >= 500 {
		detail += " (request " + rid + ")"
	}
	_ = web.WriteProblem(c, web.Problem{Status: pe.Status, Title: pe.Title, Detail: detail, SignIn: pe.Status == fiber.StatusUnauthorized})
	return pe.Status
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
