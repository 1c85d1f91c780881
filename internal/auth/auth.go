// Package auth authenticates requests at the edge: opaque session
// cookies backed by the shared sessions bucket, bearer tokens checked
// against the account's token hash, and SSO headers from an authenticating
// proxy (admission, name mapping, binding to the provider's stable id). It
// also says whether an identity still holds (Valid), owns the shared auth
// rate limit and the credential formats. It writes nothing but sessions,
// rate-limit entries and audit events; accounts are created by the
// accounts package.
package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"slices"
	"strings"

	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Options wires an Authenticator.
type Options struct {
	Store   *Store
	Limiter *Limiter
	Users   *kv.Cache[state.User]
	// Publisher takes the audit events of refusals.
	Publisher *events.Publisher
	// CookieName is the session cookie's name (COOKIE_NAME).
	CookieName string
	SSO        SSO
	// Admins (ADMIN_USERS) are the accounts that may administer the
	// gateway; AdminGroups (ADMIN_GROUPS) the SSO groups whose members may.
	Admins      []string
	AdminGroups []string
	Metrics     prometheus.Registerer
}

// Authenticator resolves requests' identities.
type Authenticator struct {
	o       Options
	cookie  string
	counter *prometheus.CounterVec
}

// New returns an Authenticator.
func New(o Options) *Authenticator {
	a := &Authenticator{o: o, cookie: o.CookieName, counter: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "aaas_edge_auth_total", Help: "Authentication and account endpoint outcomes.",
	}, []string{"endpoint", "outcome"})}
	o.Metrics.MustRegister(a.counter)
	return a
}

// CookieName is the session cookie's name.
func (a *Authenticator) CookieName() string { return a.cookie }

// Counter counts outcomes by endpoint ("sso" is authentication's own).
func (a *Authenticator) Counter() *prometheus.CounterVec { return a.counter }

// Synced reports whether the caches authentication reads are complete.
func (a *Authenticator) Synced() bool { return a.o.Store.Synced() && a.o.Users.IsSynced() }

// Store is the session store.
func (a *Authenticator) Store() *Store { return a.o.Store }

// Limiter is the shared auth rate limit.
func (a *Authenticator) Limiter() *Limiter { return a.o.Limiter }

// NoAccount is an SSO user admitted by AUTH_PROXY_ALLOW whose account does
// not exist yet: Name is the account to create, bound to Bound.
type NoAccount struct {
	Name, Bound string
}

func (e *NoAccount) Error() string {
	return "your account " + e.Name + " is created on the gateway's home page; open it first"
}

// HTTPStatus is 401: the page asks the browser to sign in at the home page.
func (e *NoAccount) HTTPStatus() int { return fiber.StatusUnauthorized }

// Ambient reports whether the credentials are ones a browser attaches by
// itself (the session cookie, an SSO header), which need same-origin
// checks; bearer tokens are sent on purpose.
func (id Identity) Ambient() bool { return id.Method != MethodBearer }

// Revoke ends the session id authenticated with (cookie identities only).
func (a *Authenticator) Revoke(ctx context.Context, id Identity) error {
	if id.Method != MethodCookie {
		return nil
	}
	return a.o.Store.Revoke(ctx, id.User, id.sum)
}

// Bound is the binding of an SSO identity (its account's token hash).
func (id Identity) Bound() string { return id.bound }

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
	// Admin: the account is in ADMIN_USERS, or an SSO user of a group in
	// ADMIN_GROUPS.
	Admin bool
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
	// ErrUnavailable and ErrTimeout are the account endpoints' answers
	// when the bus or lifecycle does not answer.
	ErrUnavailable error = &authError{fiber.StatusServiceUnavailable, "the gateway cannot reach its message bus; try again shortly"}
	ErrTimeout     error = &authError{fiber.StatusServiceUnavailable, "your request is taking longer than expected; try again in a moment"}
	// ErrSessionUnavailable: the cookie is not known here yet and the
	// session bucket could not be asked.
	ErrSessionUnavailable error = &authError{fiber.StatusServiceUnavailable, "your session cannot be checked right now; try again in a moment"}
)

// NewError is an error that answers with status.
func NewError(status int, msg string) error { return &authError{status, msg} }

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
func (a *Authenticator) Authenticate(c *fiber.Ctx) (Identity, error) { return a.AuthenticateFor(c, "") }

// AuthenticateFor is Authenticate for a request that names the user it is
// for (a proxied /u/<user>/ path): a session cookie this edge's cache does
// not know yet is looked up in the bucket under that user (Store.Fetch),
// so a session created on another edge a moment ago works here too.
func (a *Authenticator) AuthenticateFor(c *fiber.Ctx, user string) (Identity, error) {
	id, err := a.identify(c, user)
	if err != nil {
		return id, err
	}
	id.Admin = slices.Contains(a.o.Admins, id.User)
	if id.Method == MethodSSO && !id.Admin && len(a.o.AdminGroups) > 0 {
		groups := c.Get(a.o.SSO.GroupsHeader)
		id.Admin = slices.ContainsFunc(a.o.AdminGroups, func(g string) bool { return inGroups(groups, g) })
	}
	return id, nil
}

func (a *Authenticator) identify(c *fiber.Ctx, user string) (Identity, error) {
	if a.o.SSO.NameHeader != "" {
		if login := c.Get(a.o.SSO.NameHeader); login != "" {
			return a.ssoIdentity(c, login)
		}
	}
	if h := c.Get(fiber.HeaderAuthorization); h != "" {
		token, ok := strings.CutPrefix(h, "Bearer ")
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		u, ok := a.CheckToken(token)
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		return Identity{User: u.Name, Method: MethodBearer, bound: u.TokenHash}, nil
	}
	sid := c.Request().Header.Cookie(a.cookie)
	if len(sid) == 0 {
		return Identity{}, ErrNoCredentials
	}
	if !validSID(sid) {
		return Identity{}, ErrBadCredentials
	}
	sum := sha256.Sum256(sid)
	sess, ok := a.o.Store.LookupSum(sum)
	if !ok && user != "" {
		var err error
		if sess, ok, err = a.o.Store.Fetch(c.UserContext(), user, sum); err != nil {
			a.counter.WithLabelValues("session", "unavailable").Inc()
			return Identity{}, ErrSessionUnavailable
		}
	}
	if !ok {
		return Identity{}, ErrBadCredentials
	}
	return Identity{User: sess.User, Method: MethodCookie, sum: sum}, nil
}

// Valid reports whether id still holds: its session neither revoked nor
// expired, its account neither deleted nor replaced. Long-lived streams
// ask it until it says no, and then end.
func (a *Authenticator) Valid(id Identity) bool {
	if id.Method == MethodCookie {
		sess, ok := a.o.Store.LookupSum(id.sum)
		return ok && sess.User == id.User
	}
	u, ok := a.o.Users.Get(id.User)
	return ok && u.Value.DeletingSince.IsZero() && SecretEqual(u.Value.TokenHash, id.bound)
}

// CheckToken returns the account a bearer token belongs to.
func (a *Authenticator) CheckToken(token string) (state.User, bool) {
	user, ok := TokenUser(token)
	if !ok {
		return state.User{}, false
	}
	u, ok := a.o.Users.Get(user)
	if !ok || !u.Value.DeletingSince.IsZero() {
		return state.User{}, false
	}
	return u.Value, TokenMatches(token, u.Value.TokenHash)
}

// ssoIdentity admits an SSO user: allowed by AUTH_PROXY_ALLOW, mapped to
// an account name, and bound to the provider's stable id (the id header,
// else the login). The binding is the account's token hash, so an account
// created for one identity never opens for another. A user without an
// account yet gets *NoAccount: creating it is the account endpoints' job
// (accounts.Service), never a side effect of authenticating.
func (a *Authenticator) ssoIdentity(c *fiber.Ctx, login string) (Identity, error) {
	if !a.ssoAllowed(login, c.Get(a.o.SSO.GroupsHeader)) {
		a.counter.WithLabelValues("sso", "refused").Inc()
		a.Refused(c, events.AuditEvent{Kind: events.AuditSSORefused, Outcome: "not_allowed"})
		return Identity{}, ErrNotAllowed
	}
	name := SSOName(login)
	subject := "login:" + strings.ToLower(strings.TrimSpace(login))
	if a.o.SSO.IDHeader != "" {
		if id := strings.TrimSpace(c.Get(a.o.SSO.IDHeader)); id != "" {
			subject = "id:" + strings.ToLower(id)
		}
	}
	bound := HashHex("sso\x00" + subject)
	if u, ok := a.o.Users.Get(name); ok {
		if !u.Value.DeletingSince.IsZero() {
			return Identity{}, ErrBadCredentials
		}
		if !SecretEqual(u.Value.TokenHash, bound) {
			a.counter.WithLabelValues("sso", "bound_elsewhere").Inc()
			a.Refused(c, events.AuditEvent{Kind: events.AuditSSORefused, User: name, Outcome: "bound_elsewhere"})
			return Identity{}, ErrBoundElsewhere
		}
		return Identity{User: name, Method: MethodSSO, bound: bound}, nil
	}
	return Identity{}, &NoAccount{Name: name, Bound: bound}
}

// ssoAllowed applies AUTH_PROXY_ALLOW to a login and its groups.
func (a *Authenticator) ssoAllowed(login, groups string) bool {
	for _, a := range a.o.SSO.Allow {
		if g, ok := strings.CutPrefix(a, "group:"); ok {
			if inGroups(groups, g) {
				return true
			}
			continue
		}
		if a == "*" || strings.EqualFold(a, strings.TrimSpace(login)) {
			return true
		}
	}
	return false
}

// inGroups reports whether a comma-separated group list (the SSO proxy's
// header) holds g, in any case.
func inGroups(groups, g string) bool {
	for _, have := range strings.Split(groups, ",") {
		if strings.EqualFold(strings.TrimSpace(have), g) {
			return true
		}
	}
	return false
}

// ClientTag names the client in audit events without its address.
func ClientTag(c *fiber.Ctx) string { return HashHex(httpguard.Key(c))[:16] }

// Refused audits a refused request, at most once per client per window:
// a flood of refusals must not become a flood of audit events.
func (a *Authenticator) Refused(c *fiber.Ctx, e events.AuditEvent) {
	first, err := a.o.Limiter.Refused(context.Background(), httpguard.Key(c))
	if err != nil || !first {
		return
	}
	e.Client = ClientTag(c)
	a.o.Publisher.Audit(e)
}

// SecretEqual compares secrets without leaking where they differ.
func SecretEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}
