package proxy_test

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// sandboxDomain is SANDBOX_DOMAIN in these tests: the hosts below it need
// no DNS, as every request names its Host itself.
const sandboxDomain = "sbx.test"

// originStack is a stack in subdomain mode with two edges.
func originStack(t *testing.T) (w *testenv.Stack, a, b *testenv.Edge) {
	w = newStack(t, nil)
	env := map[string]string{"SANDBOX_DOMAIN": sandboxDomain, "LOG_LEVEL": "debug"}
	return w, w.Edge("edge-a", env), w.Edge("edge-b", env)
}

// at sends one request to edge for host, following no redirect; headers
// are name, value pairs.
func at(t *testing.T, edge *testenv.Edge, method, host, path string, body io.Reader, headers ...string) *testenv.Response {
	t.Helper()
	req, err := http.NewRequest(method, edge.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := testenv.NoRedirects().Do(req)
	if err != nil {
		t.Fatalf("%s %s%s: %v", method, host, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return &testenv.Response{Response: resp, Body: b}
}

// gatewayHost is an edge's own address, its first PUBLIC_HOSTS entry.
func gatewayHost(e *testenv.Edge) string { return strings.TrimPrefix(e.URL, "http://") }

// originState reads what sign-in on sandbox origins leaves in KV: the
// codes waiting, and each user's sandbox sessions by key.
type originState struct {
	codes    *kv.Bucket[state.SigninCode]
	sessions *kv.Bucket[state.Session]
}

func newOriginState(t *testing.T, w *testenv.Stack) originState {
	ctx := testenv.Context(t, 10*time.Second)
	codes, err := kv.Open[state.SigninCode](ctx, w.JS, state.BucketSigninCodes)
	if err != nil {
		t.Fatal(err)
	}
	sessions, err := kv.Open[state.Session](ctx, w.JS, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	return originState{codes: codes, sessions: sessions}
}

func (s originState) code(t *testing.T, code string) (state.SigninCode, bool) {
	t.Helper()
	e, err := s.codes.Get(testenv.Context(t, 10*time.Second), hex.EncodeToString(sha(code)))
	if errors.Is(err, kv.ErrNotFound) {
		return state.SigninCode{}, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return e.Value, true
}

func (s originState) codeCount(t *testing.T) int {
	t.Helper()
	keys, err := s.codes.Keys(testenv.Context(t, 10*time.Second), ">")
	if err != nil && !errors.Is(err, kv.ErrNotFound) {
		t.Fatal(err)
	}
	return len(keys)
}

// sandboxSessions are user's sessions for a sandbox origin.
func (s originState) sandboxSessions(t *testing.T, user string) []state.Session {
	t.Helper()
	ctx := testenv.Context(t, 10*time.Second)
	keys, err := s.sessions.Keys(ctx, user+".*")
	if err != nil && !errors.Is(err, kv.ErrNotFound) {
		t.Fatal(err)
	}
	var out []state.Session
	for _, k := range keys {
		e, err := s.sessions.Get(ctx, k)
		if err == nil && e.Value.Host != "" {
			out = append(out, e.Value)
		}
	}
	return out
}

func sha(s string) []byte { sum := sha256.Sum256([]byte(s)); return sum[:] }

// originSignIn runs the sign-in of a browser holding the gateway session gw on
// edge mint: the navigation to host is sent to the gateway, which mints a
// code and sends it back; it returns the code and the trade's URL path.
func originSignIn(t *testing.T, mint *testenv.Edge, gw, host, path string) (code, trade string) {
	t.Helper()
	r := at(t, mint, "GET", host, path, nil, "Accept", "text/html")
	want := "http://" + gatewayHost(mint) + "/_/signin/sandbox?next=" + url.QueryEscape("http://"+host+path)
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != want {
		t.Fatalf("navigation without a session: %d %q, want 303 %q", r.StatusCode, r.Header.Get("Location"), want)
	}
	r = at(t, mint, "GET", gatewayHost(mint), strings.TrimPrefix(want, "http://"+gatewayHost(mint)), nil, "Cookie", "dsh_gw_session="+gw, "Accept", "text/html")
	loc, err := url.Parse(r.Header.Get("Location"))
	if r.StatusCode != http.StatusSeeOther || err != nil || loc.Host != host || loc.Path != "/_aaas/signin" || loc.Query().Get("next") != path {
		t.Fatalf("mint: %d %q", r.StatusCode, r.Header.Get("Location"))
	}
	return loc.Query().Get("code"), loc.RequestURI()
}

// The sign-in of a sandbox origin, end to end across two edges: a
// navigation without a session goes to the gateway, which mints a code
// bound to user, session and host; the origin (on the other edge) trades
// it once for a host-only cookie of its own; a reused, expired,
// foreign-host or other-user code is refused with a clear 4xx and changes
// nothing in KV; the cookie opens that origin only; bearer tokens work
// there as they do today; a logout on the gateway ends the sandbox
// session on every edge and closes its open WebSocket with 4401. No code
// or session id reaches either edge's log.
func TestSandboxOriginSignIn(t *testing.T) {
	w, a, b := originStack(t)
	st := newOriginState(t, w)
	c := testenv.NewClient(t, a.URL)
	token := c.Signup("ann", "")
	gw := c.Cookie("dsh_gw_session").Value
	testenv.NewClient(t, a.URL).Signup("bob", "")
	ann, bob := "ann."+sandboxDomain, "bob."+sandboxDomain

	// Bearer tokens work on the origin (and wait for the sandbox); DSH
	// gets Host localhost:<pod port> and the origin as X-Forwarded-Host.
	r := at(t, a, "GET", ann, "/api/echo?x=1", nil, "Authorization", "Bearer "+token)
	expect(t, r, http.StatusOK, "bearer on the origin")
	e := decodeEcho(t, r)
	if !strings.HasPrefix(e.Host, "localhost:") || e.Path != "/api/echo" || strings.Join(e.Headers["X-Forwarded-Host"], ",") != ann || len(e.Headers["X-Forwarded-Prefix"]) != 0 {
		t.Fatalf("DSH got %+v", e)
	}

	// A code for ann's origin, minted on edge A.
	code, trade := originSignIn(t, a, gw, ann, "/api/echo?from=signin")
	sc, ok := st.code(t, code)
	if !ok || sc.User != "ann" || sc.Host != ann || sc.Parent != hex.EncodeToString(sha(gw)) || !time.Now().Before(sc.Expires) {
		t.Fatalf("the code in KV: %+v %v", sc, ok)
	}

	// Traded on another sandbox's origin: 403, and the code stays.
	expect(t, at(t, b, "GET", bob, trade, nil, "Accept", "text/html"), http.StatusForbidden, "the code on bob's origin")
	if _, ok := st.code(t, code); !ok || len(st.sandboxSessions(t, "ann")) != 0 || len(st.sandboxSessions(t, "bob")) != 0 {
		t.Fatalf("a foreign-host trade changed KV: code there %v, sessions %v %v", ok, st.sandboxSessions(t, "ann"), st.sandboxSessions(t, "bob"))
	}

	// Traded on its origin through edge B: a host-only cookie, and back
	// to the page asked for.
	r = at(t, b, "GET", ann, trade, nil, "Accept", "text/html")
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != "/api/echo?from=signin" {
		t.Fatalf("trade: %d %q %s", r.StatusCode, r.Header.Get("Location"), r.Body)
	}
	var sid string
	for _, ck := range r.Cookies() {
		if ck.Name == "aaas_sandbox" {
			sid = ck.Value
			if ck.Domain != "" || ck.Path != "/" || !ck.HttpOnly || ck.SameSite != http.SameSiteLaxMode {
				t.Fatalf("sandbox cookie %+v", ck)
			}
		}
	}
	if sid == "" {
		t.Fatalf("no sandbox cookie: %v", r.Header.Values("Set-Cookie"))
	}
	sessions := st.sandboxSessions(t, "ann")
	if _, ok := st.code(t, code); ok || len(sessions) != 1 || sessions[0].Host != ann || sessions[0].Parent != hex.EncodeToString(sha(gw)) {
		t.Fatalf("after the trade: code left %v, sandbox sessions %+v", ok, sessions)
	}

	// Reused, on either edge: 400, nothing changes.
	for _, e := range []*testenv.Edge{a, b} {
		r := at(t, e, "GET", ann, trade, nil, "Accept", "text/html")
		expect(t, r, http.StatusBadRequest, "a reused code")
		if !strings.Contains(string(r.Body), "already used or has expired") {
			t.Fatalf("reused code page: %s", r.Body)
		}
	}
	// Expired (written as the edge would, a second past its expiry): 400,
	// and it is left as it was.
	expired := strings.Repeat("x", 43)
	if _, err := st.codes.Create(testenv.Context(t, 10*time.Second), hex.EncodeToString(sha(expired)), state.SigninCode{
		User: "ann", Host: ann, Parent: hex.EncodeToString(sha(gw)), Expires: time.Now().Add(-time.Second),
	}); err != nil {
		t.Fatal(err)
	}
	expect(t, at(t, a, "GET", ann, "/_aaas/signin?code="+expired+"&next=/", nil), http.StatusBadRequest, "an expired code")
	if _, ok := st.code(t, expired); !ok || len(st.sandboxSessions(t, "ann")) != 1 {
		t.Fatalf("an expired code's trade changed KV: code there %v, sessions %v", ok, st.sandboxSessions(t, "ann"))
	}
	// For another user's origin: 403 on the gateway, and nothing minted.
	before := st.codeCount(t)
	r = at(t, a, "GET", gatewayHost(a), "/_/signin/sandbox?next="+url.QueryEscape("http://"+bob+"/"), nil, "Cookie", "dsh_gw_session="+gw, "Accept", "text/html")
	expect(t, r, http.StatusForbidden, "a code for bob's origin, as ann")
	if r.Header.Get("Location") != "" || st.codeCount(t) != before {
		t.Fatalf("minted for another user: Location %q, %d codes (were %d)", r.Header.Get("Location"), st.codeCount(t), before)
	}

	// One code traded on both edges at once: one wins, once.
	_, race := originSignIn(t, a, gw, ann, "/")
	results := make(chan int, 2)
	for _, e := range []*testenv.Edge{a, b} {
		go func() {
			req, _ := http.NewRequest("GET", e.URL+race, nil)
			req.Host = ann
			resp, err := testenv.NoRedirects().Do(req)
			if err != nil {
				results <- 0
				return
			}
			resp.Body.Close()
			results <- resp.StatusCode
		}()
	}
	if got := []int{<-results, <-results}; got[0]+got[1] != http.StatusSeeOther+http.StatusBadRequest {
		t.Fatalf("one code traded on two edges at once: %v, want one 303 and one 400", got)
	}
	if n := len(st.sandboxSessions(t, "ann")); n != 2 {
		t.Fatalf("ann has %d sandbox sessions after the race, want 2", n)
	}

	// The cookie opens ann's origin on both edges, and no other origin.
	cookie := "aaas_sandbox=" + sid
	for _, e := range []*testenv.Edge{a, b} {
		r := at(t, e, "GET", ann, "/api/echo", nil, "Cookie", cookie)
		expect(t, r, http.StatusOK, "the sandbox cookie on its origin")
		if got := strings.Join(decodeEcho(t, r).Headers["Cookie"], ";"); strings.Contains(got, sid) || strings.Contains(got, gw) {
			t.Fatalf("DSH got the browser's cookies: %q", got)
		}
	}
	expect(t, at(t, a, "GET", bob, "/api/echo", nil, "Cookie", cookie), http.StatusUnauthorized, "ann's sandbox cookie on bob's origin")
	expect(t, at(t, a, "GET", gatewayHost(a), "/u/ann/api/echo", nil, "Cookie", "dsh_gw_session="+sid), http.StatusMovedPermanently, "the gateway's /u/ in subdomain mode")
	if r := at(t, a, "GET", gatewayHost(a), "/", nil, "Cookie", "dsh_gw_session="+sid, "Accept", "application/json"); strings.Contains(string(r.Body), `"ann"`) {
		t.Fatalf("a sandbox session id signed in on the gateway: %s", r.Body)
	}

	// Exact origins: with the sandbox cookie a mutation is accepted on
	// ann's origin only from ann's origin (bob's is same-site, and so is
	// the gateway's here), a WebSocket naming another origin is closed
	// with 4403; on the gateway a mutation from ann's origin is refused
	// (the logout below, from the gateway's own, is the positive control).
	for origin, want := range map[string]int{"http://" + ann: http.StatusOK, "http://" + bob: http.StatusForbidden, a.URL: http.StatusForbidden, "https://" + ann: http.StatusForbidden} {
		expect(t, at(t, b, "POST", ann, "/api/echo", strings.NewReader("x"), "Cookie", cookie, "Origin", origin), want, "a POST on ann's origin from "+origin)
		if want == http.StatusOK {
			continue
		}
		ws, _, err := wsDial(t, b.URL+"/api/ws", http.Header{"Host": {ann}, "Cookie": {cookie}, "Origin": {origin}})
		if err != nil {
			t.Fatal(err)
		}
		_, _, err = ws.ReadMessage()
		ws.Close()
		if closeCode(err) != 4403 {
			t.Fatalf("a WebSocket on ann's origin from %s: %v, want 4403", origin, err)
		}
	}
	expect(t, at(t, a, "POST", gatewayHost(a), "/logout", nil, "Cookie", "dsh_gw_session="+gw, "Origin", "http://"+ann, "Accept", "application/json"), http.StatusForbidden, "a logout from ann's origin")
	expect(t, at(t, a, "GET", ann, "/api/echo", nil, "Cookie", cookie), http.StatusOK, "the sandbox session after a refused logout")

	// A WebSocket on ann's origin through edge B; logout on edge A.
	ws, _, err := wsDial(t, b.URL+"/api/ws", http.Header{"Host": {ann}, "Cookie": {cookie}, "Origin": {"http://" + ann}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	if err := ws.WriteMessage(websocket.TextMessage, []byte("up")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ws.ReadMessage(); err != nil {
		t.Fatal(err)
	}
	closed := make(chan int, 1)
	go func() {
		for {
			if _, _, err := ws.ReadMessage(); err != nil {
				closed <- closeCode(err)
				return
			}
		}
	}()
	r = at(t, a, "POST", gatewayHost(a), "/logout", nil, "Cookie", "dsh_gw_session="+gw, "Origin", a.URL)
	if r.StatusCode != http.StatusSeeOther {
		t.Fatalf("logout: %d %s", r.StatusCode, r.Body)
	}
	select {
	case code := <-closed:
		if code != 4401 {
			t.Fatalf("the sandbox origin's WebSocket closed with %d, want 4401", code)
		}
	case <-time.After(hangGuard):
		t.Fatalf("the sandbox origin's WebSocket still open %s after the logout", hangGuard)
	}
	for _, e := range []*testenv.Edge{a, b} {
		testutil.Eventually(t, hangGuard, func() error {
			if r := at(t, e, "GET", ann, "/api/echo", nil, "Cookie", cookie); r.StatusCode != http.StatusUnauthorized {
				return errors.New("the sandbox session still opens the origin after the logout: " + r.Status)
			}
			return nil
		})
	}

	// The audit stream has the sign-in and the refused foreign-host
	// trade (the client's first refusal), and no code or session id.
	testutil.Eventually(t, hangGuard, func() error {
		var ok, refused bool
		for _, e := range w.Audit(events.AuditLogin, "ann") {
			ok = ok || e.Outcome == "ok" && e.Detail == "sandbox origin "+ann
		}
		for _, e := range w.Audit(events.AuditLogin, "bob") {
			refused = refused || e.Outcome == "foreign_host" && e.Detail == "sandbox origin "+bob
		}
		if !ok || !refused {
			return fmt.Errorf("audited: the sign-in %v, the foreign-host trade %v", ok, refused)
		}
		return nil
	})
	if log := w.AuditLog(); strings.Contains(log, code) || strings.Contains(log, sid) || strings.Contains(log, gw) {
		t.Fatal("the audit stream holds a code or a session id")
	}

	// Neither edge logged a code or a session id; they did log this
	// window's requests (the positive control: the access lines of ann's
	// proxied requests).
	for _, e := range []*testenv.Edge{a, b} {
		logs := e.Logs()
		for what, secret := range map[string]string{"the code": code, "the sandbox session id": sid, "the gateway session id": gw} {
			if strings.Contains(logs, secret) {
				t.Errorf("%s logged %s", e.Name, what)
			}
		}
		if !slices.ContainsFunc(strings.Split(logs, "\n"), func(l string) bool {
			return strings.Contains(l, `"msg":"request"`) && strings.Contains(l, `"route":"sandbox"`) && strings.Contains(l, `"user":"ann"`)
		}) {
			t.Errorf("%s logged none of ann's requests, so its log proves nothing", e.Name)
		}
	}
}

// With SSO the identity is taken on the gateway (behind the SSO proxy)
// and carried by the same code: the sandbox session is bound to the
// account's binding, as SSO has no gateway session. The SSO header itself
// is not believed on a sandbox origin: it opens nothing there (the
// gateway's status, with the same header, is the positive control).
func TestSandboxOriginSignInWithSSO(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-sso", map[string]string{"SANDBOX_DOMAIN": sandboxDomain, "AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*"})
	st := newOriginState(t, w)
	sso := []string{"X-Forwarded-User", "gus", "X-Forwarded-Email", "gus@example.test"}
	gus := "gus." + sandboxDomain
	expect(t, at(t, edge, "GET", gatewayHost(edge), "/_/status", nil, sso...), http.StatusOK, "SSO on the gateway")

	expect(t, at(t, edge, "GET", gus, "/api/echo", nil, sso...), http.StatusUnauthorized, "the SSO header on gus's origin")
	r := at(t, edge, "GET", gus, "/", nil, append([]string{"Accept", "text/html"}, sso...)...)
	if r.StatusCode != http.StatusSeeOther || !strings.Contains(r.Header.Get("Location"), "/_/signin/sandbox?next=") {
		t.Fatalf("a navigation with only the SSO header: %d %q", r.StatusCode, r.Header.Get("Location"))
	}
	r = at(t, edge, "GET", gatewayHost(edge), "/_/signin/sandbox?next="+url.QueryEscape("http://"+gus+"/api/echo"), nil, append([]string{"Accept", "text/html"}, sso...)...)
	loc, err := url.Parse(r.Header.Get("Location"))
	if r.StatusCode != http.StatusSeeOther || err != nil || loc.Host != gus {
		t.Fatalf("mint with SSO: %d %q", r.StatusCode, r.Header.Get("Location"))
	}
	code := loc.Query().Get("code")
	users, err := kv.Open[state.User](testenv.Context(t, 10*time.Second), w.JS, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	u, err := users.Get(testenv.Context(t, 10*time.Second), "gus")
	if err != nil {
		t.Fatal(err)
	}
	if sc, ok := st.code(t, code); !ok || sc.Parent != "" || sc.Bound != u.Value.TokenHash || sc.Bound == "" {
		t.Fatalf("the SSO code in KV: %+v %v (binding %q)", sc, ok, u.Value.TokenHash)
	}
	r = at(t, edge, "GET", gus, loc.RequestURI(), nil)
	var sid string
	for _, ck := range r.Cookies() {
		if ck.Name == "aaas_sandbox" {
			sid = ck.Value
		}
	}
	if r.StatusCode != http.StatusSeeOther || sid == "" {
		t.Fatalf("trade: %d %v", r.StatusCode, r.Header.Values("Set-Cookie"))
	}
	expect(t, at(t, edge, "GET", gus, "/api/echo", nil, "Cookie", "aaas_sandbox="+sid), http.StatusOK, "the SSO sandbox session on its origin")
	if s := st.sandboxSessions(t, "gus"); len(s) != 1 || s[0].Bound != u.Value.TokenHash || s[0].Parent != "" || s[0].Via != "sandbox" {
		t.Fatalf("gus's sandbox sessions: %+v", s)
	}
}
