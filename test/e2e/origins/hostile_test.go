package origins_test

import (
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

//go:embed hostile_page.html
var hostilePage string

// hostileResults is what the page reports.
type hostileResults struct {
	Done     bool                     `json:"done"`
	Controls map[string]attemptResult `json:"controls"`
	Attacks  map[string]attemptResult `json:"attacks"`
}

type attemptResult struct {
	Succeeded bool   `json:"succeeded"`
	Detail    string `json:"detail"`
}

// The attacks the page makes; the test insists on every one, so a page
// that stopped early (or a renamed attack) cannot pass.
var wantAttacks = []string{
	"read /_/admin/users",
	"read /_/status",
	"admin revoke of bob (JSON API)",
	"admin revoke of bob (form, no-cors)",
	"read bob's sandbox origin",
	"read bob's sandbox through the gateway",
	"WebSocket to bob's sandbox",
	"read the gateway's cookies",
	"read the gateway's localStorage",
	"service worker from bob's origin",
	"service worker for the gateway's origin",
	"POST /recreate",
	"DELETE /users/ops",
}

var wantControls = []string{
	"read its own sandbox",
	"WebSocket to its own sandbox",
	"service worker for its own sandbox",
}

// A page an agent wrote into an administrator's workspace, opened by the
// administrator in Chromium, cannot use the administrator's gateway
// session (issue 22, security review S1): it cannot read or act on the
// admin API or the account endpoints, read or open a socket to another
// user's sandbox, see the gateway's cookies or storage, or register a
// service worker for another origin. Each attempt fails as the page sees it
// (it reports to its own sandbox, which the test reads back) and on the
// server: bob's session is still there, the administrator's sandbox and
// account are untouched, and the audit stream has no admin, recreate or
// delete event of theirs, while the administrator's own revoke from the
// admin page on the gateway's origin, in the same window, is there.
//
// On the code before sandbox origins (path mode: the page at
// /u/ops/api/files/hostile.html on the gateway's origin) the page reads the
// user list, revokes bob, recreates and deletes its own account: the test
// fails.
func TestHostilePageInAnAdministratorsSandbox(t *testing.T) {
	// The template trusts the gateway's name as path mode needs, so the
	// same test runs, and fails, on the code before sandbox origins.
	w := newWorld(t, nil, trustGatewayHost)
	gw := w.client()
	opsToken := gw.Signup("ops", "")
	w.makeAdmin("ops", opsToken)
	bob := w.client()
	bob.Signup("bob", "")
	w.client().Signup("cy", "")
	bobSessions := w.sessionKeys("bob")
	if len(bobSessions) == 0 {
		t.Fatal("bob has no session to lose")
	}
	opsBox := waitReady(t, w, "ops")

	// The agent's work: the page and a service worker script, put in ops's
	// workspace through the gateway with ops's token.
	const markerKey = "aaas-test-marker"
	marker := "gateway-storage-" + fmt.Sprint(time.Now().UnixNano())
	config, err := json.Marshal(map[string]any{
		"gateway": w.gateway(), "victimOrigin": w.sandbox("bob"), "victim": "bob", "self": "ops",
		"cookies":   []string{"dsh_gw_session", "aaas_sandbox", "__Host-aaas-sandbox"},
		"markerKey": markerKey, "marker": marker,
	})
	if err != nil {
		t.Fatal(err)
	}
	page := strings.Replace(hostilePage, "/*CONFIG*/null", string(config), 1)
	api := sandboxAPI{w: w, user: "ops", token: opsToken}
	api.put("hostile.html", page)
	api.put("sw.js", "self.addEventListener('install', () => self.skipWaiting());\n")

	// The administrator signs in on the gateway with their token, as the
	// landing page offers, and the gateway's origin keeps something in
	// its storage.
	ctx := w.browser("ops", "bob")
	testenv.Do(t, ctx, "sign in on the gateway",
		chromedp.Navigate(w.gateway()+"/"),
		chromedp.SendKeys(chromedp.ID("login-token"), opsToken),
		chromedp.Click(chromedp.ID("login-submit")),
	)
	// Signed in, the gateway sends the browser on to the sandbox.
	waitURL(t, ctx, "the redirect after signing in", func(u string) bool { return u != w.gateway()+"/" })
	testenv.Do(t, ctx, "the gateway's landing page, signed in",
		chromedp.Navigate(w.gateway()+"/"),
		chromedp.WaitVisible(chromedp.ID("account")),
		chromedp.Evaluate[chromedp.Void](fmt.Sprintf("localStorage.setItem(%q, %q)", markerKey, marker)),
	)

	// The old link to the page: on the gateway it redirects to ops's
	// origin, which signs the browser in there.
	wire := recordWire(t, ctx)
	testenv.Do(t, ctx, "open the page",
		chromedp.Navigate(w.gateway()+"/u/ops/api/files/hostile.html"),
		testenv.Until(`window.hostileReported === true`, 3*time.Minute),
	)
	testenv.Screenshot(t, ctx, "hostile-page")
	loc := testenv.Get(t, ctx, "location", chromedp.Location())
	t.Logf("the page ran at %s", loc)
	var seen hostileResults
	raw := testenv.Get(t, ctx, "the page's results", chromedp.Evaluate[string](`JSON.stringify(window.hostile)`))
	if err := json.Unmarshal([]byte(raw), &seen); err != nil {
		t.Fatalf("page results %q: %v", raw, err)
	}
	checkAttempts(t, "as the page saw it", seen)
	if t.Failed() {
		// The page got through; what it did needs no control to show.
		for _, kind := range []events.AuditKind{events.AuditRecreate, events.AuditDelete} {
			for _, ev := range w.Audit(kind, "ops") {
				t.Logf("audited: %s %s %s %s", ev.Kind, ev.User, ev.Outcome, ev.Detail)
			}
		}
		for _, ev := range w.Audit(events.AuditAdmin, "bob") {
			t.Logf("audited: %s %s %s %s", ev.Kind, ev.User, ev.Outcome, ev.Detail)
		}
		t.Logf("bob's sessions now %d, before the page %d", len(w.sessionKeys("bob")), len(bobSessions))
		t.FailNow()
	}

	// The simple requests (no preflight) left the browser with the
	// administrator's gateway cookie, the gateway and the sandboxes being
	// same-site, and the gateway refused them: its exact origin check, not
	// SameSite, is what stopped them.
	for _, want := range []struct{ method, url string }{
		{http.MethodPost, w.gateway() + "/_/admin/users/bob/revoke"},
		{http.MethodPost, w.gateway() + "/recreate"},
	} {
		r, ok := wire.find(want.method, want.url)
		switch {
		case !ok:
			t.Errorf("the browser sent no %s %s", want.method, want.url)
		case !r.Cookie || r.Status != http.StatusForbidden:
			t.Errorf("%s %s: the gateway cookie sent %v, answered %d; want sent and 403", want.method, want.url, r.Cookie, r.Status)
		default:
			t.Logf("%s %s left with the gateway cookie and was answered %d", want.method, want.url, r.Status)
		}
	}

	// The page's report in its own sandbox is the same.
	var stored hostileResults
	if err := json.Unmarshal([]byte(api.get("results.json")), &stored); err != nil {
		t.Errorf("results.json in ops's sandbox: %v", err)
	} else if !stored.Done || len(stored.Attacks) != len(seen.Attacks) {
		t.Errorf("results.json in ops's sandbox = %+v, the page saw %+v", stored, seen)
	}

	// The positive control, in the same window: the administrator's own
	// revoke of cy from the admin page on the gateway's origin, then one
	// through each edge with the token. Each edge publishes its audit
	// events in order on one connection, so once an edge's control event
	// is in the stream, any event the page caused on that edge is too.
	testenv.Do(t, ctx, "revoke cy from the admin page",
		chromedp.Navigate(w.gateway()+"/_/admin?q=cy"),
		chromedp.Click(chromedp.ID("revoke-cy")),
		chromedp.WaitVisible(chromedp.ID("confirm")),
		chromedp.Click(chromedp.ID("confirm")),
		chromedp.WaitVisible(chromedp.ID("notice")),
	)
	for _, e := range w.edges {
		r := w.edgeClient(e, w.gateway()).Do(http.MethodPost, "/_/admin/users/cy/revoke", strings.NewReader(`{"confirm":"cy"}`),
			"Authorization", "Bearer "+opsToken, "Content-Type", "application/json", "Accept", "application/json")
		if r.StatusCode != http.StatusOK {
			t.Fatalf("revoke cy through %s: %d %s", e.Name, r.StatusCode, r.Body)
		}
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if n := len(adminEvents(w, "cy", "revoke: ", "by ops")); n < 1+len(w.edges) {
			return fmt.Errorf("%d of the administrator's own revokes of cy in the audit stream, want %d", n, 1+len(w.edges))
		}
		return nil
	})

	// Nothing the page tried happened.
	for _, ev := range w.Audit(events.AuditAdmin, "bob") {
		t.Errorf("admin audit event about bob: %+v", ev)
	}
	for _, kind := range []events.AuditKind{events.AuditRecreate, events.AuditDelete} {
		for _, ev := range w.Audit(kind, "ops") {
			t.Errorf("%s audit event about ops: %+v", kind, ev)
		}
	}
	if got := w.sessionKeys("bob"); !sameKeys(got, bobSessions) {
		t.Errorf("bob's sessions %v, before the page %v", got, bobSessions)
	}
	if r := bob.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK {
		t.Errorf("bob's cookie after the page: %d %s", r.StatusCode, r.Body)
	}
	if b := w.Box("ops"); b.PodName != opsBox.PodName || b.Phase != state.PhaseReady {
		t.Errorf("ops's sandbox after the page: pod %s %s, before %s", b.PodName, b.Phase, opsBox.PodName)
	}
	if r := gw.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json", "Authorization", "Bearer "+opsToken); r.StatusCode != http.StatusOK {
		t.Errorf("ops's account after the page: %d %s", r.StatusCode, r.Body)
	}
}

// checkAttempts fails the test for every attack that succeeded or is
// missing, and for every control that did not succeed (then the failures
// mean nothing).
func checkAttempts(t *testing.T, what string, r hostileResults) {
	t.Helper()
	if !r.Done {
		t.Errorf("%s: the page did not finish: %+v", what, r)
	}
	for _, name := range wantControls {
		if c, ok := r.Controls[name]; !ok || !c.Succeeded {
			t.Errorf("%s: control %q did not succeed (%+v): the page could not use its own origin", what, name, c)
		}
	}
	for _, name := range wantAttacks {
		a, ok := r.Attacks[name]
		switch {
		case !ok:
			t.Errorf("%s: attack %q not reported", what, name)
		case a.Succeeded:
			t.Errorf("%s: attack %q SUCCEEDED: %s", what, name, a.Detail)
		default:
			t.Logf("%s: %q failed: %s", what, name, a.Detail)
		}
	}
}

// adminEvents are the admin audit events about user whose outcome starts
// with outcome and whose detail is detail.
func adminEvents(w *world, user, outcome, detail string) []events.AuditEvent {
	var out []events.AuditEvent
	for _, e := range w.Audit(events.AuditAdmin, user) {
		if strings.HasPrefix(e.Outcome, outcome) && e.Detail == detail {
			out = append(out, e)
		}
	}
	return out
}

func sameKeys(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// waitReady waits until user's sandbox is Ready and returns it.
func waitReady(t *testing.T, w *world, user string) state.Sandbox {
	t.Helper()
	testutil.Eventually(t, 3*time.Minute, func() error {
		if b := w.Box(user); b.Phase != state.PhaseReady {
			return fmt.Errorf("%s is %q", user, b.Phase)
		}
		return nil
	})
	return w.Box(user)
}

// sandboxAPI is DSH's file API of user's sandbox with user's bearer
// token, reached as an API client would: at /u/<user>/ on the gateway,
// following the gateway's redirect to the sandbox's origin when it sends
// one (the token is sent again there, as the user would).
type sandboxAPI struct {
	w     *world
	user  string
	token string
}

func (a sandboxAPI) do(method, name, body string) *testenv.Response {
	a.w.t.Helper()
	c := a.w.client()
	path := "/u/" + a.user + "/api/files/" + name
	for range 3 {
		r := c.Do(method, path, strings.NewReader(body), "Authorization", "Bearer "+a.token, "Origin", "")
		loc := r.Header.Get("Location")
		if r.StatusCode/100 != 3 || loc == "" {
			return r
		}
		if !strings.HasPrefix(loc, a.w.sandbox(a.user)+"/") {
			a.w.t.Fatalf("%s %s: redirected to %s, not to %s's origin", method, path, loc, a.user)
		}
		c = c.At(a.w.sandbox(a.user))
		path = strings.TrimPrefix(loc, a.w.sandbox(a.user))
	}
	a.w.t.Fatalf("%s %s: too many redirects", method, name)
	return nil
}

func (a sandboxAPI) put(name, body string) {
	a.w.t.Helper()
	if r := a.do(http.MethodPut, name, body); r.StatusCode != http.StatusCreated {
		a.w.t.Fatalf("PUT %s in %s's sandbox: %d %s", name, a.user, r.StatusCode, r.Body)
	}
}

func (a sandboxAPI) get(name string) string {
	a.w.t.Helper()
	r := a.do(http.MethodGet, name, "")
	if r.StatusCode != http.StatusOK {
		a.w.t.Errorf("GET %s in %s's sandbox: %d %.300s", name, a.user, r.StatusCode, r.Body)
	}
	return string(r.Body)
}

// waitURL waits until the page's URL satisfies ok, through navigations
// (which fail an evaluation that spans them).
func waitURL(t *testing.T, ctx context.Context, what string, ok func(string) bool) string {
	t.Helper()
	var at string
	testutil.Eventually(t, time.Minute, func() error {
		u, err := chromedp.Run(ctx, chromedp.Evaluate[string](`location.href`))
		if err != nil {
			return err
		}
		if at = u; !ok(u) {
			return fmt.Errorf("%s: at %s", what, u)
		}
		return nil
	})
	return at
}

// wireLog is what the browser sent and received, as the DevTools protocol
// reports it: per request, its method and URL, whether the raw request
// carried the gateway's session cookie, and the status that came back
// (also when CORS hides the answer from the page).
type wireLog struct {
	mu   sync.Mutex
	reqs map[network.RequestID]*wireRequest
}

type wireRequest struct {
	Method, URL string
	Cookie      bool
	Status      int
}

func recordWire(t *testing.T, ctx context.Context) *wireLog {
	t.Helper()
	l := &wireLog{reqs: map[network.RequestID]*wireRequest{}}
	get := func(id network.RequestID) *wireRequest {
		if l.reqs[id] == nil {
			l.reqs[id] = &wireRequest{}
		}
		return l.reqs[id]
	}
	err := chromedp.Listen(ctx, func(ev any) {
		l.mu.Lock()
		defer l.mu.Unlock()
		switch e := ev.(type) {
		case *network.EventRequestWillBeSent:
			r := get(e.RequestID)
			r.Method, r.URL = e.Request.Method, e.Request.URL
		case *network.EventRequestWillBeSentExtraInfo:
			for k, v := range e.Headers {
				if s, _ := v.(string); strings.EqualFold(k, "cookie") && strings.Contains(s, "dsh_gw_session=") {
					get(e.RequestID).Cookie = true
				}
			}
		case *network.EventResponseReceivedExtraInfo:
			get(e.RequestID).Status = int(e.StatusCode)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// find is a request with method to url that got an answer (a preflighted
// one that was never sent has none).
func (l *wireLog) find(method, url string) (wireRequest, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.reqs {
		if r.Method == method && r.URL == url && r.Status != 0 {
			return *r, true
		}
	}
	return wireRequest{}, false
}
