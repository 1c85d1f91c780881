// Package auth authenticates requests at the edge: opaque session
// cookies backed by the shared sessions bucket, bearer tokens checked
// against the account's token hash, and SSO headers from an authenticating
// proxy (admission, name mapping, binding to the provider's stable id). It
// also says whether an identity still holds (Valid) and whether it
// administers the gateway (bound to the account's identity, never its
// name alone), owns the shared auth rate limit, the budget of refusal
// audits and the credential formats. It writes nothing but sessions,
// rate-limit entries and audit events; accounts are created by the
// accounts package.
package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"slices"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Options wires an Authenticator.
type Options struct {
	Store   *Store
	Limiter *ratelimit.Limiter
	Users   *kv.Cache[state.User]
	// APITokens are users' named API tokens (a bounded cache: those
	// in use here, read on first use); nil: none are accepted.
	APITokens *kv.Cache[state.APIToken]
	// Publisher takes the audit events of refusals.
	Publisher *events.Publisher
	// RefusalAuditLimit (REFUSAL_AUDIT_LIMIT) is how many refusals all
	// edges together audit per window of the Limiter.
	RefusalAuditLimit int
	// CookieName is the session cookie's name (COOKIE_NAME).
	CookieName string
	SSO        SSO
	// Admins (ADMIN_USERS) are the accounts that may administer the
	// gateway, each bound to its identity; AdminGroups (ADMIN_GROUPS) the
	// SSO groups whose members may.
	Admins      []ident.Admin
	AdminGroups []string
	Metrics     prometheus.Registerer
	// Origins is sign-in on sandbox origins (subdomain mode); its zero
	// value is path mode.
	Origins Origins
	// SeenGroups, when set, is told the groups header (SSO.GroupsHeader)
	// of every request an SSO user authenticates with, so that the groups
	// the brokers apply budgets by follow the SSO provider's (the spend
	// package records them when they change).
	SeenGroups func(user, groups string)
}

// Authenticator resolves requests' identities.
type Authenticator struct {
	o      Options
	cookie string
	// userCookie names the cookie beside the session's that names its
	// user (UserCookie).
	userCookie string
	counter    *prometheus.CounterVec
	refusals   *refusalAudits
}

// New returns an Authenticator.
func New(o Options) *Authenticator {
	a := &Authenticator{o: o, cookie: o.CookieName, userCookie: UserCookie(o.CookieName), counter: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "aaas_edge_auth_total", Help: "Authentication and account endpoint outcomes.",
	}, []string{"endpoint", "outcome"})}
	o.Metrics.MustRegister(a.counter)
	a.refusals = newRefusalAudits(o.Limiter, o.RefusalAuditLimit, o.Publisher, o.Metrics)
	return a
}

// CookieName is the session cookie's name.
func (a *Authenticator) CookieName() string { return a.cookie }

// Counter counts outcomes by endpoint ("sso" is authentication's own).
func (a *Authenticator) Counter() *prometheus.CounterVec { return a.counter }

// Synced reports whether the caches authentication reads have started.
func (a *Authenticator) Synced() bool { return a.o.Users.IsSynced() }

// Store is the session store.
func (a *Authenticator) Store() *Store { return a.o.Store }

// Limiter is the shared auth rate limit.
func (a *Authenticator) Limiter() *ratelimit.Limiter { return a.o.Limiter }

// NoAccount is an SSO user admitted by AUTH_PROXY_ALLOW whose account does
// not exist yet: Name is the account to create, bound to Bound.
type NoAccount struct {
	Name, Bound string
}

func (e *NoAccount) Error() string {
	return "your account " + e.Name + " is created on the gateway's home page; open it first"
}

// Unwrap is the answer a request failing with e gets: 401, as the page
// asks the browser to sign in at the home page.
func (e *NoAccount) Unwrap() error { return web.Refuse(fiber.StatusUnauthorized, e.Error()) }

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
	// host is the sandbox host of a sandbox origin's session ("" for a
	// gateway session).
	host string
	// Admin: the account is one ADMIN_USERS binds (name and identity), or
	// an SSO user of a group in ADMIN_GROUPS.
	Admin bool
	// TokenName is the named API token a bearer request came with ("" for
	// the account's token). Such a request never administers (its hash
	// is not the account's identity) and may not manage tokens.
	TokenName string
}

// Authentication failures.
var (
	ErrNoCredentials  error = web.Refuse(fiber.StatusUnauthorized, "sign in first")
	ErrBadCredentials error = web.Refuse(fiber.StatusUnauthorized, "invalid or expired credentials")
	// ErrNotAllowed: SSO knows the user, AUTH_PROXY_ALLOW does not.
	ErrNotAllowed error = web.Refuse(fiber.StatusForbidden, "your sign-in is not allowed on this gateway; ask its operators to add you to AUTH_PROXY_ALLOW")
	// ErrBoundElsewhere: the account belongs to another identity (a login
	// renamed and registered again by someone else).
	ErrBoundElsewhere error = web.Refuse(fiber.StatusForbidden, "this account belongs to another identity at your sign-in provider; ask the gateway's operators")
	// ErrUnavailable and ErrTimeout are the account endpoints' answers
	// when the bus or lifecycle does not answer.
	ErrUnavailable error = web.Unavailable(nil)
	ErrTimeout     error = web.Refuse(fiber.StatusServiceUnavailable, "your request is taking longer than expected; try again in a moment")
	// ErrSessionUnavailable: the cookie is not known here yet and the
	// session bucket could not be asked.
	ErrSessionUnavailable error = web.Refuse(fiber.StatusServiceUnavailable, "your session cannot be checked right now; try again in a moment")
)

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
	// A sandbox origin's session administers nothing: no admin route is
	// served there, and its rights must not outlive the page they came on.
	httpguard.SetUser(c, id.User)
	id.Admin = id.host == "" && a.admin(httpguard.Context(c), id)
	if id.Method == MethodSSO && !id.Admin && len(a.o.AdminGroups) > 0 {
		groups := c.Get(a.o.SSO.GroupsHeader)
		id.Admin = slices.ContainsFunc(a.o.AdminGroups, func(g string) bool { return inGroups(groups, g) })
	}
	return id, nil
}

func (a *Authenticator) identify(c *fiber.Ctx, user string) (Identity, error) {
	// On a sandbox origin the SSO header is not believed: identity there
	// comes from the origin's own session or a bearer token, never from a
	// header the SSO proxy in front of the gateway sets.
	origin := httpguard.Get(c).OnSandboxDomain
	if a.o.SSO.NameHeader != "" && !origin {
		if login := c.Get(a.o.SSO.NameHeader); login != "" {
			return a.ssoIdentity(c, login)
		}
	}
	// One credential per request: servers and proxies read a second
	// Authorization header each their own way (the first, the last, both).
	if len(c.Request().Header.PeekAll(fiber.HeaderAuthorization)) > 1 {
		return Identity{}, ErrBadCredentials
	}
	if h := c.Get(fiber.HeaderAuthorization); h != "" {
		token, ok := strings.CutPrefix(h, "Bearer ")
		if !ok {
			return Identity{}, ErrBadCredentials
		}
		if u, ok := a.CheckToken(httpguard.Context(c), token); ok {
			return Identity{User: u.Name, Method: MethodBearer, bound: u.TokenHash}, nil
		}
		if u, t, ok := a.checkAPIToken(httpguard.Context(c), token); ok {
			return Identity{User: u.Name, Method: MethodBearer, bound: t.Hash, TokenName: t.Name}, nil
		}
		return Identity{}, ErrBadCredentials
	}
	if origin {
		return a.sandboxIdentity(c, user)
	}
	sess, sum, err := a.session(c, a.cookie, a.userCookie, user)
	if err != nil {
		return Identity{}, err
	}
	// A sandbox origin's session id is never a gateway session's.
	if sess.Host != "" {
		return Identity{}, ErrBadCredentials
	}
	return Identity{User: sess.User, Method: MethodCookie, sum: sum}, nil
}

// session resolves the session the cookie name carries: from this edge's
// cache, or, for one it does not hold, from the bucket under the user the
// cookie userName names (else the one the request names; with neither,
// under any), so a session made on another edge, or never used here,
// works here too. A session of another user than userName's is refused.
func (a *Authenticator) session(c *fiber.Ctx, name, userName, user string) (state.Session, [32]byte, error) {
	sid := c.Request().Header.Cookie(name)
	if len(sid) == 0 {
		return state.Session{}, [32]byte{}, ErrNoCredentials
	}
	if !ident.ValidSecret(sid) {
		return state.Session{}, [32]byte{}, ErrBadCredentials
	}
	var named []byte
	if userName != "" {
		named = c.Request().Header.Cookie(userName)
	}
	sum := sha256.Sum256(sid)
	sess, ok := a.o.Store.LookupSum(sum)
	if !ok {
		if u := string(named); ident.ValidUser(u) {
			user = u
		}
		var err error
		if sess, ok, err = a.o.Store.Fetch(c.UserContext(), httpguard.Key(c), user, sum); err != nil {
			a.counter.WithLabelValues("session", "unavailable").Inc()
			return state.Session{}, sum, ErrSessionUnavailable
		}
	}
	if !ok || len(named) > 0 && string(named) != sess.User {
		return state.Session{}, sum, ErrBadCredentials
	}
	return sess, sum, nil
}

// Valid reports whether id still holds: its session neither revoked nor
// expired, its account neither deleted nor replaced. Long-lived streams
// ask it until it says no, and then end.
func (a *Authenticator) Valid(id Identity) bool {
	if id.Method == MethodCookie {
		sess, ok := a.o.Store.LookupSum(id.sum)
		return ok && sess.User == id.User && sess.Host == id.host && (sess.Host == "" || a.parentHolds(nil, sess))
	}
	// Not a request's: a live exchange's periodic check, of a user this
	// edge served (held, unless forgotten since: then read again).
	u, ok := a.o.Users.Load(context.Background(), id.User)
	if id.TokenName != "" {
		t, found := a.o.APITokens.Load(context.Background(), state.APITokenKey(id.User, id.TokenName))
		return ok && found && SecretEqual(t.Value.Hash, id.bound) && t.Value.Holds(u.Value, time.Now())
	}
	return ok && u.Value.DeletingSince.IsZero() && SecretEqual(u.Value.TokenHash, id.bound)
}

// CheckToken returns the account a bearer token belongs to.
func (a *Authenticator) CheckToken(ctx context.Context, token string) (state.User, bool) {
	user, ok := ident.TokenUser(token)
	if !ok {
		return state.User{}, false
	}
	u, ok := a.o.Users.Load(ctx, user)
	if !ok || !u.Value.DeletingSince.IsZero() {
		return state.User{}, false
	}
	return u.Value, ident.TokenMatches(token, u.Value.TokenHash)
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
	// login is a view of the request's header bytes, which the server
	// reuses; the name outlives the request (beacons, caches, streams).
	name := strings.Clone(ident.SSOName(login))
	subject := "login:" + strings.ToLower(strings.TrimSpace(login))
	if a.o.SSO.IDHeader != "" {
		if id := strings.TrimSpace(c.Get(a.o.SSO.IDHeader)); id != "" {
			subject = "id:" + strings.ToLower(id)
		}
	}
	bound := ident.HashHex("sso\x00" + subject)
	if u, ok := a.o.Users.Load(httpguard.Context(c), name); ok {
		if !u.Value.DeletingSince.IsZero() {
			return Identity{}, ErrBadCredentials
		}
		if !SecretEqual(u.Value.TokenHash, bound) {
			a.counter.WithLabelValues("sso", "bound_elsewhere").Inc()
			a.Refused(c, events.AuditEvent{Kind: events.AuditSSORefused, User: name, Outcome: "bound_elsewhere"})
			return Identity{}, ErrBoundElsewhere
		}
		if a.o.SeenGroups != nil && a.o.SSO.GroupsHeader != "" {
			a.o.SeenGroups(name, c.Get(a.o.SSO.GroupsHeader))
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

// Member returns whether id, authenticated on request c, is in a group:
// an SSO user's groups are the SSO proxy's header on c (read while c is
// served); any other user is in none. It is valid while c is.
func (a *Authenticator) Member(c *fiber.Ctx, id Identity) func(group string) bool {
	if id.Method != MethodSSO || a.o.SSO.GroupsHeader == "" {
		return func(string) bool { return false }
	}
	groups := c.Get(a.o.SSO.GroupsHeader)
	return func(g string) bool { return inGroups(groups, g) }
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

// admin reports whether id's account is one ADMIN_USERS binds: its name
// and its identity (the token hash: the bearer's or SSO binding's, or for
// a session the current account's), so an account made later under an
// administrator's name, by whoever, administers nothing.
// Administers reports whether the account u, signing in by its token,
// is one ADMIN_USERS binds: the rights its gateway session will carry.
func (a *Authenticator) Administers(u state.User) bool {
	// A bearer's rights need no read: the account is at hand.
	return a.admin(context.Background(), Identity{User: u.Name, Method: MethodBearer, bound: u.TokenHash})
}

func (a *Authenticator) admin(ctx context.Context, id Identity) bool {
	identity := id.bound
	if id.Method == MethodCookie {
		u, ok := a.o.Users.Load(ctx, id.User)
		if !ok || !u.Value.DeletingSince.IsZero() {
			return false
		}
		identity = u.Value.TokenHash
	}
	return identity != "" && slices.ContainsFunc(a.o.Admins, func(ad ident.Admin) bool {
		return ad.Name == id.User && SecretEqual(ad.Identity, identity)
	})
}

// ClientTag names the client in audit events without its address.
func ClientTag(c *fiber.Ctx) string { return ident.HashHex(httpguard.Key(c))[:16] }

// Refused audits a refused request, at most once per client per window
// and within the refusal audit budget all edges share: a flood of
// refusals, from however many addresses, must not become a flood of audit
// events.
func (a *Authenticator) Refused(c *fiber.Ctx, e events.AuditEvent) {
	first, err := a.o.Limiter.Refused(httpguard.Context(c), httpguard.Key(c))
	if err != nil || !first {
		return
	}
	a.AuditRefusal(c, e)
}

// AuditRefusal audits the client's first refusal in a window (as the
// Limiter's Verdict.Audit says) within the shared budget, naming the
// client by its tag.
func (a *Authenticator) AuditRefusal(c *fiber.Ctx, e events.AuditEvent) {
	e.Client, e.RequestID = ClientTag(c), httpguard.RequestID(c)
	a.refusals.audit(e)
}

// SecretEqual compares secrets without leaking where they differ.
func SecretEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}
