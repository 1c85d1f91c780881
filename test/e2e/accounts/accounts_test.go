// Package accounts tests the edge's account and session behaviour as a
// browser or API client sees it: real edge processes, lifecycle, NATS and
// devcluster.
package accounts_test

import (
	"bytes"
	"fmt"
	"maps"
	"net/http"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

const invite = "let-me-in"

// newStack is a stack whose signups need the invite, with one lifecycle
// worker.
func newStack(t testing.TB) *testenv.Stack {
	return pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite}, Lifecycle: "lc-a"})
}

func expect(t *testing.T, r *testenv.Response, status int, what string) {
	t.Helper()
	if r.StatusCode != status {
		t.Fatalf("%s: status %d, want %d (%s)", what, r.StatusCode, status, r.Body)
	}
}

func TestSignupRefusesBadInputAndCreatesNothing(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)

	names := []string{"", "a", strings.Repeat("x", 33), "Bob", "..", "../etc", "b%2e%2e", "bоb", "dsh-bob", "dsh", "-bob", "bob-", "b--b", "admin", "bob.", "b b"}
	for _, n := range names {
		r := c.Form("/users", "user", n, "invite", invite)
		expect(t, r, http.StatusBadRequest, fmt.Sprintf("name %q", n))
		if !strings.Contains(string(r.Body), "user names are") {
			t.Fatalf("name %q: unclear message %s", n, r.Body)
		}
	}
	big := bytes.Repeat([]byte("a"), 9000)
	expect(t, c.Do("POST", "/users", bytes.NewReader(big), "Content-Type", "application/x-www-form-urlencoded"), http.StatusRequestEntityTooLarge, "oversized body")
	expect(t, c.Do("POST", "/users", strings.NewReader("user=bob"), "Content-Type", "text/plain", "Accept", "application/json"), http.StatusUnsupportedMediaType, "text/plain")
	expect(t, c.Do("POST", "/users", strings.NewReader("user=bob"), "Content-Type", "", "Accept", "application/json"), http.StatusUnsupportedMediaType, "no content type")
	expect(t, c.Do("POST", "/users", strings.NewReader(`{"user":"bob","invite":"`+invite+`","admin":true}`), "Content-Type", "application/json"), http.StatusBadRequest, "unknown JSON field")
	expect(t, c.Do("POST", "/users", strings.NewReader(`{"user":`), "Content-Type", "application/json"), http.StatusBadRequest, "malformed JSON")
	expect(t, c.Do("POST", "/users", strings.NewReader("user=bob&user=eve&invite="+invite), "Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json"), http.StatusBadRequest, "repeated field")
	expect(t, c.Form("/users", "user", "bob"), http.StatusForbidden, "missing invite")
	expect(t, c.Form("/users", "user", "bob", "invite", "let-me-inn"), http.StatusForbidden, "wrong invite")
	expect(t, c.Do("POST", "/users", strings.NewReader("user=bob&invite="+invite), "Content-Type", "application/x-www-form-urlencoded", "Origin", "https://evil.example"), http.StatusForbidden, "foreign origin")
	if n := w.Claims(); n != 0 {
		t.Fatalf("%d claims after only bad requests", n)
	}
	if count(auditEvents(t, w), kind(events.AuditInviteRejected, "")) == 0 {
		t.Fatal("no audit event for the rejected invites")
	}

	// The header form of the invite works; the name is then taken.
	r := c.Do("POST", "/users", strings.NewReader(`{"user":"bob"}`), "Content-Type", "application/json", "X-Signup-Invite", invite)
	expect(t, r, http.StatusCreated, "signup with X-Signup-Invite")
	body := r.JSON()
	if body["state"] != "Ready" || body["url"] != "/u/bob/" || !strings.HasPrefix(body["token"].(string), "bob.") {
		t.Fatalf("signup body %s", r.Body)
	}
	expect(t, testenv.NewClient(t, edge.URL).Form("/users", "user", "bob", "invite", invite), http.StatusConflict, "second signup")
	if n := w.Claims(); n != 1 {
		t.Fatalf("%d claims, want 1", n)
	}
}

func TestFormSignupLoginLogoutDeleteRecreate(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", nil)
	browser := testenv.NewClient(t, edge.URL)

	// A browser form: 303 to the sandbox with the session cookie.
	r := browser.Do("POST", "/users", strings.NewReader("user=carol&invite="+invite), "Content-Type", "application/x-www-form-urlencoded")
	expect(t, r, http.StatusSeeOther, "form signup")
	if loc := r.Header.Get("Location"); loc != "/u/carol/" {
		t.Fatalf("Location %q", loc)
	}
	ck := browser.Cookie("dsh_gw_session")
	if ck == nil || len(ck.Value) != 43 {
		t.Fatalf("no session cookie: %v", r.Header.Values("Set-Cookie"))
	}
	setCookie := r.Header.Get("Set-Cookie")
	for _, attr := range []string{"HttpOnly", "SameSite=Lax", "path=/"} {
		if !strings.Contains(strings.ToLower(setCookie), strings.ToLower(attr)) {
			t.Fatalf("cookie lacks %s: %s", attr, setCookie)
		}
	}
	expect(t, browser.Do("GET", "/_/status", nil), http.StatusOK, "status with cookie")

	// An API client with the token; the cookie value is not a token.
	api := testenv.NewClient(t, edge.URL)
	token := api.Signup("dora", invite)
	expect(t, api.Do("GET", "/_/status", nil, "Authorization", "Bearer "+token), http.StatusOK, "bearer")
	expect(t, api.Do("GET", "/_/status", nil, "Authorization", "Bearer "+ck.Value, "Cookie", ""), http.StatusUnauthorized, "cookie value as bearer")
	expect(t, api.Do("GET", "/_/status", nil, "Authorization", "Bearer "+strings.Replace(token, "dora.", "carol.", 1)), http.StatusUnauthorized, "token moved to another user")

	// Login with the token from a second browser.
	second := testenv.NewClient(t, edge.URL)
	r = second.Do("POST", "/login", strings.NewReader("token="+token), "Content-Type", "application/x-www-form-urlencoded")
	expect(t, r, http.StatusSeeOther, "login")
	expect(t, second.Do("GET", "/_/status", nil), http.StatusOK, "status after login")
	expect(t, testenv.NewClient(t, edge.URL).Form("/login", "token", "dora.wrongwrongwrongwrongwrongwrongwrongwron"), http.StatusUnauthorized, "bad token")

	// carol cannot act on dora.
	expect(t, browser.Do("DELETE", "/users/dora", nil), http.StatusForbidden, "delete someone else")
	// Cookie-authenticated mutations need our Origin.
	expect(t, browser.Do("POST", "/logout", nil, "Origin", ""), http.StatusForbidden, "logout without Origin")
	expect(t, browser.Do("POST", "/logout", nil, "Origin", "http://evil.example"), http.StatusForbidden, "cross-origin logout")
	expect(t, browser.Do("DELETE", "/users/carol", nil, "Origin", "http://evil.example"), http.StatusForbidden, "cross-origin delete")
	expect(t, browser.Do("POST", "/recreate", nil, "Origin", "", "Referer", edge.URL+"/"), http.StatusSeeOther, "recreate with a same-origin Referer")

	// Logout revokes the session on the server, not only in the browser.
	stolen := browser.Cookie("dsh_gw_session").Value
	expect(t, browser.Do("POST", "/logout", nil), http.StatusSeeOther, "logout")
	thief := testenv.NewClient(t, edge.URL)
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := thief.Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+stolen); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("revoked cookie: %d", r.StatusCode)
		}
		return nil
	})

	// Recreate signs out every session but the caller's.
	r = api.Do("POST", "/recreate", nil, "Authorization", "Bearer "+token)
	expect(t, r, http.StatusAccepted, "recreate by token")
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := second.Do("GET", "/_/status", nil); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("session survived recreate: %d", r.StatusCode)
		}
		return nil
	})
	expect(t, api.Do("GET", "/_/status", nil, "Authorization", "Bearer "+token), http.StatusOK, "token after recreate")

	// Through to dora's sandbox with the token: the edge's log of this
	// request is the positive control of the logs' secret check below.
	expect(t, api.WithTimeout(3*time.Minute).Do("GET", "/u/dora/api/echo", nil, "Authorization", "Bearer "+token), http.StatusOK, "dora's sandbox")

	// Delete: own account only, claim gone, token dead.
	expect(t, api.Do("DELETE", "/users/dora", nil, "Authorization", "Bearer "+token), http.StatusNoContent, "delete")
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := api.Do("GET", "/_/status", nil, "Authorization", "Bearer "+token); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("token after delete: %d", r.StatusCode)
		}
		return nil
	})
	testutil.Eventually(t, time.Minute, func() error {
		if n := w.Claims(); n != 1 { // carol's
			return fmt.Errorf("%d claims", n)
		}
		return nil
	})

	evs := auditEvents(t, w)
	for _, want := range []struct {
		k    events.AuditKind
		user string
	}{{events.AuditSignup, "carol"}, {events.AuditSignup, "dora"}, {events.AuditLogin, "dora"}, {events.AuditLogout, "carol"}, {events.AuditRecreate, "dora"}, {events.AuditDelete, "dora"}} {
		if count(evs, kind(want.k, want.user)) == 0 {
			t.Errorf("no %s audit event for %s", want.k, want.user)
		}
	}
	// The secrets are absent from the audit trail and the edge's log, and
	// both demonstrably hold this test's flow: the events above, and
	// the edge's access line for her proxied request (made with the token).
	audit, logs := w.AuditLog(), edge.Logs()
	if !slices.ContainsFunc(strings.Split(logs, "\n"), func(l string) bool {
		return strings.Contains(l, `"msg":"request"`) && strings.Contains(l, `"route":"sandbox"`) && strings.Contains(l, `"user":"dora"`)
	}) {
		t.Fatal("the edge's log does not hold dora's proxied request: the absence below would prove nothing")
	}
	for _, secret := range []string{token, stolen, ck.Value, strings.SplitN(token, ".", 2)[1]} {
		if strings.Contains(audit, secret) || strings.Contains(logs, secret) {
			t.Errorf("a token or session id was logged or audited")
		}
	}
}

func TestTwoEdgesShareSessionsAndTheRateLimit(t *testing.T) {
	w := newStack(t)
	w.Env["AUTH_RATE_LIMIT"] = "6"
	a := w.Edge("edge-a", nil)
	b := w.Edge("edge-b", nil)

	ca := testenv.NewClient(t, a.URL)
	ca.Signup("erin", invite)
	sid := ca.Cookie("dsh_gw_session").Value
	cb := testenv.NewClient(t, b.URL)
	expect(t, cb.Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+sid), http.StatusOK, "cookie from A on B")

	// Restart both edges: sessions live in NATS, not in the processes.
	a.Stop()
	b.Stop()
	a.Restart(t)
	b.Restart(t)
	a.WaitReady(t, time.Minute)
	b.WaitReady(t, time.Minute)
	expect(t, cb.Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+sid), http.StatusOK, "cookie after restarting both edges")

	// Sign out on B; A refuses the cookie. (How soon is
	// BenchmarkRevocationAcrossEdges's to measure: the deadline here is
	// only how long the test waits.)
	expect(t, cb.Do("POST", "/logout", nil, "Cookie", "dsh_gw_session="+sid), http.StatusSeeOther, "logout on B")
	start := time.Now()
	testutil.Eventually(t, 30*time.Second, func() error {
		if r := ca.Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+sid); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("A still accepts it: %d", r.StatusCode)
		}
		return nil
	})
	t.Logf("revocation reached the other edge in %s", time.Since(start).Round(time.Millisecond))

	// The rate limit is shared: 6 attempts spread over both edges, then 429
	// on either. (The signup above was attempt 1.)
	clients := []*testenv.Client{testenv.NewClient(t, a.URL), testenv.NewClient(t, b.URL)}
	for i := 0; i < 5; i++ {
		expect(t, clients[i%2].Form("/login", "token", "nobody.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"), http.StatusUnauthorized, "attempt "+strconv.Itoa(i+2))
	}
	for _, c := range clients {
		r := c.Form("/login", "token", "x")
		expect(t, r, http.StatusTooManyRequests, "over the limit")
		if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 61 {
			t.Fatalf("Retry-After %q", r.Header.Get("Retry-After"))
		}
	}
	// The edges trust no proxy here: a client that names another address in
	// X-Forwarded-For is still itself, with no fresh budget.
	for _, c := range clients {
		r := c.Do("POST", "/login", strings.NewReader("token=x"), "Content-Type", "application/x-www-form-urlencoded", "X-Forwarded-For", "203.0.113.9, 198.51.100.7", "Accept", "application/json")
		expect(t, r, http.StatusTooManyRequests, "a spoofed X-Forwarded-For from an untrusted peer")
	}
	// Refusals are audited once per client per window, not once each.
	if n := count(auditEvents(t, w), refusal); n != 1 {
		t.Fatalf("%d audited refusals of the client, want exactly one:\n%s", n, w.AuditLog())
	}
}

// MAX_USERS is one cap for the whole gateway: accounts made on either
// edge count against it, a signup beyond it on either edge is a 403 that
// says why and creates nothing, and a deleted account frees its place.
func TestMaxUsersAcrossTwoEdges(t *testing.T) {
	w := newStack(t)
	w.Env["MAX_USERS"] = "2"
	a := w.Edge("edge-a", nil)
	b := w.Edge("edge-b", nil)
	testenv.NewClient(t, a.URL).Signup("cap1", invite)
	last := testenv.NewClient(t, b.URL)
	last.Signup("cap2", invite)
	for _, e := range []*testenv.Edge{a, b} {
		testutil.Eventually(t, 10*time.Second, func() error {
			r := testenv.NewClient(t, e.URL).Form("/users", "user", "cap3", "invite", invite)
			if r.StatusCode != http.StatusForbidden || !strings.Contains(string(r.Body), "limit of 2 users") {
				return fmt.Errorf("third signup on %s: %d %s", e.URL, r.StatusCode, r.Body)
			}
			return nil
		})
	}
	if n := w.Claims(); n != 2 {
		t.Fatalf("%d claims, want 2: a refused signup created something", n)
	}
	expect(t, last.Do("DELETE", "/users/cap2", nil, "Accept", "application/json"), http.StatusNoContent, "delete cap2")
	testutil.Eventually(t, time.Minute, func() error {
		if r := testenv.NewClient(t, a.URL).Form("/users", "user", "cap3", "invite", invite); r.StatusCode != http.StatusCreated && r.StatusCode != http.StatusAccepted {
			return fmt.Errorf("signup after a deletion: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
}

// Behind the pooling front (nginx, trusted by TRUSTED_PROXIES), each
// browser is the address nginx saw: two browsers have two budgets, and
// neither buys a fresh one by sending X-Forwarded-For, through the front
// or around it.
func TestClientAddressBehindTheFront(t *testing.T) {
	w := newStack(t)
	w.Env["AUTH_RATE_LIMIT"] = "3"
	frontAddr := w.FrontAddr()
	edge := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"})
	front := testenv.NewFrontAt(t, frontAddr, strings.TrimPrefix(edge.URL, "http://"))

	login := func(c *testenv.Client, xff string) int {
		return c.Do("POST", "/login", strings.NewReader("token=x"), "Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json", "X-Forwarded-For", xff).StatusCode
	}
	x := testenv.NewClient(t, front.URL()).From("127.0.0.2")
	for i := range 3 {
		if got := login(x, ""); got != http.StatusUnauthorized {
			t.Fatalf("attempt %d: %d", i+1, got)
		}
	}
	if got := login(x, ""); got != http.StatusTooManyRequests {
		t.Fatalf("over the limit: %d", got)
	}
	if got := login(x, "203.0.113.9"); got != http.StatusTooManyRequests {
		t.Fatalf("a spoofed X-Forwarded-For through the front bought a fresh budget: %d", got)
	}
	if got := login(testenv.NewClient(t, edge.URL).From("127.0.0.2"), "198.51.100.1"); got != http.StatusTooManyRequests {
		t.Fatalf("a spoofed X-Forwarded-For around the front bought a fresh budget: %d", got)
	}
	if got := login(testenv.NewClient(t, front.URL()).From("127.0.0.3"), ""); got != http.StatusUnauthorized {
		t.Fatalf("another browser behind the front shares the first one's budget: %d", got)
	}
}

// A flood of refused logins is bounded where it lands: 20,000 from two
// clients add at most one audit event per client per AUTH_RATE_WINDOW
// (the stream would otherwise grow by one event per request).
func TestRefusedLoginsAddOneAuditEventPerClient(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", nil)
	const perClient = 10_000
	start := time.Now()
	var refused, limited atomic.Int64
	var wg sync.WaitGroup
	for _, ip := range []string{"127.0.0.2", "127.0.0.3"} {
		c := testenv.NewClient(t, edge.URL).From(ip)
		var next atomic.Int64
		for range 8 {
			wg.Go(func() {
				for next.Add(1) <= perClient {
					switch st := c.Form("/login", "token", "nobody.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa").StatusCode; st {
					case http.StatusUnauthorized:
						refused.Add(1)
					case http.StatusTooManyRequests:
						limited.Add(1)
					default:
						t.Errorf("status %d", st)
						return
					}
				}
			})
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	// The window slides: any 60 s admits AUTH_RATE_LIMIT (30) attempts of a
	// client, so however long the flood took, each client had at most 30
	// per 60 s begun, and at least its first 30.
	const limit, window = 30, time.Minute
	windows := 1 + int(elapsed/window)
	if refused.Load()+limited.Load() != 2*perClient || refused.Load() < 2*limit || refused.Load() > int64(2*limit*windows) {
		t.Fatalf("%d refused, %d rate limited in %s: want 2×%d..2×%d×%d admitted (and refused for the wrong token), the rest rate limited", refused.Load(), limited.Load(), elapsed.Round(time.Millisecond), limit, limit, windows)
	}
	// One audit event per client per window begun.
	evs := auditEvents(t, w)
	for _, ip := range []string{"127.0.0.2", "127.0.0.3"} {
		tag := ident.HashHex(ip)[:16]
		n := count(evs, func(e events.AuditEvent) bool { return refusal(e) && e.Client == tag })
		if n < 1 || n > windows {
			t.Errorf("client %s: %d audit events for %d refusals in %s, want 1..%d", ip, n, perClient, elapsed.Round(time.Millisecond), windows)
		}
	}
	t.Logf("20000 refused logins in %s: %d wrong token, %d rate limited; audit events %d in all", elapsed.Round(time.Millisecond), refused.Load(), limited.Load(), len(evs))
}

// SSO admits only whom AUTH_PROXY_ALLOW names (a login in any case, or a
// group), maps logins outside the account grammar to names instead of
// refusing them, and binds each account to the provider's stable id, so a
// login renamed and registered again by someone else opens nothing.
func TestSSOAdmitsOnlyWhomItShould(t *testing.T) {
	w := newStack(t)
	sso := w.Edge("edge-sso", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "AliceSmith,gus,group:acme:devs", "ADMIN_GROUPS": "acme:ops", "ADMIN_ON_SANDBOX_HOSTS": "true"})
	plain := w.Edge("edge-plain", nil)
	status := func(headers ...string) *testenv.Response {
		return testenv.NewClient(t, sso.URL).Do("GET", "/_/status", nil, headers...)
	}
	users, _ := kv.Open[state.User](testenv.Context(t, time.Minute), w.JS, state.BucketUsers)
	exists := func(name string) bool {
		_, err := users.Get(testenv.Context(t, time.Minute), name)
		return err == nil
	}

	r := status("X-Forwarded-User", "mallory", "X-Forwarded-Email", "m@evil.example", "X-Forwarded-Groups", "acme,evil:devs")
	expect(t, r, http.StatusForbidden, "a user AUTH_PROXY_ALLOW does not name")
	if !strings.Contains(string(r.Body), "AUTH_PROXY_ALLOW") || exists("mallory") || w.Claims() != 0 {
		t.Fatalf("unlisted user: %s; account %v, %d claims", r.Body, exists("mallory"), w.Claims())
	}

	r = status("X-Forwarded-User", "Carol.Jones", "X-Forwarded-Email", "carol@acme.example", "X-Forwarded-Groups", "other, acme:devs")
	expect(t, r, http.StatusOK, "a group member whose login is not an account name")
	if name := r.JSON()["user"]; name != ident.SSOName("Carol.Jones") || !strings.HasPrefix(ident.SSOName("Carol.Jones"), "carol-jones-") {
		t.Fatalf("Carol.Jones got account %v", name)
	}

	for _, login := range []string{"AliceSmith", "alicesmith", "ALICESMITH"} {
		r := status("X-Forwarded-User", login, "X-Forwarded-Email", "Alice@Acme.example")
		expect(t, r, http.StatusOK, login)
		if r.JSON()["user"] != "alicesmith" {
			t.Fatalf("%s got account %v", login, r.JSON()["user"])
		}
	}
	if n := w.Claims(); n != 2 {
		t.Fatalf("%d claims, want 2 (carol's and one for alice in any case)", n)
	}

	// gus signs in; later the login "gus" belongs to someone else (another
	// stable id), who must not get gus's workspace.
	expect(t, status("X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@old.example"), http.StatusOK, "gus")
	r = status("X-Forwarded-User", "gus", "X-Forwarded-Email", "newcomer@example.com")
	expect(t, r, http.StatusForbidden, "the login gus with another identity")
	if !strings.Contains(string(r.Body), "another identity") {
		t.Fatalf("unclear refusal: %s", r.Body)
	}
	expect(t, status("X-Forwarded-User", "gus"), http.StatusForbidden, "the login gus without its stable id")
	if n := w.Claims(); n != 3 {
		t.Fatalf("%d claims, want 3", n)
	}

	// The SSO headers are the edge's to read: DSH never sees them.
	c := testenv.NewClient(t, sso.URL).WithTimeout(3 * time.Minute)
	r = c.Do("GET", "/u/gus/api/echo", nil, "X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@old.example", "X-Forwarded-Groups", "acme:devs")
	expect(t, r, http.StatusOK, "gus's sandbox")
	for _, h := range []string{"gus@old.example", "acme:devs", "X-Forwarded-User", "X-Forwarded-Email", "X-Forwarded-Groups"} {
		if strings.Contains(string(r.Body), h) {
			t.Errorf("%s reached DSH: %s", h, r.Body)
		}
	}
	expect(t, testenv.NewClient(t, sso.URL).Do("GET", "/u/alicesmith/api/echo", nil, "X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@old.example"), http.StatusForbidden, "gus at alice's sandbox")

	// ADMIN_GROUPS: gus administers while the SSO proxy says he is in the
	// group (any case), not otherwise; nobody else does.
	admin := func(headers ...string) *testenv.Response {
		return testenv.NewClient(t, sso.URL).Do("GET", "/_/admin/users", nil, headers...)
	}
	expect(t, admin("X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@old.example", "X-Forwarded-Groups", "acme:devs, ACME:OPS"), http.StatusOK, "a member of ADMIN_GROUPS")
	expect(t, admin("X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@old.example", "X-Forwarded-Groups", "acme:devs"), http.StatusNotFound, "gus outside the admin group")
	expect(t, admin("X-Forwarded-User", "Carol.Jones", "X-Forwarded-Email", "carol@acme.example", "X-Forwarded-Groups", "acme:devs,acme:opsx"), http.StatusNotFound, "a member of other groups")
	expect(t, testenv.NewClient(t, plain.URL).Do("GET", "/_/admin/users", nil, "X-Forwarded-User", "gus", "X-Forwarded-Groups", "acme:ops"), http.StatusNotFound, "the headers at an edge without SSO")

	expect(t, testenv.NewClient(t, plain.URL).Do("GET", "/_/status", nil, "X-Forwarded-User", "gus"), http.StatusUnauthorized, "header without AUTH_PROXY_HEADER")
	expect(t, testenv.NewClient(t, sso.URL).Form("/users", "user", "hal", "invite", invite), http.StatusForbidden, "signup form in SSO mode")
	if n := count(auditEvents(t, w), kind(events.AuditSSORefused, "")); n != 1 {
		t.Fatalf("%d audited SSO refusals for this client in the window, want one:\n%s", n, w.AuditLog())
	}
}

// A user holds at most MAX_SESSIONS_PER_USER sessions: signing in beyond
// it ends the oldest; signing in again from a browser ends that browser's
// previous session.
func TestSessionsPerUserAreCapped(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", map[string]string{"MAX_SESSIONS_PER_USER": "2"})
	first := testenv.NewClient(t, edge.URL)
	token := first.Signup("sue", invite)
	sid := func(c *testenv.Client) string { return "dsh_gw_session=" + c.Cookie("dsh_gw_session").Value }
	s1 := sid(first)
	second := testenv.NewClient(t, edge.URL)
	expect(t, second.Form("/login", "token", token), http.StatusOK, "second session")
	expect(t, testenv.NewClient(t, edge.URL).Do("GET", "/_/status", nil, "Cookie", s1), http.StatusOK, "first session within the cap")
	third := testenv.NewClient(t, edge.URL)
	expect(t, third.Form("/login", "token", token), http.StatusOK, "third session")
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := testenv.NewClient(t, edge.URL).Do("GET", "/_/status", nil, "Cookie", s1); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("the oldest session still works: %d", r.StatusCode)
		}
		return nil
	})
	s2 := sid(second)
	expect(t, second.Form("/login", "token", token), http.StatusOK, "signing in again")
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := testenv.NewClient(t, edge.URL).Do("GET", "/_/status", nil, "Cookie", s2); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("the replaced session still works: %d", r.StatusCode)
		}
		return nil
	})
	for _, c := range []*testenv.Client{second, third} {
		expect(t, c.Do("GET", "/_/status", nil), http.StatusOK, "current sessions")
	}
}

func TestSecureCookieAndInsecureRefusal(t *testing.T) {
	w := newStack(t)
	secure := w.Edge("edge-secure", map[string]string{"COOKIE_SECURE": "true", "ALLOW_INSECURE_COOKIES": ""})
	r := testenv.NewClient(t, secure.URL).Form("/users", "user", "ivy", "invite", invite)
	expect(t, r, http.StatusCreated, "signup")
	// Both gateway cookies (the session's, and the one naming its user)
	// are __Host- and Secure.
	names := map[string]bool{}
	for _, sc := range r.Header.Values("Set-Cookie") {
		name, _, _ := strings.Cut(sc, "=")
		names[name] = true
		if !strings.HasPrefix(name, "__Host-") || !strings.Contains(sc, "secure") {
			t.Fatalf("secure cookie: %s", sc)
		}
	}
	if !names["__Host-dsh_gw_session"] || !names["__Host-dsh_gw_session_user"] {
		t.Fatalf("cookies set: %v, want the session's and its user's", names)
	}

	// The secure edge's own environment, complete and valid, but with
	// COOKIE_SECURE=false and no ALLOW_INSECURE_COOKIES=1: the edge refuses
	// to start (exit 1), and that is its one error, which names both
	// variables. The same environment with ALLOW_INSECURE_COOKIES=1 starts:
	// nothing else in it is wrong.
	env := maps.Clone(secure.Env)
	delete(env, "METRICS_ADDR")
	env["LISTEN_ADDR"], env["INSTANCE_ID"], env["COOKIE_SECURE"] = testenv.FreeAddr(t), "edge-insecure", "false"
	_, err := config.LoadEdge(config.FromMap(env))
	if err == nil {
		t.Fatal("the environment with COOKIE_SECURE=false alone loads without an error")
	}
	errs := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	}
	if len(errs) != 1 || !strings.HasPrefix(errs[0].Error(), "COOKIE_SECURE: ") || !strings.Contains(errs[0].Error(), "ALLOW_INSECURE_COOKIES") {
		t.Fatalf("want the COOKIE_SECURE error alone, got %d: %v", len(errs), err)
	}
	p := pkg.Start(t, "edge", env)
	testutil.Eventually(t, time.Minute, func() error {
		if !p.Exited() {
			return fmt.Errorf("still running")
		}
		return nil
	})
	if p.ExitCode() != 1 || !strings.Contains(p.Logs(), "edge: "+errs[0].Error()+"\n") {
		t.Fatalf("exit %d, want 1 reporting %q: %s", p.ExitCode(), errs[0], p.Logs())
	}
	env["ALLOW_INSECURE_COOKIES"], env["LISTEN_ADDR"] = "1", testenv.FreeAddr(t)
	pkg.Start(t, "edge", env).WaitReady(t, time.Minute)
}

// BenchmarkSignupLatency measures POST /users (JSON) to 201 against a warm
// pool: the claim command, lifecycle's create, adoption of a warm sandbox,
// the mirror and the session. Run with -benchtime=30x.
func BenchmarkSignupLatency(b *testing.B) {
	s := pkg.NewStack(b, testenv.StackOptions{Sandbox: func(_ *extv1beta1.SandboxTemplate, pool *extv1beta1.SandboxWarmPool) {
		n := int32(4)
		pool.Spec.Replicas = &n
	}, Lifecycle: "lc-a"})
	edge := s.Edge("edge-a", nil)
	_, ext, _ := pkg.Cluster.SandboxClients()
	var lat []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		for { // a warm spare for every signup: we measure adoption, not cold starts
			p, err := ext.ExtensionsV1beta1().SandboxWarmPools(s.NS.Name).Get(testenv.Context(b, time.Minute), "dsh-pool", metav1.GetOptions{})
			if err == nil && p.Status.ReadyReplicas >= 2 {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		c := testenv.NewClient(b, edge.URL)
		b.StartTimer()
		start := time.Now()
		r := c.Form("/users", "user", fmt.Sprintf("s%d", i))
		lat = append(lat, time.Since(start))
		if r.StatusCode != http.StatusCreated {
			b.Fatalf("signup %d: %d %s", i, r.StatusCode, r.Body)
		}
	}
	b.StopTimer()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[int(0.99*float64(len(lat)-1))].Microseconds())/1000, "p99-ms")
}

// BenchmarkRevocationAcrossEdges measures how soon a logout on one edge
// reaches another: from the logout's answer on edge-b until edge-a refuses
// the cookie, against the baseline of edge-b itself refusing it (both
// learn of it through their watch of the sessions bucket). Run with
// -benchtime=20x.
func BenchmarkRevocationAcrossEdges(b *testing.B) {
	w := newStack(b)
	w.Env["AUTH_RATE_LIMIT"] = "10000"
	ea, eb := w.Edge("edge-a", nil), w.Edge("edge-b", nil)
	token := testenv.NewClient(b, ea.URL).Signup("erin", invite)
	refusedAfter := func(base, sid string, start time.Time, out *time.Duration, wg *sync.WaitGroup) {
		defer wg.Done()
		c := testenv.NewClient(b, base)
		for c.Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+sid).StatusCode != http.StatusUnauthorized {
			if time.Since(start) > time.Minute {
				b.Errorf("%s still accepts a session ended a minute ago", base)
				return
			}
		}
		*out = time.Since(start)
	}
	var other, same []time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		c := testenv.NewClient(b, ea.URL)
		if r := c.Form("/login", "token", token); r.StatusCode != http.StatusOK {
			b.Fatalf("login: %d %s", r.StatusCode, r.Body)
		}
		sid := c.Cookie("dsh_gw_session").Value
		// Logging out on an edge that does not know the session yet ends
		// nothing: wait until edge-b has it.
		testutil.Eventually(b, time.Minute, func() error {
			if st := testenv.NewClient(b, eb.URL).Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+sid).StatusCode; st != http.StatusOK {
				return fmt.Errorf("edge-b answers %d to the new session", st)
			}
			return nil
		})
		b.StartTimer()
		if r := testenv.NewClient(b, eb.URL).Do("POST", "/logout", nil, "Cookie", "dsh_gw_session="+sid); r.StatusCode != http.StatusSeeOther {
			b.Fatalf("logout: %d", r.StatusCode)
		}
		start := time.Now()
		var ta, tb time.Duration
		var wg sync.WaitGroup
		wg.Add(2)
		go refusedAfter(ea.URL, sid, start, &ta, &wg)
		go refusedAfter(eb.URL, sid, start, &tb, &wg)
		wg.Wait()
		other, same = append(other, ta), append(same, tb)
	}
	b.StopTimer()
	median := func(d []time.Duration) time.Duration { slices.Sort(d); return d[len(d)/2] }
	b.ReportMetric(float64(median(other).Microseconds())/1000, "other-edge-ms")
	b.ReportMetric(float64(median(same).Microseconds())/1000, "same-edge-ms")
	b.ReportMetric(float64(median(other))/float64(max(median(same), time.Microsecond)), "other/same")
}
