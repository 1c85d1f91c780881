package session

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/url"
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

	CookieName   string
	CookieSecure bool
	CookieMaxAge time.Duration
	InviteCode   string
	// ProxyHeader turns on SSO: the header names the user.
	ProxyHeader string
	WakeTimeout time.Duration
	Log         *slog.Logger
	Metrics     prometheus.Registerer
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

// Identity is who a request authenticated as.
type Identity struct {
	User string
	// Method is cookie, bearer or sso.
	Method string
	sid    string
}

// Authentication failures.
var (
	ErrNoCredentials  = errors.New("sign in first")
	ErrBadCredentials = errors.New("invalid or expired credentials")
)

// Authenticate resolves the request's identity: the SSO header when SSO
// is on, else a bearer token, else the session cookie. Explicit
// credentials that fail are an error, never a fall-back to the cookie.
func (s *Service) Authenticate(c *fiber.Ctx) (Identity, error) {
	if s.o.ProxyHeader != "" {
		if name := c.Get(s.o.ProxyHeader); name != "" {
			if ValidateUser(name) != nil {
				return Identity{}, ErrBadCredentials
			}
			if err := s.ensureSSOAccount(c.Context(), name); err != nil {
				return Identity{}, err
			}
			return Identity{User: name, Method: "sso"}, nil
		}
	}
	if h := c.Get(fiber.HeaderAuthorization); h != "" {
		token, ok := strings.CutPrefix(h, "Bearer ")
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		user, ok := s.checkToken(token)
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		return Identity{User: user, Method: "bearer"}, nil
	}
	sid := c.Request().Header.Cookie(s.cookie)
	if len(sid) == 0 {
		return Identity{}, ErrNoCredentials
	}
	sess, ok := s.o.Store.Lookup(sid)
	if !ok {
		return Identity{}, ErrBadCredentials
	}
	return Identity{User: sess.User, Method: "cookie", sid: string(sid)}, nil
}

func (s *Service) checkToken(token string) (string, bool) {
	user, ok := TokenUser(token)
	if !ok {
		return "", false
	}
	u, ok := s.o.Users.Get(user)
	if !ok {
		return "", false
	}
	return user, TokenMatches(token, u.Value.TokenHash)
}

// ensureSSOAccount creates the account of an SSO user on first sight.
// Edges that see the same first visit within a minute publish the same
// command, which the stream keeps once.
func (s *Service) ensureSSOAccount(ctx context.Context, user string) error {
	if _, ok := s.o.Users.Get(user); ok {
		return nil
	}
	req := fmt.Sprintf("sso-%s-%d", user, time.Now().Unix()/60)
	res, err := s.command(ctx, events.NewClaim(user, req, HashHex(NewToken(user))))
	if err != nil {
		return err
	}
	if res.Outcome != kv.OutcomeCreated {
		return fmt.Errorf("account %q cannot be created: %s", user, res.Outcome)
	}
	s.audit(events.AuditEvent{Kind: events.AuditSignup, User: user, Outcome: "sso"})
	_, _, _ = s.o.Users.Wait(ctx, user, func(_ kv.Entry[kv.User], ok bool) bool { return ok })
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

var (
	errUnavailable = errors.New("the gateway cannot reach its message bus; try again shortly")
	errTimeout     = errors.New("your request is taking longer than expected; try again in a moment")
)

func (s *Service) audit(e events.AuditEvent) { s.o.Publisher.Audit(e) }

// wantsJSON is true for API clients: they send JSON, ask for it, or
// authenticate with a token.
func wantsJSON(c *fiber.Ctx) bool {
	return strings.Contains(c.Get(fiber.HeaderAccept), "application/json") ||
		strings.HasPrefix(c.Get(fiber.HeaderContentType), "application/json") ||
		strings.HasPrefix(c.Get(fiber.HeaderAuthorization), "Bearer ")
}

// fail answers an error as JSON for API clients and as the landing page
// (or an error page) for browsers.
func (s *Service) fail(c *fiber.Ctx, status int, msg string) error {
	c.Status(status)
	c.Set(fiber.HeaderCacheControl, "no-store")
	if wantsJSON(c) {
		return c.JSON(fiber.Map{"error": msg})
	}
	c.Type("html")
	if c.Method() == fiber.MethodPost && (c.Path() == "/users" || c.Path() == "/login") {
		return web.RenderLanding(c, web.Landing{Error: msg, Invite: s.o.InviteCode != "", MaxUserLen: MaxUserLen})
	}
	return web.RenderProblem(c, web.Problem{Status: status, Title: statusTitle(status), Detail: msg, SignIn: status == fiber.StatusUnauthorized})
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
	client := clientinfo.IP(c)
	ok, retry, err := s.o.Limiter.Allow(c.Context(), client)
	if err != nil {
		s.auth.WithLabelValues(endpoint, "unavailable").Inc()
		return false, s.fail(c, fiber.StatusServiceUnavailable, errUnavailable.Error())
	}
	if !ok {
		s.auth.WithLabelValues(endpoint, "rate_limited").Inc()
		s.audit(events.AuditEvent{Kind: events.AuditRateLimited, Client: HashHex(client)[:16], Detail: endpoint})
		c.Set(fiber.HeaderRetryAfter, strconv.Itoa(int(retry.Seconds())+1))
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
			if !contains(fields, k) {
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
		if !contains(fields, k) {
			return nil, fiber.StatusBadRequest, fmt.Sprintf("unknown field %q", k)
		}
		if len(v) != 1 {
			return nil, fiber.StatusBadRequest, fmt.Sprintf("field %q given %d times", k, len(v))
		}
		out[k] = v[0]
	}
	return out, 0, ""
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if x == y {
			return true
		}
	}
	return false
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
