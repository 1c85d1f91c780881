// Package accounts tests the edge's account and session behaviour as a
// browser or API client sees it: real edge processes, lifecycle, NATS and
// devcluster.
package accounts_test

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

const invite = "let-me-in"

type world struct {
	*testenv.Stack
	t *testing.T
}

func newWorld(t *testing.T) *world {
	s := pkg.NewStack(t, nil)
	s.Env["SIGNUP_INVITE_CODE"] = invite
	s.Lifecycle("lc-a")
	return &world{Stack: s, t: t}
}

func (w *world) claims() int {
	_, ext, _ := pkg.Cluster.SandboxClients()
	l, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).List(testenv.Context(w.t, time.Minute), metav1.ListOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return len(l.Items)
}

func expect(t *testing.T, r *testenv.Response, status int, what string) {
	t.Helper()
	if r.StatusCode != status {
		t.Fatalf("%s: status %d, want %d (%s)", what, r.StatusCode, status, r.Body)
	}
}

func TestSignupRefusesBadInputAndCreatesNothing(t *testing.T) {
	w := newWorld(t)
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
	if n := w.claims(); n != 0 {
		t.Fatalf("%d claims after only bad requests", n)
	}
	if a := w.AuditLog(); !strings.Contains(a, `"kind":"invite_rejected"`) {
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
	if n := w.claims(); n != 1 {
		t.Fatalf("%d claims, want 1", n)
	}
}

func TestFormSignupLoginLogoutDeleteRecreate(t *testing.T) {
	w := newWorld(t)
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

	// Delete: own account only, claim gone, token dead.
	expect(t, api.Do("DELETE", "/users/dora", nil, "Authorization", "Bearer "+token), http.StatusNoContent, "delete")
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := api.Do("GET", "/_/status", nil, "Authorization", "Bearer "+token); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("token after delete: %d", r.StatusCode)
		}
		return nil
	})
	testutil.Eventually(t, time.Minute, func() error {
		if n := w.claims(); n != 1 { // carol's
			return fmt.Errorf("%d claims", n)
		}
		return nil
	})

	audit := w.AuditLog()
	for _, kind := range []string{"signup", "login", "logout", "recreate", "delete"} {
		if !strings.Contains(audit, `"kind":"`+kind+`"`) {
			t.Errorf("no %s audit event", kind)
		}
	}
	for _, secret := range []string{token, stolen, ck.Value, strings.SplitN(token, ".", 2)[1]} {
		if strings.Contains(audit, secret) || strings.Contains(edge.Logs(), secret) {
			t.Errorf("a token or session id was logged or audited")
		}
	}
}

func TestTwoEdgesShareSessionsAndTheRateLimit(t *testing.T) {
	w := newWorld(t)
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

	// Sign out on B; A refuses the cookie within a second.
	expect(t, cb.Do("POST", "/logout", nil, "Cookie", "dsh_gw_session="+sid), http.StatusSeeOther, "logout on B")
	start := time.Now()
	testutil.Eventually(t, time.Second, func() error {
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
	// Another client (rightmost X-Forwarded-For) has its own budget.
	expect(t, clients[0].Form("/login", "token", "x"), http.StatusTooManyRequests, "same client")
	r := clients[0].Do("POST", "/login", strings.NewReader("token=x"), "Content-Type", "application/x-www-form-urlencoded", "X-Forwarded-For", "203.0.113.9, 198.51.100.7", "Accept", "application/json")
	expect(t, r, http.StatusUnauthorized, "another client behind the proxy")
	if !strings.Contains(w.AuditLog(), `"kind":"rate_limited"`) {
		t.Fatal("no audit event for the rate limit")
	}
}

func TestSSOHeaderIsTheIdentityOnlyWhenConfigured(t *testing.T) {
	w := newWorld(t)
	sso := w.Edge("edge-sso", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User"})
	plain := w.Edge("edge-plain", nil)

	r := testenv.NewClient(t, sso.URL).Do("GET", "/_/status", nil, "X-Forwarded-User", "gus")
	expect(t, r, http.StatusOK, "first SSO visit")
	if r.JSON()["user"] != "gus" {
		t.Fatalf("status %s", r.Body)
	}
	users, _ := kv.Open[kv.User](testenv.Context(t, time.Minute), w.JS, kv.BucketUsers)
	if _, err := users.Get(testenv.Context(t, time.Minute), "gus"); err != nil {
		t.Fatalf("SSO user has no account: %v", err)
	}
	expect(t, testenv.NewClient(t, sso.URL).Do("GET", "/_/status", nil, "X-Forwarded-User", "Not A Name"), http.StatusUnauthorized, "invalid SSO name")
	expect(t, testenv.NewClient(t, plain.URL).Do("GET", "/_/status", nil, "X-Forwarded-User", "gus"), http.StatusUnauthorized, "header without AUTH_PROXY_HEADER")
	expect(t, testenv.NewClient(t, sso.URL).Form("/users", "user", "hal", "invite", invite), http.StatusForbidden, "signup form in SSO mode")
}

func TestSecureCookieAndInsecureRefusal(t *testing.T) {
	w := newWorld(t)
	secure := w.Edge("edge-secure", map[string]string{"COOKIE_SECURE": "true", "ALLOW_INSECURE_COOKIES": ""})
	r := testenv.NewClient(t, secure.URL).Form("/users", "user", "ivy", "invite", invite)
	expect(t, r, http.StatusCreated, "signup")
	sc := r.Header.Get("Set-Cookie")
	if !strings.HasPrefix(sc, "__Host-dsh_gw_session=") || !strings.Contains(sc, "secure") {
		t.Fatalf("secure cookie: %s", sc)
	}

	// COOKIE_SECURE=false without ALLOW_INSECURE_COOKIES=1: the edge
	// refuses to start and names both variables.
	p := pkg.Start(t, "edge", map[string]string{
		"NATS_URL": w.NATS.URL(), "HANDSHAKE_KEYS": w.Key, "COOKIE_SECURE": "false", "LISTEN_ADDR": testenv.FreeAddr(t),
	})
	testutil.Eventually(t, 10*time.Second, func() error {
		if !p.Exited() {
			return fmt.Errorf("still running")
		}
		return nil
	})
	if p.ExitCode() != 1 || !strings.Contains(p.Logs(), "COOKIE_SECURE") || !strings.Contains(p.Logs(), "ALLOW_INSECURE_COOKIES") {
		t.Fatalf("exit %d: %s", p.ExitCode(), p.Logs())
	}
}

// BenchmarkSignupLatency measures POST /users (JSON) to 201 against a warm
// pool: the claim command, lifecycle's create, adoption of a warm sandbox,
// the mirror and the session. Run with -benchtime=30x.
func BenchmarkSignupLatency(b *testing.B) {
	s := pkg.NewStack(b, func(_ *extv1beta1.SandboxTemplate, pool *extv1beta1.SandboxWarmPool) {
		n := int32(4)
		pool.Spec.Replicas = &n
	})
	s.Lifecycle("lc-a")
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
