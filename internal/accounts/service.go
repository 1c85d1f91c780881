// Package accounts serves the account endpoints at the edge: the landing
// page (the user's own page when signed in), signup, login, logout,
// account deletion, recreate, suspend and keep-awake, and the status page
// and stream. It creates SSO users' accounts on first sight, as an
// explicit step (authentication itself never writes an account). Who a
// request is comes from the auth package.
package accounts

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"
	"golang.org/x/sync/singleflight"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Options wires a Service.
type Options struct {
	Auth *auth.Authenticator
	// Actions limits recreates and deletions per user (the same sliding
	// log as the auth rate limit, keyed by account).
	Actions   *ratelimit.Limiter
	Publisher *events.Publisher
	Users     *kv.Cache[state.User]
	// Names is every user's name, the accounts' bucket its first source,
	// whose count MaxUsers caps.
	Names *kv.Names
	// APITokens are users' named API tokens; nil: not served.
	APITokens *APITokens
	Sandboxes *kv.Cache[state.Sandbox]
	Requests  *kv.Cache[state.Result]
	// Queue shows a waiting user their place.
	Queue capacity.Queue
	// Profiles are what a user may choose their sandbox's kind from
	// (PROFILES); the first is the default.
	Profiles config.Profiles
	// MaxSandboxes is MAX_SANDBOXES_PER_USER: above 1, users make named
	// sandboxes beside their first.
	MaxSandboxes int
	// InFlight is the per-user cap the proxy's requests count against;
	// status streams count too.
	InFlight Slots

	CookieSecure bool
	CookieMaxAge time.Duration
	InviteCode   string
	// MaxUsers caps the accounts (0: no cap); the count is the users
	// bucket's, so every edge applies the same one.
	MaxUsers int
	// SSO is on: accounts come from the authenticating proxy, not forms.
	SSO bool
	// SignOutURL (AUTH_PROXY_SIGN_OUT_URL) is where an SSO user's sign-out
	// goes once their sessions here are ended: the SSO proxy's sign-out.
	SignOutURL string
	// SandboxDomain, AdminHosts and PublicHosts (SANDBOX_DOMAIN,
	// ADMIN_HOSTS, PUBLIC_HOSTS; canonical) say where sign-up, sign-in and
	// the landing page send a user for their sandbox (web.Sites).
	SandboxDomain string
	AdminHosts    []string
	PublicHosts   []string

	// Activity and Idle are the idle clocks, read when shown, and the idle
	// rule (IDLE_TIMEOUT, MAX_RUNTIME): the user's page shows when their
	// sandbox will be suspended and why. KeepAwake (and its cache) holds
	// users' keep-awakes, each at most MaxKeepAwake (MAX_KEEPAWAKE).
	Activity     *idle.Views
	Idle         idle.Policy
	KeepAwake    *kv.Bucket[state.KeepAwake]
	KeepAwakes   *kv.Cache[state.KeepAwake]
	MaxKeepAwake time.Duration

	// Spend shows the user their model spend and budget on their page;
	// BYOK, when set, lets them store their own provider keys there.
	Spend *spend.Book
	BYOK  *BYOK

	WakeTimeout time.Duration
	// WriteTimeout bounds each write of a status stream; Revalidate is how
	// often a stream re-checks its credentials.
	WriteTimeout time.Duration
	Revalidate   time.Duration
	Log          *slog.Logger
}

// Slots caps a user's concurrent requests on this edge.
type Slots interface {
	Acquire(user string) bool
	Release(user string)
}

// Service serves the account endpoints.
type Service struct {
	o      Options
	cookie string
	sites  web.Sites
	// actions joins this edge's identical account actions (same command)
	// into one: one limiter entry, one publish, one wait.
	actions singleflight.Group
}

// New returns a Service.
func New(o Options) *Service {
	return &Service{o: o, cookie: o.Auth.CookieName(), sites: web.NewSites(o.SandboxDomain, o.AdminHosts, o.PublicHosts)}
}

// Ready reports whether the caches the account endpoints read are
// complete.
func (s *Service) Ready() bool {
	return s.o.Auth.Synced() && s.o.Sandboxes.IsSynced() && s.o.Requests.IsSynced() && (s.o.Spend == nil || s.o.Spend.Synced()) &&
		(s.o.KeepAwakes == nil || s.o.KeepAwakes.IsSynced())
}

// The handlers' calls out (NATS, waits) take the request scope's context
// (httpguard.Context), bounded by their own timeouts, never fasthttp's
// RequestCtx: that one is not cancelled per request, and
// context.AfterFunc goroutines reading its Done race with the server's
// shutdown.

// identity authenticates c for an account endpoint. An SSO user admitted
// without an account yet gets one here: provisioning is this explicit
// step of the account endpoints (the landing page, status), never a side
// effect of authenticating a proxied request.
func (s *Service) identity(c *fiber.Ctx) (auth.Identity, error) {
	id, err := s.o.Auth.Authenticate(c)
	var missing *auth.NoAccount
	if !errors.As(err, &missing) {
		return id, err
	}
	if err := s.provision(c, missing); err != nil {
		if errors.Is(err, auth.ErrBoundElsewhere) {
			s.o.Auth.Refused(c, events.AuditEvent{Kind: events.AuditSSORefused, User: missing.Name, Outcome: "bound_elsewhere"})
		}
		return auth.Identity{}, err
	}
	return s.o.Auth.Authenticate(c)
}

// Register mounts the account endpoints.
func (s *Service) Register(app *fiber.App) {
	app.Get("/", s.landing)
	app.Post("/users", s.signup)
	app.Post("/login", s.login)
	app.Post("/logout", s.logout)
	app.Delete("/users/:user", s.deleteAccount)
	app.Post("/recreate", s.recreate)
	app.Post("/_/token", s.replaceToken)
	s.routeTokens(app)
	s.routeSandboxes(app)
	app.Get("/_/status", s.status)
	app.Post("/_/keepawake", s.keepAwake)
	app.Post("/_/suspend", s.suspendNow)
	app.Get("/_/confirm/:action", s.confirm)
	app.Post("/users/:user/delete", s.deleteAccount)
	app.Get("/_/status/stream", s.statusStream)
	app.Get("/_/usage", s.usage)
	app.Put("/_/keys/:provider", s.storeKey)
	app.Post("/_/keys/:provider", s.storeKey)
	app.Delete("/_/keys/:provider", s.deleteKey)
	app.Post("/_/keys/:provider/delete", s.deleteKey)
	app.Get("/_/static/:name", func(c *fiber.Ctx) error {
		b, typ, ok := web.Asset(c.Params("name"))
		if !ok {
			return fiber.ErrNotFound
		}
		c.Set(fiber.HeaderCacheControl, "public, max-age=300")
		c.Type(strings.TrimPrefix(typ, "."))
		c.Set(fiber.HeaderContentType, typ)
		return c.Send(b)
	})
}

// provision creates the account of an SSO user on first sight. Edges that
// see the same first visit within a minute publish the same command, which
// the stream keeps once; lifecycle answers a repeat with the same binding
// as created, and a name already bound to another identity as a conflict.
func (s *Service) provision(c *fiber.Ctx, missing *auth.NoAccount) error {
	if full, err := s.full(httpguard.Context(c)); err != nil {
		return web.Unavailable(err)
	} else if full {
		return web.Refuse(fiber.StatusForbidden, errFull(s.o.MaxUsers))
	}
	ctx, user, bound := httpguard.Context(c), missing.Name, missing.Bound
	req := fmt.Sprintf("sso-%s-%s-%d", user, bound[:12], time.Now().Unix()/60)
	res, err := s.command(ctx, events.NewClaim(user, req, bound, ""))
	switch {
	case err != nil:
		return err
	case res.Outcome == state.OutcomeConflict:
		return auth.ErrBoundElsewhere
	case res.Outcome != state.OutcomeCreated:
		return web.Refuse(fiber.StatusServiceUnavailable, "your account could not be created: "+res.Error)
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditSignup, User: user, Outcome: "sso"})
	wctx, cancel := context.WithTimeout(ctx, s.o.WakeTimeout)
	defer cancel()
	if _, _, err := s.o.Users.Wait(wctx, user, func(_ kv.Entry[state.User], ok bool) bool { return ok }); err != nil {
		return auth.ErrTimeout
	}
	return nil
}

// command publishes c and waits for its answer.
func (s *Service) command(ctx context.Context, c events.Command) (state.Result, error) {
	if _, err := s.o.Publisher.Command(ctx, c); err != nil {
		s.o.Log.Warn("account command not published", "verb", c.Verb, "user", c.User, "err", err)
		return state.Result{}, auth.ErrUnavailable
	}
	wctx, cancel := context.WithTimeout(ctx, s.o.WakeTimeout)
	defer cancel()
	e, _, err := s.o.Requests.Wait(wctx, c.RequestID, func(_ kv.Entry[state.Result], ok bool) bool { return ok })
	if err != nil {
		return state.Result{}, auth.ErrTimeout
	}
	return e.Value, nil
}

// audit publishes e as the request c's: its id is c's request id.
func (s *Service) audit(c *fiber.Ctx, e events.AuditEvent) {
	e.RequestID = httpguard.RequestID(c)
	s.o.Publisher.Audit(e)
}

// refuse answers err by web.Fail, except that a browser's refused sign-up
// or sign-in form gets the landing page back with the error above the
// form.
func (s *Service) refuse(c *fiber.Ctx, err error) error {
	if web.WantsHTML(c) && c.Method() == fiber.MethodPost && (c.Path() == "/users" || c.Path() == "/login") {
		e := web.AsError(err)
		if e.Status < 500 {
			c.Status(e.Status)
			c.Set(fiber.HeaderCacheControl, "no-store")
			c.Type("html")
			return web.RenderLanding(c, web.Landing{Error: e.Detail, Invite: s.o.InviteCode != "", MaxUserLen: ident.MaxUserLen})
		}
	}
	return web.Fail(c, err)
}

// full reports whether the gateway has MaxUsers accounts. Edges count the
// same bucket's keys (Names, loaded by the first signup an edge sees
// under a cap), so they agree; signups on several edges at the very
// moment the last place goes can each take it (at most one per edge).
func (s *Service) full(ctx context.Context) (bool, error) {
	if s.o.MaxUsers == 0 {
		return false, nil
	}
	if err := s.o.Names.Load(ctx); err != nil {
		return false, err
	}
	return s.o.Names.LenOf(0) >= s.o.MaxUsers, nil
}

func errFull(max int) string {
	return fmt.Sprintf("this gateway has reached its limit of %d users, so no new account can be created; ask its operators", max)
}

// limit applies the shared auth rate limit; false means a response was
// written.
func (s *Service) limit(c *fiber.Ctx, endpoint string) (bool, error) {
	v, err := s.o.Auth.Limiter().Allow(httpguard.Context(c), httpguard.Key(c))
	if err != nil {
		s.o.Auth.Counter().WithLabelValues(endpoint, "unavailable").Inc()
		return false, s.refuse(c, web.Unavailable(fmt.Errorf("%s: rate limit not checked: %w", endpoint, err)))
	}
	if !v.Allowed {
		s.o.Auth.Counter().WithLabelValues(endpoint, "rate_limited").Inc()
		if v.Audit {
			s.o.Auth.AuditRefusal(c, events.AuditEvent{Kind: events.AuditRateLimited, Detail: endpoint})
		}
		c.Set(fiber.HeaderRetryAfter, strconv.Itoa(int(v.RetryAfter.Seconds())+1))
		return false, s.refuse(c, web.Refuse(fiber.StatusTooManyRequests, "too many attempts; wait and try again"))
	}
	return true, nil
}

// setCookie gives the browser user's session sid, and beside it the
// cookie that names the user (auth.UserCookie), with the same lifetime.
func (s *Service) setCookie(c *fiber.Ctx, sid, user string) {
	// The session's cookie first, then its companion, in every answer.
	for _, kv := range [][2]string{{s.cookie, sid}, {auth.UserCookie(s.cookie), user}} {
		c.Cookie(&fiber.Cookie{
			Name: kv[0], Value: kv[1], Path: "/", MaxAge: int(s.o.CookieMaxAge.Seconds()),
			HTTPOnly: true, Secure: s.o.CookieSecure, SameSite: fiber.CookieSameSiteLaxMode,
		})
	}
}

func (s *Service) clearCookie(c *fiber.Ctx) {
	for _, name := range []string{s.cookie, auth.UserCookie(s.cookie)} {
		c.Cookie(&fiber.Cookie{
			Name: name, Value: "", Path: "/", MaxAge: -1, Expires: time.Unix(1, 0),
			HTTPOnly: true, Secure: s.o.CookieSecure, SameSite: fiber.CookieSameSiteLaxMode,
		})
	}
}
