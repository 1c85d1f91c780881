package session

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"

	"github.com/aaas-project/aaas/internal/clientinfo"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/web"
)

// formLimit bounds the body of every account endpoint; a user name, an
// invite code and a token fit many times over.
const formLimit = 8 << 10

// Options wires a Service.
type Options struct {
	Store   *Store
	Limiter *Limiter
	// Actions limits recreates and deletions per user (the same sliding
	// log as Limiter, keyed by account).
	Actions   *Limiter
	Publisher *events.Publisher
	Users     *kv.Cache[kv.User]
	Sandboxes *kv.Cache[kv.Sandbox]
	Requests  *kv.Cache[kv.Result]
	// InFlight is the per-user cap the proxy's requests count against;
	// status streams count too.
	InFlight Slots

	CookieName   string
	CookieSecure bool
	CookieMaxAge time.Duration
	InviteCode   string
	SSO          SSO
	WakeTimeout  time.Duration
	// WriteTimeout bounds each write of a status stream; Revalidate is how
	// often a stream re-checks its credentials.
	WriteTimeout time.Duration
	Revalidate   time.Duration
	Log          *slog.Logger
	Metrics      prometheus.Registerer
}

// Slots caps a user's concurrent requests on this edge.
type Slots interface {
	Acquire(user string) bool
	Release(user string)
}

// SSO is sign-in through an authenticating proxy (oauth2-proxy) that names
// the user in headers the edge believes because nothing else can reach it
// (the exposure's NetworkPolicies).
type SSO struct {
	// NameHeader (AUTH_PROXY_HEADER) carries the login; "" turns SSO off.
	NameHeader string
	// IDHeader (AUTH_PROXY_ID_HEADER) carries the provider's stable id of
	// the user; an account is bound to it at creation.
	IDHeader string
	// GroupsHeader (AUTH_PROXY_GROUPS_HEADER) lists the user's groups.
	GroupsHeader string
	// Allow (AUTH_PROXY_ALLOW) is who may sign in: logins
	// (case-insensitive), group:<name> entries, or * for everyone.
	Allow []string
}

// Service serves the account endpoints and authenticates requests.
type Service struct {
	o      Options
	cookie string
	auth   *prometheus.CounterVec
	// actions joins this edge's identical account actions (same command)
	// into one: one limiter entry, one publish, one wait.
	actions singleflight.Group
}

// New returns a Service. The cookie is __Host-dsh_gw_session when secure
// and no name is configured: the prefix pins it to this host and path /.
func New(o Options) *Service {
	name := o.CookieName
	if name == "" {
		name = "dsh_gw_session"
		if o.CookieSecure {
			name = "__Host-dsh_gw_session"
		}
	}
	s := &Service{o: o, cookie: name, auth: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "aaas_edge_auth_total", Help: "Account endpoint outcomes.",
	}, []string{"endpoint", "outcome"})}
	o.Metrics.MustRegister(s.auth)
	return s
}

// CookieName is the session cookie's name.
func (s *Service) CookieName() string { return s.cookie }

// Ready reports whether the caches authentication reads are complete.
func (s *Service) Ready() bool {
	return s.o.Store.Synced() && s.o.Users.IsSynced() && s.o.Sandboxes.IsSynced() && s.o.Requests.IsSynced()
}

// Register mounts the account endpoints.
func (s *Service) Register(app *fiber.App) {
	app.Get("/", s.landing)
	app.Post("/users", s.signup)
	app.Post("/login", s.login)
	app.Post("/logout", s.logout)
	app.Delete("/users/:user", s.deleteAccount)
	app.Post("/recreate", s.recreate)
	app.Get("/_/status", s.status)
	app.Get("/_/status/stream", s.statusStream)
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

// How a request authenticated.
const (
	MethodCookie = "cookie"
	MethodBearer = "bearer"
	MethodSSO    = "sso"
)

// Identity is who a request authenticated as, and what must stay true
// for it to hold (see Valid).
type Identity struct {
	User string
	// Method is MethodCookie, MethodBearer or MethodSSO.
	Method string
	// sum is the session id's SHA-256 (cookie).
	sum [32]byte
	// bound is the account's token hash when authenticated (bearer, SSO).
	bound string
}

// authError is an authentication failure with the status it answers.
type authError struct {
	status int
	msg    string
}

func (e *authError) Error() string { return e.msg }

// HTTPStatus is the status a request failing with e gets.
func (e *authError) HTTPStatus() int { return e.status }

// Authentication failures.
var (
	ErrNoCredentials  error = &authError{fiber.StatusUnauthorized, "sign in first"}
	ErrBadCredentials error = &authError{fiber.StatusUnauthorized, "invalid or expired credentials"}
	// ErrNotAllowed: SSO knows the user, AUTH_PROXY_ALLOW does not.
	ErrNotAllowed error = &authError{fiber.StatusForbidden, "your sign-in is not allowed on this gateway; ask its operators to add you to AUTH_PROXY_ALLOW"}
	// ErrBoundElsewhere: the account belongs to another identity (a login
	// renamed and registered again by someone else).
	ErrBoundElsewhere error = &authError{fiber.StatusForbidden, "this account belongs to another identity at your sign-in provider; ask the gateway's operators"}
	errUnavailable    error = &authError{fiber.StatusServiceUnavailable, "the gateway cannot reach its message bus; try again shortly"}
	errTimeout        error = &authError{fiber.StatusServiceUnavailable, "your request is taking longer than expected; try again in a moment"}
)

// Status is the HTTP status for an authentication error: 401 unless the
// error says otherwise.
func Status(err error) int {
	var e *authError
	if errors.As(err, &e) {
		return e.status
	}
	return fiber.StatusUnauthorized
}

// Authenticate resolves the request's identity: the SSO header when SSO
// is on, else a bearer token, else the session cookie. Explicit
// credentials that fail are an error, never a fall-back to the cookie.
func (s *Service) Authenticate(c *fiber.Ctx) (Identity, error) {
	if s.o.SSO.NameHeader != "" {
		if login := c.Get(s.o.SSO.NameHeader); login != "" {
			return s.ssoIdentity(c, login)
		}
	}
	if h := c.Get(fiber.HeaderAuthorization); h != "" {
		token, ok := strings.CutPrefix(h, "Bearer ")
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		u, ok := s.checkToken(token)
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		return Identity{User: u.Name, Method: MethodBearer, bound: u.TokenHash}, nil
	}
	sid := c.Request().Header.Cookie(s.cookie)
	if len(sid) == 0 {
		return Identity{}, ErrNoCredentials
	}
	if !validSID(sid) {
		return Identity{}, ErrBadCredentials
	}
	sum := sha256.Sum256(sid)
	sess, ok := s.o.Store.LookupSum(sum)
	if !ok {
		return Identity{}, ErrBadCredentials
	}
	return Identity{User: sess.User, Method: MethodCookie, sum: sum}, nil
}

// Valid reports whether id still holds: its session neither revoked nor
// expired, its account neither deleted nor replaced. Long-lived streams
// ask it until it says no, and then end.
func (s *Service) Valid(id Identity) bool {
	if id.Method == MethodCookie {
		sess, ok := s.o.Store.LookupSum(id.sum)
		return ok && sess.User == id.User
	}
	u, ok := s.o.Users.Get(id.User)
	return ok && u.Value.DeletingSince.IsZero() && constantEqual(u.Value.TokenHash, id.bound)
}

func (s *Service) checkToken(token string) (kv.User, bool) {
	user, ok := TokenUser(token)
	if !ok {
		return kv.User{}, false
	}
	u, ok := s.o.Users.Get(user)
	if !ok || !u.Value.DeletingSince.IsZero() {
		return kv.User{}, false
	}
	return u.Value, TokenMatches(token, u.Value.TokenHash)
}

// ssoIdentity admits an SSO user: allowed by AUTH_PROXY_ALLOW, mapped to
// an account name, and bound to the provider's stable id (the id header,
// else the login). The binding is the account's token hash, so an account
// created for one identity never opens for another, and it is created on
// first sight.
func (s *Service) ssoIdentity(c *fiber.Ctx, login string) (Identity, error) {
	if !s.ssoAllowed(login, c.Get(s.o.SSO.GroupsHeader)) {
		s.auth.WithLabelValues("sso", "refused").Inc()
		s.refused(c, events.AuditEvent{Kind: events.AuditSSORefused, Outcome: "not_allowed"})
		return Identity{}, ErrNotAllowed
	}
	name := SSOName(login)
	subject := "login:" + strings.ToLower(strings.TrimSpace(login))
	if s.o.SSO.IDHeader != "" {
		if id := strings.TrimSpace(c.Get(s.o.SSO.IDHeader)); id != "" {
			subject = "id:" + strings.ToLower(id)
		}
	}
	bound := HashHex("sso\x00" + subject)
	if u, ok := s.o.Users.Get(name); ok {
		if !u.Value.DeletingSince.IsZero() {
			return Identity{}, ErrBadCredentials
		}
		if !constantEqual(u.Value.TokenHash, bound) {
			s.auth.WithLabelValues("sso", "bound_elsewhere").Inc()
			s.refused(c, events.AuditEvent{Kind: events.AuditSSORefused, User: name, Outcome: "bound_elsewhere"})
			return Identity{}, ErrBoundElsewhere
		}
		return Identity{User: name, Method: MethodSSO, bound: bound}, nil
	}
	if err := s.ssoAccount(c.Context(), name, bound); err != nil {
		if errors.Is(err, ErrBoundElsewhere) {
			s.refused(c, events.AuditEvent{Kind: events.AuditSSORefused, User: name, Outcome: "bound_elsewhere"})
		}
		return Identity{}, err
	}
	return Identity{User: name, Method: MethodSSO, bound: bound}, nil
}

// ssoAllowed applies AUTH_PROXY_ALLOW to a login and its groups.
func (s *Service) ssoAllowed(login, groups string) bool {
	for _, a := range s.o.SSO.Allow {
		if g, ok := strings.CutPrefix(a, "group:"); ok {
			for _, have := range strings.Split(groups, ",") {
				if strings.EqualFold(strings.TrimSpace(have), g) {
					return true
				}
			}
			continue
		}
		if a == "*" || strings.EqualFold(a, strings.TrimSpace(login)) {
			return true
		}
	}
	return false
}

// ssoAccount creates the account of an SSO user on first sight. Edges that
// see the same first visit within a minute publish the same command, which
// the stream keeps once; lifecycle answers a repeat with the same binding
// as created, and a name already bound to another identity as a conflict.
func (s *Service) ssoAccount(ctx context.Context, user, bound string) error {
	req := fmt.Sprintf("sso-%s-%s-%d", user, bound[:12], time.Now().Unix()/60)
	res, err := s.command(ctx, events.NewClaim(user, req, bound))
	switch {
	case err != nil:
		return err
	case res.Outcome == kv.OutcomeConflict:
		return ErrBoundElsewhere
	case res.Outcome != kv.OutcomeCreated:
		return &authError{fiber.StatusServiceUnavailable, "your account could not be created: " + res.Error}
	}
	s.audit(events.AuditEvent{Kind: events.AuditSignup, User: user, RequestID: req, Outcome: "sso"})
	wctx, cancel := context.WithTimeout(ctx, s.o.WakeTimeout)
	defer cancel()
	if _, _, err := s.o.Users.Wait(wctx, user, func(_ kv.Entry[kv.User], ok bool) bool { return ok }); err != nil {
		return errTimeout
	}
	return nil
}

// command publishes c and waits for its answer.
func (s *Service) command(ctx context.Context, c events.Command) (kv.Result, error) {
	if _, err := s.o.Publisher.Command(ctx, c); err != nil {
		return kv.Result{}, errUnavailable
	}
	wctx, cancel := context.WithTimeout(ctx, s.o.WakeTimeout)
	defer cancel()
	e, _, err := s.o.Requests.Wait(wctx, c.RequestID, func(_ kv.Entry[kv.Result], ok bool) bool { return ok })
	if err != nil {
		return kv.Result{}, errTimeout
	}
	return e.Value, nil
}

func (s *Service) audit(e events.AuditEvent) { s.o.Publisher.Audit(e) }

// clientTag names the client in audit events without its address.
func clientTag(c *fiber.Ctx) string { return HashHex(clientinfo.Key(c))[:16] }

// refused audits a refused request, at most once per client per window:
// a flood of refusals must not become a flood of audit events.
func (s *Service) refused(c *fiber.Ctx, e events.AuditEvent) {
	first, err := s.o.Limiter.Refused(c.Context(), clientinfo.Key(c))
	if err != nil || !first {
		return
	}
	e.Client = clientTag(c)
	s.audit(e)
}

// wantsJSON is true for API clients: they send JSON, ask for it, or
// authenticate with a token.
func wantsJSON(c *fiber.Ctx) bool {
	return strings.Contains(c.Get(fiber.HeaderAccept), "application/json") ||
		strings.HasPrefix(c.Get(fiber.HeaderContentType), "application/json") ||
		strings.HasPrefix(c.Get(fiber.HeaderAuthorization), "Bearer ")
}

// fail answers an error the edge's one way (web.WriteProblem), except
// that a browser's refused sign-up or sign-in form gets the landing page
// back with the error above the form.
func (s *Service) fail(c *fiber.Ctx, status int, msg string) error {
	if web.WantsHTML(c) && c.Method() == fiber.MethodPost && (c.Path() == "/users" || c.Path() == "/login") {
		c.Status(status)
		c.Set(fiber.HeaderCacheControl, "no-store")
		c.Type("html")
		return web.RenderLanding(c, web.Landing{Error: msg, Invite: s.o.InviteCode != "", MaxUserLen: MaxUserLen})
	}
	return web.WriteProblem(c, web.Problem{Status: status, Title: statusTitle(status), Detail: msg, SignIn: status == fiber.StatusUnauthorized})
}

func statusTitle(code int) string {
	switch code {
	case fiber.StatusUnauthorized:
		return "Please sign in"
	case fiber.StatusForbidden:
		return "Not allowed"
	case fiber.StatusTooManyRequests:
		return "Too many attempts"
	}
	return "Something went wrong"
}

// limit applies the shared auth rate limit; false means a response was
// written.
func (s *Service) limit(c *fiber.Ctx, endpoint string) (bool, error) {
	v, err := s.o.Limiter.Allow(c.Context(), clientinfo.Key(c))
	if err != nil {
		s.auth.WithLabelValues(endpoint, "unavailable").Inc()
		return false, s.fail(c, fiber.StatusServiceUnavailable, errUnavailable.Error())
	}
	if !v.Allowed {
		s.auth.WithLabelValues(endpoint, "rate_limited").Inc()
		if v.Audit {
			s.audit(events.AuditEvent{Kind: events.AuditRateLimited, Client: clientTag(c), Detail: endpoint})
		}
		c.Set(fiber.HeaderRetryAfter, strconv.Itoa(int(v.RetryAfter.Seconds())+1))
		return false, s.fail(c, fiber.StatusTooManyRequests, "too many attempts; wait and try again")
	}
	return true, nil
}

// form reads a small urlencoded or JSON body into fields, refusing
// oversize bodies, other content types and unknown JSON fields.
func (s *Service) form(c *fiber.Ctx, fields ...string) (map[string]string, int, string) {
	if n := c.Request().Header.ContentLength(); n > formLimit {
		return nil, fiber.StatusRequestEntityTooLarge, "request body too large"
	}
	mt, _, _ := mime.ParseMediaType(c.Get(fiber.HeaderContentType))
	if mt != fiber.MIMEApplicationForm && mt != fiber.MIMEApplicationJSON {
		return nil, fiber.StatusUnsupportedMediaType, "send application/x-www-form-urlencoded or application/json"
	}
	body, err := io.ReadAll(io.LimitReader(c.Context().RequestBodyStream(), formLimit+1))
	if err != nil {
		return nil, fiber.StatusBadRequest, "could not read the request body"
	}
	if len(body) > formLimit {
		return nil, fiber.StatusRequestEntityTooLarge, "request body too large"
	}
	out := map[string]string{}
	if mt == fiber.MIMEApplicationJSON {
		raw := map[string]json.RawMessage{}
		if err := json.Unmarshal(body, &raw); err != nil {
			return nil, fiber.StatusBadRequest, "malformed JSON"
		}
		for k, v := range raw {
			if !slices.Contains(fields, k) {
				return nil, fiber.StatusBadRequest, fmt.Sprintf("unknown field %q", k)
			}
			var str string
			if err := json.Unmarshal(v, &str); err != nil {
				return nil, fiber.StatusBadRequest, fmt.Sprintf("field %q must be a string", k)
			}
			out[k] = str
		}
		return out, 0, ""
	}
	vals, err := url.ParseQuery(string(body))
	if err != nil {
		return nil, fiber.StatusBadRequest, "malformed form"
	}
	for k, v := range vals {
		if !slices.Contains(fields, k) {
			return nil, fiber.StatusBadRequest, fmt.Sprintf("unknown field %q", k)
		}
		if len(v) != 1 {
			return nil, fiber.StatusBadRequest, fmt.Sprintf("field %q given %d times", k, len(v))
		}
		out[k] = v[0]
	}
	return out, 0, ""
}

func (s *Service) setCookie(c *fiber.Ctx, sid string) {
	c.Cookie(&fiber.Cookie{
		Name: s.cookie, Value: sid, Path: "/", MaxAge: int(s.o.CookieMaxAge.Seconds()),
		HTTPOnly: true, Secure: s.o.CookieSecure, SameSite: fiber.CookieSameSiteLaxMode,
	})
}

func (s *Service) clearCookie(c *fiber.Ctx) {
	c.Cookie(&fiber.Cookie{
		Name: s.cookie, Value: "", Path: "/", MaxAge: -1, Expires: time.Unix(1, 0),
		HTTPOnly: true, Secure: s.o.CookieSecure, SameSite: fiber.CookieSameSiteLaxMode,
	})
}

// newRequestID names one request for its command's answer.
func newRequestID() string { return random32()[:22] }

// constantEqual compares secrets without leaking where they differ.
func constantEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}
