// Sign-in on sandbox origins (subdomain mode). No cookie is shared across
// origins, so the gateway, where the user is signed in, mints a
// single-use code bound to the user, the gateway session and the sandbox
// host, and the sandbox origin trades it for a session of its own: a
// host-only cookie backed by a session in the sessions bucket that holds
// only while its gateway session does.

package auth

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// The two ends of a sign-in: the gateway's endpoint that mints a code for
// a sandbox URL (?next=), and the path of every sandbox origin that
// trades it (?code=&next=), the one path there the edge answers itself.
const (
	SandboxMintPath   = "/_/signin/sandbox"
	SandboxSignInPath = "/_aaas/signin"
)

// Origins configures sign-in on sandbox origins.
type Origins struct {
	// Domain is SANDBOX_DOMAIN (canonical); "" is path mode.
	Domain string
	// Codes is the signin_codes bucket; CodeTTL is SIGNIN_CODE_TTL.
	Codes   *kv.Bucket[state.SigninCode]
	CodeTTL time.Duration
	// CookieName is the sandbox origins' session cookie (SandboxCookie);
	// Secure is COOKIE_SECURE.
	CookieName string
	Secure     bool
	// MayOpen says whether id may sign in to the origin of the sandbox of
	// key (ident.SandboxKey) at port (0: the DSH's, else a preview's);
	// nil: only the origins of id's own sandboxes.
	MayOpen func(id Identity, key string, port int) bool
}

// SandboxCookie is the name of a sandbox origin's session cookie: with
// the __Host- prefix behind TLS, which pins it to the one origin and
// path /.
func SandboxCookie(secure bool) string {
	if secure {
		return "__Host-aaas-sandbox"
	}
	return "aaas_sandbox"
}

// sandboxIdentity authenticates a request on a sandbox origin by the
// origin's session cookie: a sandbox session for exactly this host (so one
// origin's cookie opens no other) whose gateway session still holds. user
// is the user the host names, under whom a session this edge has not seen
// yet is looked up.
func (a *Authenticator) sandboxIdentity(c *fiber.Ctx, user string) (Identity, error) {
	if a.o.Origins.CookieName == "" {
		return Identity{}, ErrNoCredentials
	}
	sess, sum, err := a.session(c, a.o.Origins.CookieName, "", user)
	if err != nil {
		return Identity{}, err
	}
	if sess.Host == "" || sess.Host != httpguard.Host(c) || !a.parentHolds(c, sess) {
		return Identity{}, ErrBadCredentials
	}
	return Identity{User: sess.User, Method: MethodCookie, sum: sum, host: sess.Host}, nil
}

// parentHolds reports whether what a sandbox session was made from still
// holds: its gateway session (looked up in the bucket when this edge has
// not seen it, if c is a request), or for SSO the account's binding. So
// logout, recreate, delete, an admin's revocation and the session cap end
// it on every edge at once.
func (a *Authenticator) parentHolds(c *fiber.Ctx, sess state.Session) bool {
	if sess.Parent == "" {
		ctx := context.Background() // a live exchange's periodic check (c nil)
		if c != nil {
			ctx = httpguard.Context(c)
		}
		u, ok := a.o.Users.Load(ctx, sess.User)
		return sess.Bound != "" && ok && u.Value.DeletingSince.IsZero() && SecretEqual(u.Value.TokenHash, sess.Bound)
	}
	_, ok := a.gatewaySession(c, sess.User, sess.Parent)
	return ok
}

// gatewaySession is user's gateway session whose id hashes to parent
// (hex), if it holds.
func (a *Authenticator) gatewaySession(c *fiber.Ctx, user, parent string) (state.Session, bool) {
	raw, err := hex.DecodeString(parent)
	if err != nil || len(raw) != sha256.Size {
		return state.Session{}, false
	}
	sum := [sha256.Size]byte(raw)
	p, ok := a.o.Store.LookupSum(sum)
	if !ok && c != nil {
		p, ok, _ = a.o.Store.Fetch(c.UserContext(), httpguard.Key(c), user, sum)
	}
	return p, ok && p.User == user && p.Host == ""
}

// MintSandboxCode is GET SandboxMintPath?next=<sandbox URL> on the
// gateway: for a user signed in here (session or SSO) and a next on an
// origin they may open, it stores a single-use code (by its hash, for
// CodeTTL) and sends the browser to that origin's SandboxSignInPath with
// it. Signed out: to the landing page. A next on no origin of this
// gateway's: 400; on someone else's: 403, and nothing is minted.
func (a *Authenticator) MintSandboxCode(c *fiber.Ctx) error {
	c.Set(fiber.HeaderCacheControl, "no-store")
	c.Set(fiber.HeaderReferrerPolicy, "no-referrer")
	id, err := a.Authenticate(c)
	switch {
	case err != nil && web.AsError(err).Status == fiber.StatusUnauthorized:
		return c.Redirect("/", fiber.StatusSeeOther)
	case err != nil:
		e := *web.AsError(err)
		e.Title = "Cannot sign you in"
		return a.signinProblem(c, "mint", &e)
	case id.Method == MethodBearer:
		return a.signinProblem(c, "mint", &web.Error{Status: fiber.StatusForbidden, Title: "Use your token there", Detail: "A bearer token works on the sandbox origin itself; this link is for browsers."})
	}
	scheme := httpguard.Scheme(c)
	host, user, port, path, ok := a.sandboxURL(c.Query("next"), scheme)
	if !ok {
		return a.signinProblem(c, "mint", &web.Error{Status: fiber.StatusBadRequest, Title: "Not a sandbox address", Detail: "The address to sign in to is not a sandbox of this gateway."})
	}
	// Each code is a record in a bounded bucket: a client mints at most
	// AUTH_RATE_LIMIT of them per window, however many sessions it holds.
	if v, err := a.o.Limiter.Allow(c.UserContext(), httpguard.Key(c)); err != nil {
		return a.signinProblem(c, "mint", &web.Error{Status: fiber.StatusServiceUnavailable, Title: "Try again", Detail: "The gateway cannot reach its message bus; try again shortly."})
	} else if !v.Allowed {
		c.Set(fiber.HeaderRetryAfter, retryAfter(v.RetryAfter))
		return a.signinProblem(c, "mint", &web.Error{Status: fiber.StatusTooManyRequests, Title: "Too many attempts", Detail: "Too many sign-in attempts; try again shortly."})
	}
	if !a.mayOpen(id, user, port) {
		return a.signinProblem(c, "mint", &web.Error{Status: fiber.StatusForbidden, Title: "Not your sandbox", Detail: "You are signed in as " + id.User + "; that sandbox is not yours."})
	}
	sc := state.SigninCode{User: id.User, Host: host, Expires: time.Now().Add(a.o.Origins.CodeTTL).UTC()}
	if id.Method == MethodCookie {
		sc.Parent = hex.EncodeToString(id.sum[:])
	} else {
		sc.Bound = id.bound
	}
	code := ident.NewSecret()
	if _, err := a.o.Origins.Codes.Create(c.UserContext(), ident.HashHex(code), sc); err != nil {
		return a.signinProblem(c, "mint", &web.Error{Status: fiber.StatusServiceUnavailable, Title: "Try again", Detail: "The gateway cannot reach its message bus; try again shortly."})
	}
	a.counter.WithLabelValues("sandbox_mint", "ok").Inc()
	return c.Redirect(scheme+"://"+host+SandboxSignInPath+"?code="+code+"&next="+url.QueryEscape(path), fiber.StatusSeeOther)
}

// mayOpen is Origins.MayOpen, by default: the origins of one's own
// sandboxes only.
func (a *Authenticator) mayOpen(id Identity, key string, port int) bool {
	if a.o.Origins.MayOpen == nil {
		return id.User == ident.OwnerOf(key)
	}
	return a.o.Origins.MayOpen(id, key, port)
}

// sandboxURL reads next as an absolute URL on a sandbox origin of this
// gateway, reached by scheme: its canonical host, the user and port the
// host names, and its path and query (starting with one slash).
func (a *Authenticator) sandboxURL(next, scheme string) (host, user string, port int, path string, ok bool) {
	u, err := url.Parse(next)
	if err != nil || u.Scheme != scheme || u.User != nil || u.Opaque != "" || u.Host == "" || a.o.Origins.Domain == "" {
		return "", "", 0, "", false
	}
	host, ok = ident.CanonicalHost(u.Host, scheme)
	if !ok {
		return "", "", 0, "", false
	}
	user, port, ok = httpguard.ParseSandboxHost(host, a.o.Origins.Domain)
	if !ok {
		return "", "", 0, "", false
	}
	path = u.EscapedPath()
	if path == "" {
		path = "/"
	}
	if u.RawQuery != "" {
		path += "?" + u.RawQuery
	}
	if !LocalPath(path) {
		return "", "", 0, "", false
	}
	return host, user, port, path, true
}

// LocalPath reports whether p is a path on the same origin as a browser
// reads it: one leading slash, and no backslash or control character
// (browsers read "/\host" as "//host", another origin).
func LocalPath(p string) bool {
	if !strings.HasPrefix(p, "/") || strings.HasPrefix(p, "//") {
		return false
	}
	for i := 0; i < len(p); i++ {
		if c := p[i]; c == '\\' || c < 0x20 || c == 0x7f {
			return false
		}
	}
	return true
}

// TradeSandboxCode is GET SandboxSignInPath?code=&next= on a sandbox
// origin: the code is taken (a compare-and-delete on the revision read,
// so of two edges trading it at once one wins), a sandbox session made
// for this host from the code's gateway session, its cookie set, and the
// browser sent to next (a path on this origin). A code that is unknown,
// used or expired answers 400, one for another host or user 403, one
// whose gateway session has ended 401; none of them changes anything.
func (a *Authenticator) TradeSandboxCode(c *fiber.Ctx) error {
	c.Set(fiber.HeaderCacheControl, "no-store")
	c.Set(fiber.HeaderReferrerPolicy, "no-referrer")
	info := httpguard.Get(c)
	switch {
	case !info.OnSandboxDomain || info.Sandbox == "" || a.o.Origins.Codes == nil:
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusNotFound, Title: "No such sandbox", Detail: "There is no sandbox at this address."})
	// GET only: a HEAD (a link checker's) must not spend the code.
	case c.Method() != fiber.MethodGet:
		c.Set(fiber.HeaderAllow, "GET")
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusMethodNotAllowed, Title: "Not here", Detail: "Sign-in links are opened, not posted."})
	}
	code := c.Query("code")
	if !ident.ValidSecret([]byte(code)) {
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusBadRequest, Title: "Sign-in link not valid", Detail: "This sign-in link is not valid. Open your sandbox from the gateway again."})
	}
	ctx := c.UserContext()
	if v, err := a.o.Limiter.Allow(ctx, httpguard.Key(c)); err != nil {
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusServiceUnavailable, Title: "Try again", Detail: "The gateway cannot reach its message bus; try again shortly."})
	} else if !v.Allowed {
		c.Set(fiber.HeaderRetryAfter, retryAfter(v.RetryAfter))
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusTooManyRequests, Title: "Too many attempts", Detail: "Too many sign-in attempts; try again shortly."})
	}
	key := ident.HashHex(code)
	e, err := a.o.Origins.Codes.Get(ctx, key)
	switch {
	case errors.Is(err, kv.ErrNotFound):
		return a.codeRefused(c, fiber.StatusBadRequest, "used_or_expired")
	case err != nil:
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusServiceUnavailable, Title: "Try again", Detail: "The gateway cannot reach its message bus; try again shortly."})
	}
	sc, now := e.Value, time.Now()
	switch {
	case !now.Before(sc.Expires):
		return a.codeRefused(c, fiber.StatusBadRequest, "used_or_expired")
	case sc.Host != info.Host || !a.mayOpen(Identity{User: sc.User}, info.Sandbox, info.PreviewPort):
		return a.codeRefused(c, fiber.StatusForbidden, "foreign_host")
	}
	expires := now.Add(a.o.Store.ttl)
	if sc.Parent != "" {
		p, ok := a.gatewaySession(c, sc.User, sc.Parent)
		if !ok {
			return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusUnauthorized, Title: "Signed out", Detail: "Your gateway session has ended; sign in on the gateway again."})
		}
		expires = p.Expires
	} else if !a.parentHolds(c, state.Session{User: sc.User, Bound: sc.Bound}) {
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusUnauthorized, Title: "Signed out", Detail: "Your sign-in no longer holds; sign in on the gateway again."})
	}
	if err := a.o.Origins.Codes.Delete(ctx, key, e.Revision); errors.Is(err, kv.ErrConflict) {
		return a.codeRefused(c, fiber.StatusBadRequest, "used_or_expired")
	} else if err != nil {
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusServiceUnavailable, Title: "Try again", Detail: "The gateway cannot reach its message bus; try again shortly."})
	}
	sid, err := a.o.Store.CreateSandbox(ctx, sc.User, sc.Host, sc.Parent, sc.Bound, expires)
	if err != nil {
		return a.signinProblem(c, "trade", &web.Error{Status: fiber.StatusServiceUnavailable, Title: "Try again", Detail: "Your session could not be started; try again shortly."})
	}
	a.o.Publisher.Audit(events.AuditEvent{Kind: events.AuditLogin, User: sc.User, Outcome: "ok", Detail: "sandbox origin " + sc.Host, Client: ClientTag(c), RequestID: httpguard.RequestID(c)})
	c.Cookie(&fiber.Cookie{Name: a.o.Origins.CookieName, Value: sid, Path: "/", Expires: expires, HTTPOnly: true, Secure: a.o.Origins.Secure, SameSite: fiber.CookieSameSiteLaxMode})
	a.counter.WithLabelValues("sandbox_trade", "ok").Inc()
	next := c.Query("next")
	if !LocalPath(next) {
		next = "/"
	}
	return c.Redirect(next, fiber.StatusSeeOther)
}

// codeRefused answers a code that cannot be traded here (400: unknown,
// used or expired; 403: for another origin) and audits it as a refused
// sign-in, within the refusal budget (Refused).
func (a *Authenticator) codeRefused(c *fiber.Ctx, status int, outcome string) error {
	a.Refused(c, events.AuditEvent{Kind: events.AuditLogin, User: httpguard.Get(c).Sandbox, Outcome: outcome, Detail: "sandbox origin " + httpguard.Host(c)})
	if status == fiber.StatusForbidden {
		return a.signinProblem(c, "trade", &web.Error{Status: status, Title: "Sign-in link for another sandbox", Detail: "This sign-in link is for another sandbox."})
	}
	return a.signinProblem(c, "trade", &web.Error{Status: status, Title: "Sign-in link used or expired", Detail: "This sign-in link was already used or has expired. Open your sandbox from the gateway again."})
}

// signinProblem answers a sign-in endpoint's refusal with a readable page
// (or problem JSON), counted by endpoint and status.
func (a *Authenticator) signinProblem(c *fiber.Ctx, endpoint string, e *web.Error) error {
	a.counter.WithLabelValues("sandbox_"+endpoint, strconv.Itoa(e.Status)).Inc()
	return web.Fail(c, e)
}

func retryAfter(d time.Duration) string {
	return strconv.Itoa(max(1, int(d.Round(time.Second)/time.Second)))
}
