package proxy_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/state"
)

// A preview app started inside a sandbox (dshsim's, running from boot as
// an agent's dev server would), through real edges in subdomain mode: its
// owner signs in on its own origin (its own code and cookie) and reaches
// it over HTTP and over a hot-reload WebSocket; it gets none of the
// browser's credentials and no DSH cookie; another user is refused (no
// code minted) unless PREVIEW_ACCESS=users; an unlisted port is 404 and a
// listed one nothing listens on a clear 502, at once; and a preview wakes
// a suspended sandbox.
func TestPreviews(t *testing.T) {
	w := newStack(t, func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		c.Env = append(c.Env, corev1.EnvVar{Name: "DSHSIM_APPS", Value: "5173"})
	})
	env := map[string]string{"SANDBOX_DOMAIN": sandboxDomain, "PREVIEW_PORTS": "5173,8000"}
	owners := w.Edge("edge-a", env)
	env["PREVIEW_ACCESS"] = "users"
	everyone := w.Edge("edge-b", env)
	annc, bobc := testenv.NewClient(t, owners.URL), testenv.NewClient(t, owners.URL)
	ann, bob := "Bearer "+annc.Signup("ann", ""), "Bearer "+bobc.Signup("bob", "")
	annGW, bobGW := annc.Cookie("dsh_gw_session").Value, bobc.Cookie("dsh_gw_session").Value
	host := "5173-ann." + sandboxDomain

	// The owner signs in on the preview's own origin (its own code and
	// cookie, which opens neither the DSH origin nor any other), then asks
	// with every cookie a browser could hold for it.
	code, trade := originSignIn(t, owners, annGW, host, "/echo")
	r := at(t, owners, "GET", host, trade, nil, "Accept", "text/html")
	sid := sandboxSession(r)
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != "/echo" || sid == "" {
		t.Fatalf("trade on the preview origin: %d %q %v", r.StatusCode, r.Header.Get("Location"), r.Header.Values("Set-Cookie"))
	}
	expect(t, at(t, owners, "GET", "ann."+sandboxDomain, "/api/echo", nil, "Cookie", "aaas_sandbox="+sid), http.StatusUnauthorized, "the preview's cookie on the DSH origin")
	cookies := "dsh_gw_session=" + annGW + "; aaas_sandbox=" + sid + "; __Host-aaas-sandbox=" + sid + "; dsh-auth-0123=dsh"
	r = at(t, owners, "GET", host, "/echo?x=1", nil, "Cookie", cookies)
	expect(t, r, http.StatusOK, "the owner's preview")
	var got struct {
		Host    string              `json:"host"`
		Query   string              `json:"query"`
		Headers map[string][]string `json:"headers"`
	}
	if err := json.Unmarshal(r.Body, &got); err != nil {
		t.Fatalf("echo: %v (%s)", err, r.Body)
	}
	if got.Host != "localhost:5173" || got.Query != "x=1" || strings.Join(got.Headers["X-Forwarded-Host"], ",") != host {
		t.Fatalf("the app got %+v", got)
	}
	for _, h := range []string{"Cookie", "Authorization", "X-Forwarded-Prefix"} {
		if v, ok := got.Headers[h]; ok {
			t.Errorf("the app got %s: %q", h, v)
		}
	}
	if r := at(t, owners, "GET", host, "/", nil, "Cookie", cookies); r.StatusCode != http.StatusOK || len(r.Header.Values("Set-Cookie")) != 0 {
		t.Errorf("the page: %d, the app set %q on the preview origin", r.StatusCode, r.Header.Values("Set-Cookie"))
	}

	// Hot reload: the page's socket, and a push from the app through it.
	d := websocket.Dialer{Subprotocols: []string{"vite-hmr"}, HandshakeTimeout: time.Minute}
	ws, resp, err := d.Dial("ws"+strings.TrimPrefix(owners.URL, "http")+"/hmr", http.Header{
		"Host": {host}, "Cookie": {cookies}, "Origin": {"http://" + host},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	if sp := resp.Header.Get("Sec-WebSocket-Protocol"); sp != "vite-hmr" {
		t.Fatalf("subprotocol %q", sp)
	}
	read := func() string {
		t.Helper()
		_ = ws.SetReadDeadline(time.Now().Add(time.Minute))
		_, b, err := ws.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if m := read(); m != `{"type":"connected"}` {
		t.Fatalf("first message %q", m)
	}
	// A sibling origin's page cannot drive the app with ann's cookie.
	expect(t, at(t, owners, "POST", host, "/__reload", nil, "Cookie", cookies, "Origin", "http://ann."+sandboxDomain), http.StatusForbidden, "a reload from the DSH origin")
	expect(t, at(t, owners, "POST", host, "/__reload", nil, "Cookie", cookies, "Origin", "http://"+host), http.StatusOK, "a reload")
	if m := read(); m != `{"type":"full-reload","path":"*"}` {
		t.Fatalf("pushed %q", m)
	}

	// Another user: refused where previews are the owner's, admitted where
	// they are every user's (a code minted for them there, none here); no
	// credentials: 401 on both.
	st := newOriginState(t, w)
	before := st.codeCount(t)
	r = at(t, owners, "GET", gatewayHost(owners), "/_/signin/sandbox?next="+url.QueryEscape("http://"+host+"/"), nil, "Cookie", "dsh_gw_session="+bobGW, "Accept", "text/html")
	if expect(t, r, http.StatusForbidden, "a code for ann's preview, as bob, PREVIEW_ACCESS=owner"); st.codeCount(t) != before {
		t.Fatal("a code was minted for another user's preview")
	}
	_, trade = originSignIn(t, everyone, bobGW, host, "/echo")
	r = at(t, everyone, "GET", host, trade, nil, "Accept", "text/html")
	expect(t, r, http.StatusSeeOther, "bob's trade on ann's preview, PREVIEW_ACCESS=users")
	expect(t, at(t, everyone, "GET", host, "/echo", nil, "Cookie", "aaas_sandbox="+sandboxSession(r)), http.StatusOK, "bob's cookie on ann's preview, PREVIEW_ACCESS=users")
	r = at(t, owners, "GET", host, "/echo", nil, "Authorization", bob)
	expect(t, r, http.StatusForbidden, "another user's preview, PREVIEW_ACCESS=owner")
	expect(t, at(t, everyone, "GET", host, "/echo", nil, "Authorization", bob), http.StatusOK, "another user's preview, PREVIEW_ACCESS=users")
	expect(t, at(t, everyone, "GET", host, "/echo", nil, "Authorization", ann), http.StatusOK, "the owner on the open edge")
	for _, e := range []*testenv.Edge{owners, everyone} {
		expect(t, at(t, e, "GET", host, "/echo", nil), http.StatusUnauthorized, "no credentials")
	}

	// A port that is not listed, signed in or not; a listed port nothing
	// listens on, over HTTP and WebSocket.
	for _, auth := range []string{ann, ""} {
		r = at(t, owners, "GET", "3000-ann."+sandboxDomain, "/", nil, "Authorization", auth, "Accept", "text/html")
		if expect(t, r, http.StatusNotFound, "an unlisted port"); !strings.Contains(string(r.Body), "not a preview port") {
			t.Fatalf("unlisted port page: %s", r.Body)
		}
	}
	idle := "8000-ann." + sandboxDomain
	r = at(t, owners, "GET", idle, "/", nil, "Authorization", ann, "Accept", "text/html")
	if expect(t, r, http.StatusBadGateway, "nothing listening"); !strings.Contains(string(r.Body), "Nothing is listening on port 8000 in your sandbox") {
		t.Fatalf("nothing listening page: %s", r.Body)
	}
	iws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(owners.URL, "http")+"/hmr", http.Header{"Host": {idle}, "Authorization": {ann}})
	if err != nil {
		t.Fatal(err)
	}
	_ = iws.SetReadDeadline(time.Now().Add(time.Minute))
	_, _, err = iws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != websocket.CloseInternalServerErr || !strings.HasPrefix(ce.Text, "Nothing is listening on port 8000") {
		t.Fatalf("a socket to nothing: %v", err)
	}
	iws.Close()

	for _, e := range []*testenv.Edge{owners, everyone} {
		if logs := e.Logs(); strings.Contains(logs, code) || strings.Contains(logs, sid) {
			t.Errorf("%s logged the preview's sign-in code or session id", e.Name)
		}
	}

	// Wake on connect: a preview of a suspended sandbox wakes it, and the
	// app, which runs from boot, answers.
	ws.Close()
	w.Suspend("ann")
	r = at(t, owners, "GET", host, "/echo", nil, "Authorization", ann)
	expect(t, r, http.StatusOK, "a preview of a suspended sandbox")
	// The edge routed it, so the sandbox was Ready in its copy; the
	// test's read of the bucket may be a moment behind it.
	testutil.Eventually(t, time.Minute, func() error {
		if b := w.Box("ann"); b.Phase != state.PhaseReady {
			return fmt.Errorf("after the preview's wake: %+v", b)
		}
		return nil
	})
}

// sandboxSession is the sandbox session id a trade set ("" for none).
func sandboxSession(r *testenv.Response) string {
	for _, ck := range r.Cookies() {
		if ck.Name == "aaas_sandbox" {
			return ck.Value
		}
	}
	return ""
}

// TestBrowserPreviewHotReload opens a sandbox's app in Chromium on its
// preview origin (<port>-<user>.localhost, which Chromium resolves to
// loopback): the navigation signs in through the gateway with a code of
// its own, the page's hot-reload WebSocket connects, and a push from the
// app reloads the page. The browser holds only the preview origin's own
// session cookie there, none the app tried to set.
func TestBrowserPreviewHotReload(t *testing.T) {
	w := newStack(t, func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		c.Env = append(c.Env, corev1.EnvVar{Name: "DSHSIM_APPS", Value: "5173"})
	})
	front := w.FrontAddr()
	_, port, _ := strings.Cut(front, ":")
	domain := "localhost:" + port
	edge := w.Edge("edge-a", map[string]string{"SANDBOX_DOMAIN": domain, "PREVIEW_PORTS": "5173"})
	lb := testenv.NewBalancer(t, front, strings.TrimPrefix(edge.URL, "http://"))
	ctx := testenv.Browser(t)
	c := testenv.NewClient(t, lb.URL())
	token := c.Signup("ann", "")
	testenv.Do(t, ctx, "set the gateway's session cookie",
		chromedp.Navigate(lb.URL()+"/"),
		chromedp.Evaluate[chromedp.Void](`document.cookie = "dsh_gw_session=`+c.Cookie("dsh_gw_session").Value+`; path=/"`),
	)
	host := "5173-ann." + domain
	testenv.Do(t, ctx, "open the preview",
		chromedp.Navigate("http://"+host+"/"),
		testenv.Until(`location.href === "http://`+host+`/" && document.getElementById("status")?.textContent === "connected"`, 90*time.Second),
		chromedp.Evaluate[chromedp.Void](`window.beforeReload = true`),
	)
	expect(t, at(t, edge, "POST", host, "/__reload", nil, "Authorization", "Bearer "+token), http.StatusOK, "the app's reload")
	// Polled with single evaluations: the reload ends a poll running in
	// the page it replaces.
	testutil.Eventually(t, time.Minute, func() error {
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`window.beforeReload === undefined && document.getElementById("status")?.textContent === "connected"`))
		if err == nil && !ok {
			err = errors.New("the page did not reload and reconnect")
		}
		return err
	})
	testenv.Screenshot(t, ctx, "preview")
	if names := testenv.Cookies(t, ctx); len(names) != 1 || names[0] != "aaas_sandbox" {
		t.Fatalf("the browser holds %v on the preview origin, want its session cookie alone", names)
	}
}
