// Command edge serves browsers and API clients: the landing page, accounts
// and sessions, and the proxy to each user's sandbox. It holds no
// Kubernetes credentials; see the README for its configuration.
package main

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
	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/proxy"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

func main() {
	cfg, err := config.LoadEdge(config.FromOS())
	process.Main(natsauth.Edge, cfg.Common, err, func(p *process.Process) error { return run(p, cfg) })
}

func run(p *process.Process, cfg config.Edge) error {
	ctx := p.Ctx
	sealer, err := handshake.NewSealer(cfg.HandshakeKeys...)
	if err != nil {
		return err
	}
	pub := events.NewPublisher(p.JS, cfg.InstanceID, p.Log)
	// Every session ended and every account changed, here or on another
	// edge, is a moment for the proxy to re-check its open streams.
	changes := make(chan struct{}, 1)
	changed := func() {
		select {
		case changes <- struct{}{}:
		default:
		}
	}
	store, err := auth.NewStore(ctx, p.JS, auth.StoreOptions{
		TTL: cfg.Buckets.SessionTTL, MaxPerUser: cfg.MaxSessionsPerUser, OnRevoke: changed, Log: p.Log,
	})
	if err != nil {
		return err
	}
	limiter, err := ratelimit.New(ctx, p.JS, cfg.AuthRateLimit, cfg.Buckets.RateWindow)
	if err != nil {
		return err
	}
	actions, err := ratelimit.New(ctx, p.JS, cfg.RecreateRateLimit, cfg.Buckets.RateWindow)
	if err != nil {
		return err
	}
	users, err := cache(ctx, p, state.BucketUsers, kv.OnChange(func(string, kv.Entry[state.User], bool) { changed() }))
	if err != nil {
		return err
	}
	boxes, err := cache[state.Sandbox](ctx, p, state.BucketSandboxes)
	if err != nil {
		return err
	}
	// An API token deleted or lapsed anywhere ends the streams it opened.
	tokensBucket, err := kv.Open[state.APIToken](ctx, p.JS, state.BucketAPITokens)
	if err != nil {
		return err
	}
	apiTokens, err := kv.NewCache(ctx, tokensBucket, ">", p.Log, kv.GroupBy[state.APIToken](state.APITokenUser), kv.OnChange(func(string, kv.Entry[state.APIToken], bool) { changed() }))
	if err != nil {
		return err
	}
	handshakes, err := cache[state.Handshake](ctx, p, state.BucketHandshakes)
	if err != nil {
		return err
	}
	requests, err := cache[state.Result](ctx, p, state.BucketRequests)
	if err != nil {
		return err
	}
	queued, err := cache[state.Queued](ctx, p, state.BucketQueue)
	if err != nil {
		return err
	}
	queue := capacity.Queue{Cache: queued}
	book, recorder, err := spending(ctx, p, cfg)
	if err != nil {
		return err
	}

	clients, err := httpguard.NewPolicy(httpguard.Options{
		TrustedProxies: cfg.TrustedProxies, PublicHosts: append(slices.Clone(cfg.PublicHosts), cfg.AdminHosts...), Unchecked: []string{"/healthz", "/readyz"},
		SandboxDomain: cfg.SandboxDomain,
	})
	if err != nil {
		return err
	}
	slots := proxy.NewSlots(cfg.MaxInFlightPerUser)
	sso := auth.SSO{}
	if cfg.AuthProxyHeader != "" {
		sso = auth.SSO{NameHeader: cfg.AuthProxyHeader, IDHeader: cfg.AuthProxyIDHeader, GroupsHeader: cfg.AuthProxyGroupsHeader, Allow: cfg.AuthProxyAllow}
	}
	origins := auth.Origins{Domain: cfg.SandboxDomain, CodeTTL: cfg.Buckets.SigninCodeTTL, CookieName: auth.SandboxCookie(cfg.CookieSecure), Secure: cfg.CookieSecure,
		// One's own origins, and with PREVIEW_ACCESS=users any user's
		// listed previews (the proxy admits the same).
		MayOpen: func(id auth.Identity, user string, port int) bool {
			return id.User == user || port != 0 && cfg.Preview.Users && cfg.Preview.Allows(port)
		},
	}
	if cfg.SandboxDomain != "" {
		if origins.Codes, err = kv.Open[state.SigninCode](ctx, p.JS, state.BucketSigninCodes); err != nil {
			return err
		}
	}
	authn := auth.New(auth.Options{
		Store: store, Limiter: limiter, Users: users, APITokens: apiTokens, Publisher: pub, RefusalAuditLimit: cfg.RefusalAuditLimit,
		CookieName: cfg.CookieName, SSO: sso, Admins: cfg.AdminUsers, AdminGroups: cfg.AdminGroups, Metrics: p.Metrics, Origins: origins,
		SeenGroups: recorder.Seen,
	})
	var byok *accounts.BYOK
	if cfg.BYOK {
		creds, err := kv.Open[state.Credential](ctx, p.JS, state.BucketCredentials)
		if err != nil {
			return err
		}
		byok = &accounts.BYOK{Credentials: creds, PublicKey: cfg.CredentialsPublicKey}
		for _, pr := range cfg.Providers {
			byok.Providers = append(byok.Providers, pr.Name)
		}
	}
	budgets, err := kv.Open[state.Budget](ctx, p.JS, state.BucketBudgets)
	if err != nil {
		return err
	}
	awake, err := kv.Open[state.KeepAwake](ctx, p.JS, state.BucketKeepAwake)
	if err != nil {
		return err
	}
	awakes, err := kv.NewCache(ctx, awake, ">", p.Log)
	if err != nil {
		return err
	}
	// Every edge follows the activity stream: the admin view and the
	// user's page show the idle rule's view of it.
	clocks := idle.NewClocks()
	go clocks.Follow(ctx, p.JS, p.Log)
	acct := accounts.New(accounts.Options{
		Auth: authn, Actions: actions, Publisher: pub, Users: users, Sandboxes: boxes, Requests: requests, Queue: queue,
		APITokens: &accounts.APITokens{Bucket: tokensBucket, Cache: apiTokens, MaxEach: cfg.MaxAPITokensPerUser},
		InFlight:  slots, CookieSecure: cfg.CookieSecure, CookieMaxAge: cfg.Buckets.SessionTTL,
		InviteCode: cfg.InviteCode, MaxUsers: cfg.MaxUsers, SSO: sso.NameHeader != "", SignOutURL: cfg.AuthProxySignOutURL, WakeTimeout: cfg.WakeTimeout,
		WriteTimeout: cfg.WriteTimeout, Revalidate: cfg.Revalidate, Log: p.Log,
		SandboxDomain: cfg.SandboxDomain, AdminHosts: cfg.AdminHosts, PublicHosts: cfg.PublicHosts,
		Spend: book, BYOK: byok,
		Clocks: clocks, Idle: cfg.Idle, KeepAwake: awake, KeepAwakes: awakes, MaxKeepAwake: cfg.MaxKeepAwake,
	})
	prx := proxy.New(proxy.Options{
		Auth: authn, SandboxDomain: cfg.SandboxDomain, SignIn: authn.TradeSandboxCode, Gateway: cfg.PublicHosts[0],
		PreviewPorts: cfg.Preview.Ports, PreviewUsers: cfg.Preview.Users,
		Sandboxes: boxes, Queue: queue, Handshakes: handshakes, Publisher: pub, Sealer: sealer, Edge: cfg.InstanceID, Slots: slots,
		WakeTimeout: cfg.WakeTimeout, HandshakeTimeout: cfg.HandshakeTimeout, MaxStaleness: cfg.RouteMaxStaleness,
		MaxBody: cfg.MaxBodyBytes, WSMaxMessage: cfg.WSMaxMessageBytes, HeaderAllowlist: cfg.HeaderAllowlist,
		IdentityHeaders: []string{sso.NameHeader, sso.IDHeader, sso.GroupsHeader}, BeaconInterval: cfg.BeaconInterval, BeaconTTL: cfg.BeaconTTL,
		IdleConnected: cfg.IdleConnectedTimeout,
		ReadTimeout:   cfg.ReadTimeout, WriteTimeout: cfg.WriteTimeout, Revalidate: cfg.Revalidate, Changes: changes,
		Log: p.Log, Metrics: p.Metrics,
	})

	adm := admin.New(admin.Options{
		Auth: authn, Accounts: acct, Users: users, Sandboxes: boxes, Activity: clocks, Publisher: pub, Log: p.Log,
		Hosts: cfg.AdminHosts, PublicHosts: cfg.PublicHosts, SandboxDomain: cfg.SandboxDomain,
		Spend: book, Budgets: budgets, JS: p.JS, Idle: cfg.Idle,
	})

	var draining atomic.Bool
	ready := func() bool { return !draining.Load() && acct.Ready() && handshakes.IsSynced() && queued.IsSynced() }

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
	health := func(ok func() bool) fiber.Handler {
		return func(c *fiber.Ctx) error {
			if ok() {
				return c.SendString("ok\n")
			}
			return c.Status(fiber.StatusServiceUnavailable).SendString("not ready\n")
		}
	}
	// One set of rules for every route, outermost first (the request's id
	// and access line around everything); then a request to
	// a sandbox origin goes to the proxy and never reaches a gateway route.
	app.Use(clients.Access(p.Log), httpguard.ConsumeBody, httpguard.Recover(p.Log), httpguard.Methods, httpguard.Pages, clients.Middleware, httpguard.HSTS(cfg.HSTSMaxAge), prx.Origins)
	app.Get("/healthz", health(func() bool { return true }))
	app.Get("/readyz", health(ready))
	if cfg.SandboxDomain != "" {
		app.Get(auth.SandboxMintPath, authn.MintSandboxCode)
	}
	acct.Register(app)
	adm.Register(app)
	prx.Register(app, adm.NoSandboxes)
	go prx.Run(ctx)

	ln, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return err
	}
	// Ready only once the socket is open: earlier, a probe (or a test) could
	// route a client here and get "connection refused".
	p.SetReady(ready)
	p.Log.Info("serving", "addr", ln.Addr().String(), "cookie", authn.CookieName())
	served := make(chan error, 1)
	go func() { served <- app.Listener(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	// Drain: readiness off, sockets told to reconnect elsewhere, requests
	// in flight finish up to the deadline.
	draining.Store(true)
	prx.Drain()
	if err := app.ShutdownWithTimeout(cfg.ShutdownTimeout); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		p.Log.Warn("shutdown", "err", err)
	}
	p.Log.Info("drained")
	return nil
}

// spending is the caches of model spend, budgets and SSO groups the
// user's page and the admin view read, and the recorder of the groups.
func spending(ctx context.Context, p *process.Process, cfg config.Edge) (*spend.Book, *spend.Recorder, error) {
	usage, err := cache[state.Usage](ctx, p, state.BucketUsage)
	if err != nil {
		return nil, nil, err
	}
	budgets, err := cache[state.Budget](ctx, p, state.BucketBudgets)
	if err != nil {
		return nil, nil, err
	}
	groupsBucket, err := kv.Open[state.UserGroups](ctx, p.JS, state.BucketUserGroups)
	if err != nil {
		return nil, nil, err
	}
	groups, err := kv.NewCache(ctx, groupsBucket, ">", p.Log)
	if err != nil {
		return nil, nil, err
	}
	book := &spend.Book{Usage: usage, Budgets: budgets, Groups: groups, DefaultMicros: cfg.DefaultMicros}
	return book, &spend.Recorder{Bucket: groupsBucket, Cache: groups, Refresh: cfg.Buckets.SessionTTL / 2, Log: p.Log}, nil
}

func cache[T any](ctx context.Context, p *process.Process, bucket string, opts ...kv.CacheOption[T]) (*kv.Cache[T], error) {
	b, err := kv.Open[T](ctx, p.JS, bucket)
	if err != nil {
		return nil, err
	}
	return kv.NewCache(ctx, b, ">", p.Log, opts...)
}
