// Package proxy is the edge's hot path: it streams HTTP, SSE and WebSocket
// traffic to each user's DSH pod (on the user's own origin,
// <user>.<SANDBOX_DOMAIN>, or in path mode under /u/<user>/ on the
// gateway's), wakes sleeping
// sandboxes on connect, performs the DSH handshake through lifecycle,
// enforces the per-user limits, and reports activity. A request for a Ready
// sandbox with a cached handshake costs no NATS round trip.
package proxy

import (
	"context"
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/gofiber/fiber/v2/utils"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Authenticator is what the proxy needs of authentication
// (auth.Authenticator): who a request for a user's sandbox is, and
// whether that still holds. Its errors are *web.Error (401, 403, 503).
type Authenticator interface {
	AuthenticateFor(c *fiber.Ctx, user string) (auth.Identity, error)
	Valid(id auth.Identity) bool
}

// Options wires a Proxy.
type Options struct {
	Auth Authenticator
	// SandboxDomain is SANDBOX_DOMAIN (canonical): set, sandboxes are
	// served on their own origins only (Origins) and the gateway's /u/
	// paths redirect there; empty, they are served under /u/<user>/.
	SandboxDomain string
	// SignIn serves auth.SandboxSignInPath on sandbox origins: the one
	// path of a sandbox origin the edge answers itself. Gateway is the
	// gateway's host (the first of PUBLIC_HOSTS), where a browser on a
	// sandbox origin without a session is sent to sign in.
	SignIn     fiber.Handler
	Gateway    string
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
	// MaxStaleness is ROUTE_MAX_STALENESS (0: no bound, for tests).
	MaxStaleness    time.Duration
	MaxBody         int64
	WSMaxMessage    int64
	HeaderAllowlist []string
	// IdentityHeaders are the SSO headers, never forwarded to DSH.
	IdentityHeaders []string
	// PreviewPorts is PREVIEW_PORTS, sorted: the ports a preview host may
	// name. PreviewUsers (PREVIEW_ACCESS=users) opens previews to every
	// signed-in user; otherwise only the sandbox's owner is admitted.
	PreviewPorts []int
	PreviewUsers bool
	// BeaconInterval and BeaconTTL are the activity beacons' period while
	// busy and how long each is trusted.
	BeaconInterval, BeaconTTL time.Duration
	// IdleConnected is IDLE_CONNECTED_TIMEOUT: a stream without browser
	// input this long stops counting as activity.
	IdleConnected time.Duration
	// ReadTimeout bounds how long a request body may stall; WriteTimeout
	// how long one write to the browser may block (both per chunk, so
	// long streams are fine). Revalidate is how often long-lived exchanges
	// re-check their credentials.
	ReadTimeout  time.Duration
	WriteTimeout time.Duration
	Revalidate   time.Duration
	// Changes names the users whose sessions or accounts changed: their
	// exchanges are re-checked at once.
	Changes *Changes
	Log     *slog.Logger
	Metrics prometheus.Registerer
}

// Proxy serves /u/<user>/**.
type Proxy struct {
	o         Options
	m         *metrics
	headers   headerPolicy
	resolver  *Resolver
	transport transport
	dialer    *websocket.Dialer
	tracker   *tracker
	draining  atomic.Bool
	live      live
}

// New returns a Proxy; Run must be running for beacons to go out and for
// revoked credentials to end long-lived exchanges (and the httpguard
// Policy's Run for clients that leave to cancel their requests).
func New(o Options) *Proxy {
	m := newMetrics(o.Metrics)
	registerStateAge(o.Metrics, o.Sandboxes.Current)
	up := newUpstream()
	return &Proxy{
		o:       o,
		m:       m,
		headers: newHeaderPolicy(o.HeaderAllowlist, o.IdentityHeaders),
		resolver: &Resolver{
			Sandboxes: o.Sandboxes, Queue: o.Queue, Handshakes: o.Handshakes, Commands: o.Publisher, Sealer: o.Sealer,
			WakeTimeout: o.WakeTimeout, HandshakeTimeout: o.HandshakeTimeout, MaxStaleness: o.MaxStaleness, m: m,
		},
		transport: up,
		dialer: &websocket.Dialer{
			NetDialContext: up.dialer.DialContext, HandshakeTimeout: 10 * time.Second,
			ReadBufferSize: wsReadBufferSize, WriteBufferSize: wsWriteBufferSize, WriteBufferPool: wsWriteBuffers,
		},
		tracker: newTracker(o.Publisher, o.Edge, o.BeaconInterval, o.BeaconTTL, o.IdleConnected, o.Log),
	}
}

// Register mounts the proxy's gateway routes: in path mode the sandboxes
// under /u/<user>/, in subdomain mode the redirects from there to each
// user's origin, so old links and bookmarks keep working and no tenant
// byte is served on the gateway's origin. Each of before runs ahead of
// them and may answer instead (the admin hosts' refusal of /u/).
func (p *Proxy) Register(app *fiber.App, before ...fiber.Handler) {
	if p.o.SandboxDomain != "" {
		app.All("/u/*", append(before, p.toOrigin)...)
		return
	}
	app.All("/u/*", append(before, p.serve)...)
}

// Origins is the middleware that serves sandbox origins, placed after
// httpguard's: a request to a host below SANDBOX_DOMAIN never reaches a
// gateway route (its /_/…, /login, /users, the landing page). The edge
// answers auth.SandboxSignInPath there; every other path goes, whole and as it
// arrived, to the sandbox of the user the host names: the user comes from
// the host alone. A host that names no one gets the 404 page and nothing
// is proxied. Other requests pass to the gateway's routes.
func (p *Proxy) Origins(c *fiber.Ctx) error {
	info := httpguard.Get(c)
	if !info.OnSandboxDomain {
		return c.Next()
	}
	raw := pathOf(c)
	if raw == auth.SandboxSignInPath && p.o.SignIn != nil {
		return p.o.SignIn(c)
	}
	ws := websocket.FastHTTPIsWebSocketUpgrade(c.Context())
	if info.Sandbox == "" || !strings.HasPrefix(raw, "/") {
		return p.refuse(c, ws, errNoSandbox)
	}
	if info.PreviewPort != 0 {
		return p.servePreview(c, info.Sandbox, raw, info.PreviewPort, ws)
	}
	return p.serveUser(c, info.Sandbox, raw, 0, ws)
}

// toOrigin answers the gateway's /u/<user>/<rest>?<query> in subdomain
// mode: a permanent redirect to <scheme>://<user>.<SANDBOX_DOMAIN>/<rest>
// with the query kept (301 for GET and HEAD, 308, which keeps the method
// and body, otherwise). The user is read as in path mode, so a path a
// browser reads under another user's prefix is refused, not redirected.
func (p *Proxy) toOrigin(c *fiber.Ctx) error {
	user, rest, ok := splitUserPath(string(c.Request().URI().PathOriginal()))
	if !ok || !ident.ValidSandboxKey(user) {
		return p.refuse(c, false, errNoSandbox)
	}
	if rest == "" {
		rest = "/"
	}
	loc := httpguard.Scheme(c) + "://" + httpguard.SandboxHost(user, 0, p.o.SandboxDomain) + rest
	if q := c.Request().URI().QueryString(); len(q) > 0 {
		loc += "?" + string(q)
	}
	return c.Redirect(loc, permanentRedirect(c.Method()))
}

// signInFirst: a top-level navigation (GET or HEAD of a page) to a
// sandbox origin refused for want of credentials is sent to sign in
// rather than shown a 401; everything else gets the 401 as it would.
func (p *Proxy) signInFirst(c *fiber.Ctx, pe *web.Error) bool {
	return pe.Status == fiber.StatusUnauthorized && p.o.Gateway != "" && httpguard.Get(c).OnSandboxDomain &&
		(c.Method() == fiber.MethodGet || c.Method() == fiber.MethodHead) && web.WantsHTML(c)
}

// toSignIn sends the browser to the gateway's auth.SandboxMintPath with
// the URL it asked for, which mints a sign-in code for this origin and
// sends it back (303).
func (p *Proxy) toSignIn(c *fiber.Ctx) error {
	scheme := httpguard.Scheme(c)
	next := scheme + "://" + httpguard.Host(c) + string(c.Request().URI().PathOriginal())
	if q := c.Request().URI().QueryString(); len(q) > 0 {
		next += "?" + string(q)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.Redirect(scheme+"://"+p.o.Gateway+auth.SandboxMintPath+"?next="+url.QueryEscape(next), fiber.StatusSeeOther)
}

// permanentRedirect is 301 for GET and HEAD, 308 (method and body kept)
// for the rest.
func permanentRedirect(method string) int {
	if method != fiber.MethodGet && method != fiber.MethodHead {
		return fiber.StatusPermanentRedirect
	}
	return fiber.StatusMovedPermanently
}

// Run publishes activity beacons, cancels the requests of clients that
// left and re-checks the credentials of long-lived exchanges until ctx
// ends.
func (p *Proxy) Run(ctx context.Context) {
	go p.revalidate(ctx, p.o.Revalidate)
	p.tracker.run(ctx)
	p.transport.CloseIdle()
}

// Drain stops taking new proxied requests and closes every WebSocket with
// 1001 (going away) so browsers reconnect through another edge.
func (p *Proxy) Drain() {
	p.draining.Store(true)
	for _, x := range p.live.of(nil, true) {
		if x.ws != nil {
			closeWith(x.ws, websocket.CloseGoingAway, "edge shutting down")
		}
	}
}

// splitUserPath takes /u/<user>/<rest> apart on the raw path, exactly as
// it arrived: the user that is authorised is the user whose pod gets the
// request, and the rest is forwarded unchanged, so no encoding trick can
// move a request from one user's prefix to another's pod. A path that a
// browser reads under another prefix ("/u/alice/../bob/", with "%2e" or
// backslashes too) is refused: browsers resolve dot segments before they
// send a path, so only a crafted request has one that climbs out.
func splitUserPath(raw string) (user, rest string, ok bool) {
	tail, ok := strings.CutPrefix(raw, "/u/")
	if !ok {
		return "", "", false
	}
	user, _, found := strings.Cut(tail, "/")
	if readUser(raw) != user {
		return "", "", false
	}
	if !found {
		return user, "", true
	}
	return user, tail[len(user):], true
}

// pathOf is the request's path as it arrived, a view of fasthttp's bytes
// (as Fiber's own strings are): valid while the handler runs and its
// answer is written, and copied by whatever keeps it longer.
func pathOf(c *fiber.Ctx) string {
	return utils.UnsafeString(c.Request().URI().PathOriginal())
}

// readUser is the user segment of path as browsers read it (WHATWG URL:
// tabs and newlines dropped, backslashes as slashes, dot segments in any
// percent-encoding resolved), the reading redirects are judged by too.
func readUser(path string) string {
	p := removeDots(strings.ReplaceAll(cleanURL(path), `\`, "/"))
	tail, ok := strings.CutPrefix(p, "/u/")
	if !ok {
		return ""
	}
	user, _, _ := strings.Cut(tail, "/")
	return user
}

// serve is the /u/<user>/ route: the user and the rest of the path, and
// the redirect of the bare prefix.
func (p *Proxy) serve(c *fiber.Ctx) error {
	user, rest, ok := splitUserPath(pathOf(c))
	if !ok || !ident.ValidSandboxKey(user) {
		return p.refuse(c, false, errNoSandbox)
	}
	if rest == "" {
		loc := "/u/" + user + "/"
		if q := c.Request().URI().QueryString(); len(q) > 0 {
			loc += "?" + string(q)
		}
		return c.Redirect(loc, permanentRedirect(c.Method()))
	}
	return p.serveUser(c, user, rest, 0, websocket.FastHTTPIsWebSocketUpgrade(c.Context()))
}

// serveUser takes a request for user's sandbox (rest: the path the
// upstream gets) from authentication to HTTP or WebSocket, wherever it
// arrived: to DSH, or with port set to that port's preview. Refusals take
// one error path (fail, or close codes for WebSockets).
func (p *Proxy) serveUser(c *fiber.Ctx, user, rest string, port int, ws bool) error {
	// A request that still reaches a draining edge (on a front's pooled
	// connection, or before the endpoint list catches up) is served, and
	// its connection closed so the next request goes elsewhere: a 503 here
	// would reach the browser, as fronts do not retry on it. A new
	// WebSocket would be cut at once, so it is told to go away (1001) and
	// reconnects through another edge.
	if p.draining.Load() {
		c.Context().SetConnectionClose()
		if ws {
			return p.refuse(c, ws, errDraining)
		}
	}
	// user is the sandbox's key (ident.SandboxKey): its owner's account
	// name, or "<owner>--<name>" for a named sandbox.
	owner := ident.OwnerOf(user)
	id, err := p.o.Auth.AuthenticateFor(c, owner)
	switch {
	case err != nil && !ws && p.signInFirst(c, web.AsError(err)):
		return p.toSignIn(c)
	case err != nil:
		return p.refuse(c, ws, web.AsError(err))
	case id.User != owner && port != 0 && !p.o.PreviewUsers:
		return p.refuse(c, ws, errNotYourPreview)
	case id.User != owner && port != 0 && !p.resolver.Exists(httpguard.Context(c), user):
		// Another user's preview of a sandbox there is not: no wait for it.
		return p.refuse(c, ws, errNoSandbox)
	case id.User != owner && port == 0:
		return p.refuse(c, ws, errNotYours)
	// Credentials the browser attaches by itself (the session cookie, the
	// SSO proxy's header) must not let another site drive the agent: a
	// state-changing request, or any WebSocket that names an origin, needs
	// our own origin. Bearer tokens are sent on purpose and need none.
	case id.Ambient() && ws && c.Get(fiber.HeaderOrigin) != "" && !httpguard.SameOrigin(c),
		id.Ambient() && !ws && !safeMethod(c.Method()) && !httpguard.SameOrigin(c):
		return p.refuse(c, ws, errCrossSite)
	}
	// user and rest are views of the request's bytes (pathOf): what
	// outlives the handler (the slots' map, a stream's end, a WebSocket)
	// takes the identity's own string for the user, or copies.
	if id.User == user {
		user = id.User
	} else {
		user = strings.Clone(user)
	}
	if ws {
		rest = strings.Clone(rest)
	}
	if !p.o.Slots.Acquire(user) {
		c.Set(fiber.HeaderRetryAfter, "1")
		return p.refuse(c, ws, errBusy)
	}
	r := p.begin(c, user, rest, id)
	r.port = port
	if ws {
		return p.serveWebSocket(r)
	}
	return p.serveHTTP(r)
}

// refuse counts and answers a request refused before it took a slot.
func (p *Proxy) refuse(c *fiber.Ctx, ws bool, err *web.Error) error {
	if ws {
		p.m.count(fiber.StatusSwitchingProtocols, sourceGateway)
		return p.closeAtOnce(c, closeCode(err), err.Detail)
	}
	status := p.fail(c, err)
	p.m.count(status, sourceOf(status, true))
	return nil
}

// fail is the one error path of proxied HTTP requests: err becomes the
// status and the page or problem document the browser gets; causes the
// browser must not see are logged with the request id it does see. It
// returns the status.
func (p *Proxy) fail(c *fiber.Ctx, err error) int {
	var starting *sandboxStarting
	if errors.As(err, &starting) {
		c.Status(fiber.StatusServiceUnavailable)
		c.Set(fiber.HeaderRetryAfter, "2")
		c.Set(fiber.HeaderCacheControl, "no-store")
		c.Type("html")
		_ = web.RenderStarting(c, web.Starting{User: starting.User, Phase: string(starting.Phase), Reason: starting.Reason,
			Slept: web.Slept(starting.Slept), Reload: httpguard.Get(c).OnSandboxDomain})
		return fiber.StatusServiceUnavailable
	}
	pe := asProxyError(err)
	_ = web.Fail(c, pe)
	return pe.Status
}
