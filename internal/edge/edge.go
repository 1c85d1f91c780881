// Package edge builds the edge process from its configuration: the
// caches it reads, authentication, the account, admin and proxy services,
// and the one Fiber app that serves them behind the rules every route
// shares. It only wires; what each part does is in its own package.
package edge

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync/atomic"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/accounts"
	"github.com/aaas-project/aaas/internal/admin"
	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/proxy"
	"github.com/aaas-project/aaas/internal/web"
)

// Edge is one edge replica, wired and not yet serving.
type Edge struct {
	p        *process.Process
	cfg      config.Edge
	app      *fiber.App
	proxy    *proxy.Proxy
	clients  *httpguard.Policy
	authn    *auth.Authenticator
	ready    func() bool
	draining atomic.Bool
}

// New builds the edge of p from cfg: it opens the buckets and caches it
// reads (waiting for nothing but their first sync) and registers every
// route.
func New(p *process.Process, cfg config.Edge) (*Edge, error) {
	ctx := p.Ctx
	sealer, err := handshake.NewSealer(cfg.HandshakeKeys...)
	if err != nil {
		return nil, err
	}
	st, err := openState(ctx, p, cfg)
	if err != nil {
		return nil, err
	}
	clients, err := httpguard.NewPolicy(httpguard.Options{
		TrustedProxies: cfg.TrustedProxies, PublicHosts: append(slices.Clone(cfg.PublicHosts), cfg.AdminHosts...), Unchecked: []string{"/healthz", "/readyz"},
		SandboxDomain: cfg.SandboxDomain,
	})
	if err != nil {
		return nil, err
	}
	pub := events.NewPublisher(p.JS, cfg.InstanceID, p.Log)
	authn, sso := newAuthenticator(p, cfg, st, pub)
	// The admin view and the user's page show the idle rule's view of the
	// activity stream, read when shown.
	clocks := &idle.Views{NC: p.NC}
	slots := proxy.NewSlots(cfg.MaxInFlightPerUser)
	acct := newAccounts(p, cfg, st, authn, pub, sso, slots, clocks)
	prx := newProxy(p, cfg, st, authn, pub, sealer, sso, slots)
	adm := admin.New(admin.Options{
		Auth: authn, Accounts: acct, Users: st.users, Sandboxes: st.boxes, Names: st.names, Activity: clocks, Publisher: pub, Log: p.Log,
		Hosts: cfg.AdminHosts, PublicHosts: cfg.PublicHosts, SandboxDomain: cfg.SandboxDomain,
		Spend: st.book, Budgets: st.budgets, JS: p.JS, Idle: cfg.Idle, Profiles: cfg.Profiles, Rollouts: st.rollouts,
	})
	e := &Edge{p: p, cfg: cfg, proxy: prx, clients: clients, authn: authn}
	e.ready = func() bool {
		return !e.draining.Load() && acct.Ready() && st.handshakes.IsSynced() && st.queued.IsSynced()
	}
	e.app = newApp(cfg)
	// One set of rules for every route, outermost first (the request's id
	// and access line around everything); then a request to a sandbox
	// origin goes to the proxy and never reaches a gateway route.
	e.app.Use(clients.Access(p.Log), httpguard.ConsumeBody, httpguard.Recover(p.Log), httpguard.Methods, httpguard.Pages, clients.Middleware, httpguard.HSTS(cfg.HSTSMaxAge), prx.Origins)
	e.app.Get("/healthz", health(func() bool { return true }))
	e.app.Get("/readyz", health(e.ready))
	if cfg.SandboxDomain != "" {
		e.app.Get(auth.SandboxMintPath, authn.MintSandboxCode)
	}
	acct.Register(e.app)
	adm.Register(e.app)
	prx.Register(e.app, adm.NoSandboxes)
	return e, nil
}

// Serve listens on LISTEN_ADDR until p's context ends, then drains:
// readiness off, sockets told to reconnect elsewhere, requests in flight
// finished up to SHUTDOWN_TIMEOUT.
func (e *Edge) Serve() error {
	go e.proxy.Run(e.p.Ctx)
	go e.clients.Run(e.p.Ctx)
	ln, err := net.Listen("tcp", e.cfg.ListenAddr)
	if err != nil {
		return err
	}
	// Ready only once the socket is open: earlier, a probe (or a test) could
	// route a client here and get "connection refused".
	e.p.SetReady(e.ready)
	e.p.Log.Info("serving", "addr", ln.Addr().String(), "cookie", e.authn.CookieName())
	served := make(chan error, 1)
	go func() { served <- e.app.Listener(ln) }()
	select {
	case err := <-served:
		return err
	case <-e.p.Ctx.Done():
	}
	e.draining.Store(true)
	e.proxy.Drain()
	if err := e.app.ShutdownWithTimeout(e.cfg.ShutdownTimeout); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		e.p.Log.Warn("shutdown", "err", err)
	}
	e.p.Log.Info("drained")
	return nil
}

func newApp(cfg config.Edge) *fiber.App {
	app := fiber.New(fiber.Config{
		AppName:                      "aaas-edge",
		DisableStartupMessage:        true,
		StreamRequestBody:            true,
		DisablePreParseMultipartForm: true,
		BodyLimit:                    int(cfg.MaxBodyBytes),
		// Headers must arrive within ReadTimeout and each response write
		// finish within WriteTimeout; bodies and streams renew those
		// deadlines per chunk (proxy, status streams), and WebSockets are
		// free of them once upgraded, so long transfers are not cut off.
		ReadTimeout:    cfg.ReadTimeout,
		WriteTimeout:   cfg.WriteTimeout,
		IdleTimeout:    cfg.IdleTimeout,
		ReadBufferSize: 16 << 10,
		CaseSensitive:  true,
		StrictRouting:  true,
		ErrorHandler:   web.Fail,
	})
	// A proxied WebSocket outlives the handler that hijacked it, so that
	// fasthttp drops its request reader (proxy.upgrade); whoever hijacks
	// closes the connection.
	app.Server().KeepHijackedConns = true
	return app
}

func health(ok func() bool) fiber.Handler {
	return func(c *fiber.Ctx) error {
		if ok() {
			return c.SendString("ok\n")
		}
		return c.Status(fiber.StatusServiceUnavailable).SendString("not ready\n")
	}
}

// newAuthenticator is the edge's authentication: sessions, bearer and API
// tokens, SSO when AUTH_PROXY_HEADER is set, and sandbox origins' sign-in.
func newAuthenticator(p *process.Process, cfg config.Edge, st *edgeState, pub *events.Publisher) (*auth.Authenticator, auth.SSO) {
	sso := auth.SSO{}
	if cfg.AuthProxyHeader != "" {
		sso = auth.SSO{NameHeader: cfg.AuthProxyHeader, IDHeader: cfg.AuthProxyIDHeader, GroupsHeader: cfg.AuthProxyGroupsHeader, Allow: cfg.AuthProxyAllow}
	}
	origins := auth.Origins{Domain: cfg.SandboxDomain, CodeTTL: cfg.Buckets.SigninCodeTTL, CookieName: auth.SandboxCookie(cfg.CookieSecure), Secure: cfg.CookieSecure,
		Codes: st.codes,
		// One's own origins, and with PREVIEW_ACCESS=users any user's
		// listed previews (the proxy admits the same).
		MayOpen: func(id auth.Identity, key string, port int) bool {
			return id.User == ident.OwnerOf(key) || port != 0 && cfg.Preview.Users && cfg.Preview.Allows(port)
		},
	}
	return auth.New(auth.Options{
		Store: st.store, Limiter: st.limiter, Users: st.users, APITokens: st.apiTokens, Publisher: pub, RefusalAuditLimit: cfg.RefusalAuditLimit,
		CookieName: cfg.CookieName, SSO: sso, Admins: cfg.AdminUsers, AdminGroups: cfg.AdminGroups, Metrics: p.Metrics, Origins: origins,
		SeenGroups: st.recorder.Seen,
	}), sso
}

func newAccounts(p *process.Process, cfg config.Edge, st *edgeState, authn *auth.Authenticator, pub *events.Publisher, sso auth.SSO, slots *proxy.Slots, clocks *idle.Views) *accounts.Service {
	var byok *accounts.BYOK
	if st.credentials != nil {
		byok = &accounts.BYOK{Credentials: st.credentials, PublicKey: cfg.CredentialsPublicKey}
		for _, pr := range cfg.Providers {
			byok.Providers = append(byok.Providers, pr.Name)
		}
	}
	return accounts.New(accounts.Options{
		Auth: authn, Actions: st.actions, Publisher: pub, Users: st.users, Names: st.names, Sandboxes: st.boxes, Requests: st.requests, Queue: st.queue,
		APITokens: &accounts.APITokens{Bucket: st.tokensBucket, Cache: st.apiTokens, MaxEach: cfg.MaxAPITokensPerUser},
		Profiles:  cfg.Profiles, MaxSandboxes: cfg.MaxSandboxes,
		InFlight: slots, CookieSecure: cfg.CookieSecure, CookieMaxAge: cfg.Buckets.SessionTTL,
		InviteCode: cfg.InviteCode, MaxUsers: cfg.MaxUsers, SSO: sso.NameHeader != "", SignOutURL: cfg.AuthProxySignOutURL, WakeTimeout: cfg.WakeTimeout,
		WriteTimeout: cfg.WriteTimeout, Revalidate: cfg.Revalidate, Log: p.Log,
		SandboxDomain: cfg.SandboxDomain, AdminHosts: cfg.AdminHosts, PublicHosts: cfg.PublicHosts,
		Spend: st.book, BYOK: byok,
		Activity: clocks, Idle: cfg.Idle, KeepAwake: st.keepAwake, KeepAwakes: st.keepAwakes, MaxKeepAwake: cfg.MaxKeepAwake,
	})
}

func newProxy(p *process.Process, cfg config.Edge, st *edgeState, authn *auth.Authenticator, pub *events.Publisher, sealer *handshake.Sealer, sso auth.SSO, slots *proxy.Slots) *proxy.Proxy {
	return proxy.New(proxy.Options{
		Auth: authn, SandboxDomain: cfg.SandboxDomain, SignIn: authn.TradeSandboxCode, Gateway: cfg.PublicHosts[0],
		PreviewPorts: cfg.Preview.Ports, PreviewUsers: cfg.Preview.Users,
		Sandboxes: st.boxes, Queue: st.queue, Handshakes: st.handshakes, Publisher: pub, Sealer: sealer, Edge: cfg.InstanceID, Slots: slots,
		WakeTimeout: cfg.WakeTimeout, HandshakeTimeout: cfg.HandshakeTimeout, MaxStaleness: cfg.RouteMaxStaleness,
		MaxBody: cfg.MaxBodyBytes, WSMaxMessage: cfg.WSMaxMessageBytes, HeaderAllowlist: cfg.HeaderAllowlist,
		IdentityHeaders: []string{sso.NameHeader, sso.IDHeader, sso.GroupsHeader}, BeaconInterval: cfg.BeaconInterval, BeaconTTL: cfg.BeaconTTL,
		IdleConnected: cfg.IdleConnectedTimeout,
		ReadTimeout:   cfg.ReadTimeout, WriteTimeout: cfg.WriteTimeout, Revalidate: cfg.Revalidate, Changes: st.changes,
		Log: p.Log, Metrics: p.Metrics,
	})
}
