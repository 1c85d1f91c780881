package auth_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// people is the fixture's accounts: tokens, sessions and SSO bindings.
type people struct {
	plain, sso, ssoAny *fiber.App
	a                  *auth.Authenticator // the plain edge's
	store              *auth.Store
	users              *kv.Bucket[state.User]
	tokens, sessions   map[string]string
}

// ssoBinding is what an SSO account is bound to: the provider's stable id
// (the id header), as README's Administration section tells operators to
// compute it for ADMIN_USERS.
func ssoBinding(id string) string { return ident.HashHex("sso\x00id:" + strings.ToLower(id)) }

// README's shell formula for an SSO account's identity gives what the
// edge binds the account to.
func TestSSOBindingIsREADMEs(t *testing.T) {
	// printf 'sso\0id:%s' gus@old.example | sha256sum
	const readme = "17369956ab64f23c04a395c45cc3b843deb42f211a7dc5909e165a40855444c6"
	if got := ssoBinding("Gus@Old.example"); got != readme {
		t.Fatalf("binding %s, README's formula gives %s", got, readme)
	}
}

// newPeople is a real NATS server holding the accounts bob, ops (an
// administrator by ADMIN_USERS), ann (whose name ADMIN_USERS binds to
// another identity: the account made under an administrator's name by
// someone else), del (being deleted), and the SSO accounts gus (bound to
// gus@old.example and an administrator) and hal; a session for each token
// account; and three edges' fiber apps that answer GET /who with the
// identity Authenticate finds: without SSO, with SSO admitting some, and
// with SSO admitting everyone.
func newPeople(t *testing.T) *people {
	t.Helper()
	js := bus(t)
	ctx := natstest.Context(t, time.Minute)
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	p := &people{store: newStore(t, ctx, js, 10), tokens: map[string]string{}, sessions: map[string]string{}}
	var err error
	if p.users, err = kv.Open[state.User](ctx, js, state.BucketUsers); err != nil {
		t.Fatal(err)
	}
	put := func(u state.User) {
		if _, err := p.users.Put(ctx, u.Name, u); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"bob", "ops", "ann", "del"} {
		p.tokens[name] = ident.NewToken(name)
		u := state.User{Name: name, TokenHash: ident.HashHex(p.tokens[name]), Managed: true, Created: time.Now()}
		if name == "del" {
			u.DeletingSince = time.Now()
		}
		put(u)
		if p.sessions[name], err = p.store.Create(ctx, name, "login"); err != nil {
			t.Fatal(err)
		}
	}
	put(state.User{Name: "gus", TokenHash: ssoBinding("gus@old.example"), Managed: true})
	put(state.User{Name: "hal", TokenHash: ssoBinding("hal@acme.example"), Managed: true})
	cache, err := kv.NewCache(ctx, p.users, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if cache.Len() != 6 || p.store.Len() != 4 {
			return fmt.Errorf("caches hold %d accounts, %d sessions", cache.Len(), p.store.Len())
		}
		return nil
	})
	lim, err := ratelimit.New(ctx, js, 30, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	admins := []ident.Admin{
		{Name: "ops", Identity: ident.HashHex(p.tokens["ops"])},
		{Name: "ann", Identity: ident.HashHex(ident.NewToken("ann"))},
		{Name: "gus", Identity: ssoBinding("gus@old.example")},
	}
	edge := func(sso auth.SSO, groups []string) (*fiber.App, *auth.Authenticator) {
		a := auth.New(auth.Options{Store: p.store, Limiter: lim, Users: cache, Publisher: events.NewPublisher(js, "edge-test", slog.New(slog.DiscardHandler)),
			RefusalAuditLimit: 100, CookieName: "sid", SSO: sso, Admins: admins, AdminGroups: groups, Metrics: prometheus.NewRegistry()})
		clients, err := httpguard.NewPolicy(httpguard.Options{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/32")}, PublicHosts: []string{"*"}})
		if err != nil {
			t.Fatal(err)
		}
		app := fiber.New(fiber.Config{DisableStartupMessage: true})
		app.Use(clients.Middleware)
		app.Get("/who", func(c *fiber.Ctx) error {
			id, err := a.Authenticate(c)
			var missing *auth.NoAccount
			switch {
			case errors.As(err, &missing):
				return c.Status(web.AsError(err).Status).JSON(fiber.Map{"no_account": missing.Name, "bound": missing.Bound})
			case err != nil:
				return c.Status(web.AsError(err).Status).JSON(fiber.Map{"error": err.Error()})
			}
			return c.JSON(fiber.Map{"user": id.User, "method": id.Method, "admin": id.Admin, "bound": id.Bound(), "ambient": id.Ambient()})
		})
		return app, a
	}
	sso := auth.SSO{NameHeader: "X-Forwarded-User", IDHeader: "X-Forwarded-Email", GroupsHeader: "X-Forwarded-Groups"}
	p.plain, p.a = edge(auth.SSO{}, nil)
	sso.Allow = []string{"gus", "hal", "AliceSmith", "group:acme:devs"}
	p.sso, _ = edge(sso, []string{"acme:ops"})
	sso.Allow = []string{"*"}
	p.ssoAny, _ = edge(sso, nil)
	return p
}

// who asks app who the headers (name, value, ...) authenticate as.
func who(t *testing.T, app *fiber.App, headers ...string) (int, map[string]any) {
	t.Helper()
	req := httptest.NewRequest(http.MethodGet, "/who", nil)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := app.Test(req, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatalf("undecodable answer: %v", err)
	}
	return resp.StatusCode, body
}

// Authenticate, table-driven at the fiber level (tests review T26): SSO
// header first when SSO is on, else a bearer token, else the cookie;
// explicit credentials that fail never fall back to the cookie; SSO
// admits whom AUTH_PROXY_ALLOW names, maps and binds; and administrators
// are the accounts ADMIN_USERS binds by identity (security review S7),
// or with SSO members of ADMIN_GROUPS.
func TestAuthenticate(t *testing.T) {
	p := newPeople(t)
	bearer := func(user string) string { return "Bearer " + p.tokens[user] }
	cookie := func(user string) string { return "sid=" + p.sessions[user] + "; sid_user=" + user }
	other := "bob." + strings.Repeat("A", 43)
	for _, tt := range []struct {
		name    string
		app     *fiber.App
		headers []string
		status  int
		// want is the answer's fields that must match (user, method,
		// admin, bound, ambient, no_account, error).
		want map[string]any
	}{
		{"no credentials", p.plain, nil, 401, map[string]any{"error": "sign in first"}},
		{"a bearer token", p.plain, []string{"Authorization", bearer("bob")}, 200, map[string]any{"user": "bob", "method": "bearer", "admin": false, "bound": ident.HashHex(p.tokens["bob"]), "ambient": false}},
		{"another scheme", p.plain, []string{"Authorization", "Basic Ym9iOmJvYg=="}, 401, map[string]any{"error": "invalid or expired credentials"}},
		{"a wrong secret", p.plain, []string{"Authorization", "Bearer " + other}, 401, nil},
		{"a token relabelled to another account", p.plain, []string{"Authorization", "Bearer " + strings.Replace(p.tokens["bob"], "bob.", "ann.", 1)}, 401, nil},
		{"a token of an account being deleted", p.plain, []string{"Authorization", bearer("del")}, 401, nil},
		{"a token that is not one", p.plain, []string{"Authorization", "Bearer " + p.sessions["bob"]}, 401, nil},
		{"the administrator's token", p.plain, []string{"Authorization", bearer("ops")}, 200, map[string]any{"user": "ops", "admin": true}},
		{"the token of an account under an administrator's name, not its identity", p.plain, []string{"Authorization", bearer("ann")}, 200, map[string]any{"user": "ann", "admin": false}},
		{"a session cookie", p.plain, []string{"Cookie", cookie("bob")}, 200, map[string]any{"user": "bob", "method": "cookie", "admin": false, "bound": "", "ambient": true}},
		{"the administrator's session", p.plain, []string{"Cookie", cookie("ops")}, 200, map[string]any{"user": "ops", "admin": true}},
		{"a session of the account under an administrator's name", p.plain, []string{"Cookie", cookie("ann")}, 200, map[string]any{"user": "ann", "admin": false}},
		{"a session of an account being deleted", p.plain, []string{"Cookie", cookie("del")}, 200, map[string]any{"user": "del", "admin": false}},
		{"a cookie of the wrong shape", p.plain, []string{"Cookie", "sid=" + p.sessions["bob"][:42]}, 401, map[string]any{"error": "invalid or expired credentials"}},
		{"an unknown cookie", p.plain, []string{"Cookie", "sid=" + strings.Repeat("A", 43)}, 401, nil},
		{"a session cookie beside a cookie naming another account", p.plain, []string{"Cookie", "sid=" + p.sessions["bob"] + "; sid_user=ann"}, 401, map[string]any{"error": "invalid or expired credentials"}},
		{"a session cookie beside a user cookie no account can have", p.plain, []string{"Cookie", "sid=" + p.sessions["bob"] + "; sid_user=" + strings.Repeat("x", 200)}, 401, nil},
		{"a session cookie alone (set by an earlier release)", p.plain, []string{"Cookie", "sid=" + p.sessions["bob"]}, 200, map[string]any{"user": "bob", "method": "cookie"}},
		{"a failing token never falls back to the cookie", p.plain, []string{"Authorization", "Bearer " + other, "Cookie", cookie("ops")}, 401, nil},
		{"a token before the cookie", p.plain, []string{"Authorization", bearer("bob"), "Cookie", cookie("ops")}, 200, map[string]any{"user": "bob", "admin": false}},
		{"SSO headers at an edge without SSO", p.plain, []string{"X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@old.example"}, 401, map[string]any{"error": "sign in first"}},
		{"SSO headers beside a token at an edge without SSO", p.plain, []string{"X-Forwarded-User", "ops", "X-Forwarded-Groups", "acme:ops", "Authorization", bearer("bob")}, 200, map[string]any{"user": "bob", "admin": false}},

		{"an SSO user with an account, an administrator by binding", p.sso, []string{"X-Forwarded-User", "GUS", "X-Forwarded-Email", "Gus@Old.example"}, 200, map[string]any{"user": "gus", "method": "sso", "admin": true, "bound": ssoBinding("gus@old.example"), "ambient": true}},
		{"the login with another identity", p.sso, []string{"X-Forwarded-User", "gus", "X-Forwarded-Email", "newcomer@example.com"}, 403, map[string]any{"error": auth.ErrBoundElsewhere.Error()}},
		{"the login without its id: bound by login, not the account's", p.sso, []string{"X-Forwarded-User", "gus"}, 403, nil},
		{"SSO before a token", p.sso, []string{"X-Forwarded-User", "hal", "X-Forwarded-Email", "hal@acme.example", "Authorization", bearer("ops")}, 200, map[string]any{"user": "hal", "method": "sso", "admin": false}},
		{"a member of ADMIN_GROUPS, in any case", p.sso, []string{"X-Forwarded-User", "hal", "X-Forwarded-Email", "hal@acme.example", "X-Forwarded-Groups", "acme:devs, ACME:OPS"}, 200, map[string]any{"user": "hal", "admin": true}},
		{"a member of other groups", p.sso, []string{"X-Forwarded-User", "hal", "X-Forwarded-Email", "hal@acme.example", "X-Forwarded-Groups", "acme:opsx,ops"}, 200, map[string]any{"user": "hal", "admin": false}},
		{"a login AUTH_PROXY_ALLOW does not name", p.sso, []string{"X-Forwarded-User", "mallory", "X-Forwarded-Email", "m@evil.example", "X-Forwarded-Groups", "acme,evil:devs"}, 403, map[string]any{"error": auth.ErrNotAllowed.Error()}},
		{"an allowed login in another case, without an account yet", p.sso, []string{"X-Forwarded-User", "ALICESMITH", "X-Forwarded-Email", "alice@acme.example"}, 401, map[string]any{"no_account": "alicesmith", "bound": ssoBinding("alice@acme.example")}},
		{"a group member whose login is no account name", p.sso, []string{"X-Forwarded-User", "Carol.Jones", "X-Forwarded-Groups", "other, acme:devs"}, 401, map[string]any{"no_account": ident.SSOName("Carol.Jones"), "bound": ident.HashHex("sso\x00login:carol.jones")}},
		{"everyone, with AUTH_PROXY_ALLOW=*", p.ssoAny, []string{"X-Forwarded-User", "mallory", "X-Forwarded-Email", "m@evil.example"}, 401, map[string]any{"no_account": "mallory"}},
		{"ADMIN_GROUPS unset: groups confer nothing", p.ssoAny, []string{"X-Forwarded-User", "hal", "X-Forwarded-Email", "hal@acme.example", "X-Forwarded-Groups", "acme:ops"}, 200, map[string]any{"user": "hal", "admin": false}},
		{"an empty SSO header: the next credentials", p.sso, []string{"X-Forwarded-User", "", "Authorization", bearer("ops")}, 200, map[string]any{"user": "ops", "method": "bearer", "admin": true}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			status, body := who(t, tt.app, tt.headers...)
			if status != tt.status {
				t.Fatalf("status %d, want %d: %v", status, tt.status, body)
			}
			for k, v := range tt.want {
				if body[k] != v {
					t.Errorf("%s = %v, want %v (%v)", k, body[k], v, body)
				}
			}
		})
	}
}

// Administrator rights follow the account, not the name (security review
// S7): once the administrator's account is deleted, an account made under
// its name by someone else is no administrator, by token or by session;
// while the administrator's own account is being deleted, nothing it holds
// administers either.
func TestAdminRightsStayWithTheAccount(t *testing.T) {
	p := newPeople(t)
	ctx := natstest.Context(t, time.Minute)
	if _, body := who(t, p.plain, "Authorization", "Bearer "+p.tokens["ops"]); body["admin"] != true {
		t.Fatalf("the administrator is none: %v", body)
	}
	// ops is deleted; someone else signs up as ops.
	if err := p.users.Delete(ctx, "ops", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := p.store.RevokeAll(ctx, "ops"); err != nil {
		t.Fatal(err)
	}
	squatter := ident.NewToken("ops")
	if _, err := p.users.Put(ctx, "ops", state.User{Name: "ops", TokenHash: ident.HashHex(squatter), Managed: true, Created: time.Now()}); err != nil {
		t.Fatal(err)
	}
	sid, err := p.store.Create(ctx, "ops", "signup")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if status, body := who(t, p.plain, "Authorization", "Bearer "+squatter); status != 200 {
			return fmt.Errorf("the new ops's token: %d %v", status, body)
		}
		return nil
	})
	for what, h := range map[string][]string{"token": {"Authorization", "Bearer " + squatter}, "session": {"Cookie", "sid=" + sid}} {
		if status, body := who(t, p.plain, h...); status != 200 || body["user"] != "ops" || body["admin"] != false {
			t.Errorf("the new ops by %s: %d %v, want an account that administers nothing", what, status, body)
		}
	}
	if status, _ := who(t, p.plain, "Authorization", "Bearer "+p.tokens["ops"]); status != 401 {
		t.Errorf("the deleted administrator's token still opens the account: %d", status)
	}
}

// CheckToken finds a token's account: only the account the token names,
// only with the token's own secret, never an account being deleted.
func TestCheckToken(t *testing.T) {
	p := newPeople(t)
	for _, tt := range []struct {
		name, token, want string
	}{
		{"bob's token", p.tokens["bob"], "bob"},
		{"a wrong secret", "bob." + strings.Repeat("x", 43), ""},
		{"bob's secret under ann", strings.Replace(p.tokens["bob"], "bob.", "ann.", 1), ""},
		{"an account being deleted", p.tokens["del"], ""},
		{"no such account", ident.NewToken("zed"), ""},
		{"no secret", "bob.", ""},
		{"a session id", p.sessions["bob"], ""},
		{"an SSO account's binding as a secret", "gus." + ssoBinding("gus@old.example")[:43], ""},
		{"empty", "", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			u, ok := p.a.CheckToken(context.Background(), tt.token)
			if ok != (tt.want != "") || ok && u.Name != tt.want {
				t.Fatalf("CheckToken = %q %v, want %q", u.Name, ok, tt.want)
			}
		})
	}
}

// Valid keeps an identity while what it rests on holds: a cookie's
// session, a token's or SSO binding's account unchanged and not being
// deleted.
func TestValid(t *testing.T) {
	p := newPeople(t)
	ctx := natstest.Context(t, time.Minute)
	identity := func(h ...string) auth.Identity {
		t.Helper()
		var id auth.Identity
		app := fiber.New(fiber.Config{DisableStartupMessage: true})
		app.Get("/", func(c *fiber.Ctx) error {
			var err error
			id, err = p.a.Authenticate(c)
			return err
		})
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set(h[0], h[1])
		if resp, err := app.Test(r, -1); err != nil || resp.StatusCode != 200 {
			t.Fatalf("authenticate %v: %v %v", h, resp, err)
		}
		return id
	}
	byCookie := identity("Cookie", "sid="+p.sessions["bob"])
	byToken := identity("Authorization", "Bearer "+p.tokens["bob"])
	if !p.a.Valid(byCookie) || !p.a.Valid(byToken) {
		t.Fatal("fresh identities are not valid")
	}
	if err := p.store.Revoke(ctx, "bob", sumOf(p.sessions["bob"])); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if p.a.Valid(byCookie) {
			return errors.New("a revoked session is still valid")
		}
		return nil
	})
	if !p.a.Valid(byToken) {
		t.Fatal("revoking a session ended the token's identity")
	}
	if _, err := p.users.Put(ctx, "bob", state.User{Name: "bob", TokenHash: ident.HashHex(ident.NewToken("bob")), Managed: true}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if p.a.Valid(byToken) {
			return errors.New("a token is still valid for an account made anew under its name")
		}
		return nil
	})
}
