package origins_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// hangGuard only stops a hang: how soon a revocation ends a stream is a
// benchmark's figure (test/e2e/proxy).
const hangGuard = 30 * time.Second

// sandboxCookie is the sandbox session's cookie name over plain HTTP (the
// tests' edges run with COOKIE_SECURE=false).
const sandboxCookie = "aaas_sandbox"

// signInOnSandbox does what a browser does on a top-level navigation to
// path on user's origin without a sandbox session: to the gateway, which
// mints a code, and back to the origin's /_aaas/signin, which trades it for
// the origin's own cookie and sends the browser on to path. c holds the
// gateway session; the sandbox cookie lands in its jar. It returns the
// code's URL (on the sandbox origin, path and query).
func signInOnSandbox(t *testing.T, w *world, c *testenv.Client, user, path string) string {
	t.Helper()
	origin := w.sandbox(user)
	r := c.At(origin).Do(http.MethodGet, path, nil, "Accept", "text/html")
	loc := r.Header.Get("Location")
	query, ok := strings.CutPrefix(loc, w.gateway()+"/_/signin/sandbox?")
	if q, _ := url.ParseQuery(query); r.StatusCode != http.StatusSeeOther || !ok || q.Get("next") != origin+path {
		t.Fatalf("navigation to %s%s without a sandbox session: %d %q, want 303 to the gateway's /_/signin/sandbox?next=%s", origin, path, r.StatusCode, loc, origin+path)
	}
	r = c.Do(http.MethodGet, strings.TrimPrefix(loc, w.gateway()), nil, "Accept", "text/html")
	codeURL, ok := strings.CutPrefix(r.Header.Get("Location"), origin)
	if r.StatusCode != http.StatusSeeOther || !ok || !strings.HasPrefix(codeURL, "/_aaas/signin?") {
		t.Fatalf("the gateway's sign-in for %s: %d %q, want 303 to %s/_aaas/signin", origin, r.StatusCode, r.Header.Get("Location"), origin)
	}
	if q, _ := url.ParseQuery(strings.TrimPrefix(codeURL, "/_aaas/signin?")); q.Get("next") != path || len(q.Get("code")) < 43 {
		t.Fatalf("code URL %q: want a 32-byte code and next=%s", codeURL, path)
	}
	r = c.At(origin).Do(http.MethodGet, codeURL, nil, "Accept", "text/html")
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != path {
		t.Fatalf("trading the code: %d %q, want 303 to %s", r.StatusCode, r.Header.Get("Location"), path)
	}
	var ck *http.Cookie
	for _, k := range r.Cookies() {
		if k.Name == sandboxCookie {
			ck = k
		}
	}
	if ck == nil || !ck.HttpOnly || ck.SameSite != http.SameSiteLaxMode || ck.Path != "/" || ck.Domain != "" {
		t.Fatalf("sandbox cookie %+v: want %s, host-only, Path=/, HttpOnly, SameSite=Lax", ck, sandboxCookie)
	}
	return codeURL
}

// cookieOf is the value of the named cookie c holds for origin.
func cookieOf(c *testenv.Client, origin, name string) string {
	if k := c.At(origin).Cookie(name); k != nil {
		return k.Value
	}
	return ""
}

// The whole journey in subdomain mode, through nginx and two edges, as an
// HTTP client sees it: the gateway's old path redirects to the user's
// origin; the code trade signs the client in there, once per code, only
// for its own host and user; HTTP, SSE, WebSocket (after the edge's DSH
// handshake) work there; the origin rules are exact (bob's origin is not
// kai's); gateway routes on a sandbox host reach DSH, not the gateway; a
// suspended sandbox wakes on a request to its origin; bearer tokens work
// there; and a logout on the gateway ends the sandbox session on every
// edge and closes its WebSocket with 4401.
func TestSubdomainJourney(t *testing.T) {
	w := newWorld(t, nil, nil)
	kai := w.client()
	token := kai.Signup("kai", "")
	w.client().Signup("bob", "")
	waitReady(t, w, "kai")
	origin := w.sandbox("kai")

	// The gateway never serves a tenant byte: its old path redirects.
	r := kai.Do(http.MethodGet, "/u/kai/api/echo?x=1", nil)
	if r.StatusCode != http.StatusMovedPermanently || r.Header.Get("Location") != origin+"/api/echo?x=1" {
		t.Fatalf("GET /u/kai/api/echo?x=1 on the gateway: %d %q", r.StatusCode, r.Header.Get("Location"))
	}
	r = kai.Do(http.MethodPost, "/u/kai/api/echo", strings.NewReader("x"))
	if r.StatusCode != http.StatusPermanentRedirect || r.Header.Get("Location") != origin+"/api/echo" {
		t.Fatalf("POST /u/kai/api/echo on the gateway: %d %q", r.StatusCode, r.Header.Get("Location"))
	}

	// Without a sandbox session, an API request is refused, not redirected.
	expectStatus(t, kai.At(origin).Do(http.MethodGet, "/api/files", nil, "Accept", "application/json"), http.StatusUnauthorized, "API request without a sandbox session")

	// The code trade, then the app through the edge's handshake.
	codeURL := signInOnSandbox(t, w, kai, "kai", "/")
	sbx := kai.At(origin)
	r = sbx.Do(http.MethodGet, "/", nil, "Accept", "text/html")
	if r.StatusCode != http.StatusOK || !strings.Contains(string(r.Body), `id="chat-input"`) {
		t.Fatalf("the app on kai's origin: %d %.300s", r.StatusCode, r.Body)
	}

	// A code is good once, on whichever edge: the trade above took it.
	for _, e := range w.edges {
		r := w.edgeClient(e, origin).Do(http.MethodGet, codeURL, nil, "Accept", "text/html")
		if r.StatusCode != http.StatusBadRequest || len(r.Cookies()) != 0 {
			t.Errorf("the used code again on %s: %d, cookies %v; want 400 and none", e.Name, r.StatusCode, r.Cookies())
		}
	}
	// A code for kai's origin is refused on bob's; kai cannot ask for one
	// for bob's.
	fresh := kai.Do(http.MethodGet, "/_/signin/sandbox?next="+url.QueryEscape(origin+"/"), nil, "Accept", "text/html")
	freshURL, ok := strings.CutPrefix(fresh.Header.Get("Location"), origin)
	if fresh.StatusCode != http.StatusSeeOther || !ok {
		t.Fatalf("a fresh code for kai's origin: %d %q", fresh.StatusCode, fresh.Header.Get("Location"))
	}
	stranger := w.client().At(w.sandbox("bob"))
	if r := stranger.Do(http.MethodGet, freshURL, nil, "Accept", "text/html"); r.StatusCode != http.StatusForbidden || len(r.Cookies()) != 0 {
		t.Errorf("kai's code on bob's origin: %d, cookies %v; want 403 and none", r.StatusCode, r.Cookies())
	}
	if r := kai.Do(http.MethodGet, "/_/signin/sandbox?next="+url.QueryEscape(w.sandbox("bob")+"/"), nil, "Accept", "text/html"); r.StatusCode != http.StatusForbidden || r.Header.Get("Location") != "" {
		t.Errorf("kai asking for a code for bob's origin: %d %q; want 403 and no code", r.StatusCode, r.Header.Get("Location"))
	}

	// What DSH receives: its own Host, the sandbox host forwarded, none of
	// the gateway's cookies.
	var e struct {
		Path, Query, Host string
		Headers           map[string][]string
	}
	r = sbx.Do(http.MethodGet, "/api/echo?y=2", nil)
	if err := json.Unmarshal(r.Body, &e); err != nil || r.StatusCode != http.StatusOK {
		t.Fatalf("echo on kai's origin: %d %v %.300s", r.StatusCode, err, r.Body)
	}
	if !strings.HasPrefix(e.Host, "localhost:") || e.Path != "/api/echo" || e.Query != "y=2" {
		t.Errorf("DSH saw Host %q, path %q, query %q; want localhost:<port>, /api/echo, y=2", e.Host, e.Path, e.Query)
	}
	if got := strings.Join(e.Headers["X-Forwarded-Host"], ","); got != strings.TrimPrefix(origin, "http://") {
		t.Errorf("DSH saw X-Forwarded-Host %q, want %s", got, strings.TrimPrefix(origin, "http://"))
	}
	for _, h := range e.Headers["Cookie"] {
		if strings.Contains(h, sandboxCookie) || strings.Contains(h, "dsh_gw_session") {
			t.Errorf("a gateway cookie reached DSH: %q", h)
		}
	}

	// The gateway's routes do not exist on a sandbox host: they reach DSH.
	for _, path := range []string{"/_/status", "/_/admin/users", "/users", "/login"} {
		r := sbx.Do(http.MethodGet, path, nil, "Accept", "application/json")
		if r.StatusCode != http.StatusNotFound || strings.Contains(string(r.Body), `"user"`) {
			t.Errorf("GET %s on kai's origin: %d %.200s; want DSH's 404", path, r.StatusCode, r.Body)
		}
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if log := w.PodLog("kai"); !strings.Contains(log, "dsh: GET /_/status 404") {
			return errors.New("DSH has not logged GET /_/status")
		}
		return nil
	})

	// Mutations with the sandbox cookie: from kai's own origin only.
	for _, tc := range []struct {
		origin string
		want   int
	}{{origin, http.StatusOK}, {w.sandbox("bob"), http.StatusForbidden}, {w.gateway(), http.StatusForbidden}, {"", http.StatusForbidden}} {
		r := sbx.Do(http.MethodPost, "/api/echo", strings.NewReader("x"), "Origin", tc.origin)
		if r.StatusCode != tc.want {
			t.Errorf("POST on kai's origin with Origin %q: %d, want %d", tc.origin, r.StatusCode, tc.want)
		}
	}

	// SSE and WebSocket with the sandbox cookie; a socket named from
	// another origin is refused.
	sid := cookieOf(kai, origin, sandboxCookie)
	cookie := func(from string) http.Header {
		return http.Header{"Cookie": {sandboxCookie + "=" + sid}, "Origin": {from}}
	}
	r = sbx.Do(http.MethodGet, "/api/events?interval=20&count=3", nil)
	if n := strings.Count(string(r.Body), "event: tick"); r.StatusCode != http.StatusOK || n != 3 {
		t.Errorf("SSE on kai's origin: %d, %d events; want 3", r.StatusCode, n)
	}
	echoOnce(t, w, origin+"/api/ws", cookie(origin), "with the sandbox cookie")
	// The edge refuses a socket the way browsers can see: it upgrades
	// and closes at once, here with 4403.
	for _, from := range []string{w.sandbox("bob"), w.gateway()} {
		if code := refusedWith(t, w, origin+"/api/ws", cookie(from)); code != 4403 {
			t.Errorf("a WebSocket to kai's origin named from %s: close code %d, want 4403", from, code)
		}
	}

	// Bearer tokens, as API clients use them: on kai's origin, not bob's.
	api := w.client().At(origin)
	expectStatus(t, api.Do(http.MethodGet, "/api/files", nil, "Authorization", "Bearer "+token), http.StatusOK, "bearer on kai's origin")
	echoOnce(t, w, origin+"/api/ws", http.Header{"Authorization": {"Bearer " + token}}, "with the bearer token")
	if r := w.client().At(w.sandbox("bob")).Do(http.MethodGet, "/api/files", nil, "Authorization", "Bearer "+token); r.StatusCode == http.StatusOK {
		t.Errorf("kai's token on bob's origin: %d", r.StatusCode)
	}

	// A suspended sandbox wakes on a request to its origin.
	before := w.Box("kai").ReadySince
	w.Suspend("kai")
	testutil.Eventually(t, 3*time.Minute, func() error {
		r := sbx.Do(http.MethodGet, "/api/files", nil)
		if r.StatusCode != http.StatusOK {
			return fmt.Errorf("GET /api/files on kai's origin while waking: %d", r.StatusCode)
		}
		return nil
	})
	if after := w.Box("kai").ReadySince; !after.After(before) {
		t.Errorf("kai's sandbox ReadySince %s, before the suspend %s: not woken", after, before)
	}

	// Logout on the gateway ends the sandbox session on every edge, and
	// its open WebSocket with 4401.
	ws, _, err := w.dialWS(origin+"/api/ws", cookie(origin))
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	closed := make(chan int, 1)
	go func() {
		for {
			if _, _, err := ws.ReadMessage(); err != nil {
				var ce *websocket.CloseError
				code := -1
				if errors.As(err, &ce) {
					code = ce.Code
				}
				closed <- code
				return
			}
		}
	}()
	events := openSSE(t, w, origin+"/api/events?interval=200&count=100000", cookie(origin))
	expectStatus(t, kai.Do(http.MethodPost, "/logout", nil, "Accept", "application/json"), http.StatusNoContent, "logout on the gateway")
	select {
	case code := <-closed:
		if code != 4401 {
			t.Errorf("the sandbox origin's WebSocket closed with %d after the logout, want 4401", code)
		}
	case <-time.After(hangGuard):
		t.Fatalf("the sandbox origin's WebSocket still open %s after the logout", hangGuard)
	}
	select {
	case <-events:
	case <-time.After(hangGuard):
		t.Fatalf("the sandbox origin's event stream still open %s after the logout", hangGuard)
	}
	for _, e := range w.edges {
		c := w.edgeClient(e, origin)
		testutil.Eventually(t, hangGuard, func() error {
			if r := c.Do(http.MethodGet, "/api/files", nil, "Cookie", sandboxCookie+"="+sid); r.StatusCode != http.StatusUnauthorized {
				return fmt.Errorf("the sandbox cookie on %s after the logout: %d", e.Name, r.StatusCode)
			}
			return nil
		})
	}
	expectStatus(t, api.Do(http.MethodGet, "/api/files", nil, "Authorization", "Bearer "+token), http.StatusOK, "bearer after the logout")
}

func expectStatus(t *testing.T, r *testenv.Response, status int, what string) {
	t.Helper()
	if r.StatusCode != status {
		t.Fatalf("%s: status %d, want %d (%.300s)", what, r.StatusCode, status, r.Body)
	}
}

// echoOnce opens a WebSocket with h through the front and has one message
// echoed.
func echoOnce(t *testing.T, w *world, url string, h http.Header, what string) {
	t.Helper()
	ws, resp, err := w.dialWS(url, h)
	if err != nil {
		t.Fatalf("WebSocket %s: %v %v", what, resp, err)
	}
	defer ws.Close()
	if err := ws.WriteMessage(websocket.TextMessage, []byte("ping "+what)); err != nil {
		t.Fatal(err)
	}
	_ = ws.SetReadDeadline(time.Now().Add(hangGuard))
	if _, msg, err := ws.ReadMessage(); err != nil || string(msg) != "ping "+what {
		t.Fatalf("WebSocket %s: echo %q %v", what, msg, err)
	}
}

// refusedWith opens a WebSocket that the edge must refuse, sends a message
// and returns the close code that ends it (-1 for another end, with the
// failure logged).
func refusedWith(t *testing.T, w *world, url string, h http.Header) int {
	t.Helper()
	ws, resp, err := w.dialWS(url, h)
	if err != nil {
		t.Logf("WebSocket %s: refused before the upgrade: %v %v", url, resp, err)
		return -1
	}
	defer ws.Close()
	_ = ws.WriteMessage(websocket.TextMessage, []byte("must not be echoed"))
	_ = ws.SetReadDeadline(time.Now().Add(hangGuard))
	_, msg, err := ws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) {
		t.Logf("WebSocket %s: read %q, %v instead of a close", url, msg, err)
		return -1
	}
	return ce.Code
}

// openSSE opens an event stream through the front, waits for its first
// event and returns a channel closed when the stream ends.
func openSSE(t *testing.T, w *world, url string, h http.Header) <-chan struct{} {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header = h.Clone()
	client := &http.Client{Transport: &http.Transport{DialContext: w.dialFront}}
	resp, err := client.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("event stream %s: %v %v", url, resp, err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	first, done := make(chan struct{}), make(chan struct{})
	go func() {
		r := bufio.NewReader(resp.Body)
		once := false
		for {
			line, err := r.ReadString('\n')
			if strings.HasPrefix(line, "data:") && !once {
				once = true
				close(first)
			}
			if err != nil {
				close(done)
				return
			}
		}
	}()
	select {
	case <-first:
	case <-time.After(time.Minute):
		t.Fatalf("event stream %s: no first event", url)
	}
	return done
}

// The journey in Chromium: signup on the gateway, "Continue to my
// sandbox" lands on the user's own origin (through the code trade) with
// the app working (chat streamed, WebSocket, SSE); the gateway's cookie
// stays on the gateway's host and the sandbox's on the sandbox's; a
// suspended sandbox shows the starting page on its origin and wakes into
// the app; signing out on the gateway signs the sandbox origin out too.
func TestBrowserSubdomainJourney(t *testing.T) {
	w := newWorld(t, nil, nil)
	ctx := w.browser("ann")
	testenv.Do(t, ctx, "sign up on the gateway",
		chromedp.Navigate(w.gateway()+"/"),
		chromedp.SendKeys(chromedp.ID("signup-user"), "ann"),
		chromedp.Click(chromedp.ID("signup-submit")),
		chromedp.WaitVisible(chromedp.ID("continue")),
		chromedp.Click(chromedp.ID("continue")),
		chromedp.WaitVisible(chromedp.ID("chat-input")),
		testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, time.Minute),
	)
	if loc := testenv.Get(t, ctx, "location", chromedp.Location()); loc != w.sandbox("ann")+"/" {
		t.Fatalf("the app is at %s, want %s/", loc, w.sandbox("ann"))
	}
	testenv.Do(t, ctx, "chat, WebSocket and events on ann's origin",
		chromedp.SendKeys(chromedp.ID("chat-input"), "hi agent\n"),
		testenv.Until(`!!document.querySelector("#chat-log .assistant.done")`, 30*time.Second),
		chromedp.SendKeys(chromedp.ID("ws-input"), "ping-1\n"),
		testenv.Until(`[...document.querySelectorAll("#ws-log .in")].some(p => p.textContent === "ping-1")`, 30*time.Second),
		testenv.Until(`document.querySelectorAll("#events li").length >= 2`, 30*time.Second),
	)
	testenv.Screenshot(t, ctx, "subdomain-app")
	for origin, want := range map[string][]string{w.gateway(): {"dsh_gw_session", auth.UserCookie("dsh_gw_session")}, w.sandbox("ann"): {sandboxCookie}} {
		got := cookieNames(t, ctx, origin)
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("the browser sends %s the cookies %v, want only %v", origin, got, want)
		}
	}

	w.Suspend("ann")
	testenv.Do(t, ctx, "the starting page on ann's origin, then the app",
		chromedp.Reload(),
		chromedp.WaitVisible(chromedp.ID("starting")),
		chromedp.WaitVisible(chromedp.ID("chat-input")),
		testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, time.Minute),
	)
	if loc := testenv.Get(t, ctx, "location", chromedp.Location()); loc != w.sandbox("ann")+"/" {
		t.Fatalf("after the wake the page is at %s", loc)
	}

	testenv.Do(t, ctx, "sign out on the gateway",
		chromedp.Navigate(w.gateway()+"/"),
		chromedp.Click(chromedp.ID("logout")),
		chromedp.WaitVisible(chromedp.ID("signup")),
	)
	// Back on ann's origin the sandbox cookie no longer signs her in: the
	// origin sends the browser to the gateway, which shows sign-in.
	testenv.Do(t, ctx, "ann's origin after the logout",
		chromedp.Navigate(w.sandbox("ann")+"/"),
		chromedp.WaitVisible(chromedp.ID("login")),
	)
	if loc := testenv.Get(t, ctx, "location", chromedp.Location()); !strings.HasPrefix(loc, w.gateway()+"/") {
		t.Fatalf("after the logout ann's origin left the browser at %s", loc)
	}
}

// cookieNames are the names of the cookies the browser holds for origin.
func cookieNames(t *testing.T, ctx context.Context, origin string) []string {
	t.Helper()
	res, err := chromedp.Call(ctx, network.GetCookies, network.GetCookiesParams{URLs: []string{origin + "/"}})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range res.Cookies {
		names = append(names, c.Name)
	}
	return names
}
