package idle_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/fasthttp/websocket"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/notify"
	"github.com/aaas-project/aaas/internal/state"
)

// socket is a WebSocket to a user's DSH whose close the test can read.
type socket struct {
	ws     *websocket.Conn
	mu     sync.Mutex
	closed *websocket.CloseError
	done   chan struct{}
}

// dial opens /u/<user>/api/ws with c's session; headers are name, value
// pairs (a browser's Sec-Fetch-Mode, say).
func dial(t *testing.T, edge *testenv.Edge, c *testenv.Client, user string, headers ...string) *socket {
	t.Helper()
	h := http.Header{"Cookie": {"dsh_gw_session=" + c.Cookie("dsh_gw_session").Value}}
	for i := 0; i+1 < len(headers); i += 2 {
		h.Set(headers[i], headers[i+1])
	}
	ws, _, err := (&websocket.Dialer{}).Dial(strings.Replace(edge.URL, "http", "ws", 1)+"/u/"+user+"/api/ws", h)
	if err != nil {
		t.Fatal(err)
	}
	s := &socket{ws: ws, done: make(chan struct{})}
	t.Cleanup(func() { ws.Close() })
	go func() {
		defer close(s.done)
		for {
			if _, _, err := ws.ReadMessage(); err != nil {
				var ce *websocket.CloseError
				if errors.As(err, &ce) {
					s.mu.Lock()
					s.closed = ce
					s.mu.Unlock()
				}
				return
			}
		}
	}()
	return s
}

// closedWith waits for the socket to end and returns how.
func (s *socket) closedWith(t *testing.T, within time.Duration) *websocket.CloseError {
	t.Helper()
	select {
	case <-s.done:
	case <-time.After(within):
		t.Fatalf("socket still open after %s", within)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed == nil {
		t.Fatal("socket ended without a close frame")
	}
	return s.closed
}

// typeEvery sends a frame from the "browser" every d until the socket
// ends: a user typing.
func (s *socket) typeEvery(d time.Duration) {
	go func() {
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-s.done:
				return
			case <-t.C:
				if s.ws.WriteMessage(websocket.TextMessage, []byte("typing")) != nil {
					return
				}
			}
		}
	}()
}

// lastSuspend is the reason recorded for user's last suspend.
func lastSuspend(t *testing.T, w *testenv.Stack, user string) *state.Suspension {
	t.Helper()
	e, _ := w.Sandboxes().Get(user)
	return e.Value.LastSuspend
}

// A tab left open with no input stops counting after
// IDLE_CONNECTED_TIMEOUT: its sandbox is suspended IDLE_TIMEOUT later
// (reason idle_connected), the socket is closed with 4408, the page
// reconnecting does not wake it, and the user's navigation does, with the
// reason on the starting page. A user typing on the same kind of socket,
// the whole time, is never suspended.
func TestAForgottenTabDoesNotPinItsSandbox(t *testing.T) {
	idle, connected := 3*time.Second, 10*time.Second
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": "200ms",
		"IDLE_CONNECTED_TIMEOUT": connected.String(),
	}, Lifecycle: "lc-a"})
	sweeps := map[string]*testenv.Sweeps{"sw-a": testenv.FollowSweeps(t, w.Sweeper("sw-a", nil))}
	edge := w.Edge("edge-a", nil)
	tab, typist := testenv.NewClient(t, edge.URL), testenv.NewClient(t, edge.URL)
	tab.Signup("tab", "")
	typist.Signup("typist", "")
	opened := time.Now()
	forgotten := dial(t, edge, tab, "tab")
	typing := dial(t, edge, typist, "typist")
	typing.typeEvery(500 * time.Millisecond)

	suspendedAt(t, w, "tab", 2*time.Minute)
	ce := forgotten.closedWith(t, time.Minute)
	if ce.Code != 4408 || !strings.Contains(ce.Text, "idle_connected") {
		t.Fatalf("the forgotten tab's socket closed with %d %q, want 4408 naming idle_connected", ce.Code, ce.Text)
	}
	w.DecidedOnTime("tab", idle, sweeps)
	d, ok := w.Decision("tab")
	if !ok || d.At.Sub(opened) < connected+idle {
		t.Fatalf("decided %s after the tab opened, before IDLE_CONNECTED_TIMEOUT + IDLE_TIMEOUT (%s)", d.At.Sub(opened), connected+idle)
	}
	if ls := lastSuspend(t, w, "tab"); ls == nil || ls.Reason != "idle_connected" || !strings.Contains(ls.Detail, "tab was left open") {
		t.Fatalf("recorded suspend %+v, want reason idle_connected", ls)
	}
	// The control, in the same window: typing all along, never asked.
	if e, _ := w.Sandboxes().Get("typist"); e.Value.Phase != state.PhaseReady {
		t.Fatalf("the typist's sandbox is %s", e.Value.Phase)
	}
	if a := w.Audit(events.AuditSuspend, "typist"); len(a) != 0 {
		t.Fatalf("the typist's sandbox was judged idle: %+v", a)
	}

	// The page reconnects by itself: told the sandbox is paused, and it
	// stays asleep (no wake asked).
	paused, err := edge.MetricSum("aaas_edge_wakes_total", "outcome", "paused")
	if err != nil {
		t.Fatal(err)
	}
	again := dial(t, edge, tab, "tab", "Sec-Fetch-Mode", "websocket", "Sec-Fetch-Site", "same-origin")
	if ce := again.closedWith(t, time.Minute); ce.Code != 4408 || !strings.Contains(ce.Text, "Reload") && !strings.Contains(ce.Text, "Suspended") {
		t.Fatalf("the page's reconnect closed with %d %q, want 4408 saying it is paused", ce.Code, ce.Text)
	}
	if n, _ := edge.MetricSum("aaas_edge_wakes_total", "outcome", "paused"); n != paused+1 {
		t.Fatalf("paused refusals %v, want %v", n, paused+1)
	}
	if e, _ := w.Sandboxes().Get("tab"); e.Value.Phase != state.PhaseSuspended || len(woken(w, "tab")) != 0 {
		t.Fatalf("after the page's reconnect: %s, wakes %v", e.Value.Phase, woken(w, "tab"))
	}
	// The user comes back: the navigation wakes it and says why it slept.
	r := tab.Do("GET", "/u/tab/", nil, "Accept", "text/html", "Sec-Fetch-Mode", "navigate")
	if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "because a tab was left open") || !strings.Contains(string(r.Body), "your files were kept") {
		t.Fatalf("the starting page after the suspend: %d %s", r.StatusCode, r.Body)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if n := len(woken(w, "tab")); n != 1 {
			return fmt.Errorf("%d wakes after the navigation, want 1", n)
		}
		return nil
	})
}

// running waits for user's sandbox to be Ready.
func running(t *testing.T, w *testenv.Stack, user string) {
	t.Helper()
	testutil.Eventually(t, 2*time.Minute, func() error {
		if e, _ := w.Sandboxes().Get(user); e.Value.Phase != state.PhaseReady {
			return fmt.Errorf("%s's sandbox is %s", user, e.Value.Phase)
		}
		return nil
	})
}

// woken is lifecycle's audited wakes of user.
func woken(w *testenv.Stack, user string) []events.AuditEvent {
	var out []events.AuditEvent
	for _, a := range w.Audit(events.AuditWake, user) {
		if a.Outcome == "woken" {
			out = append(out, a)
		}
	}
	return out
}

// A keep-awake holds a sandbox past its idle time and no longer than
// asked; MAX_RUNTIME suspends a busy one; the user can suspend their own;
// each reason reaches the user's page in Chromium.
func TestKeepAwakeCeilingAndReasonsOnThePage(t *testing.T) {
	idle, ceiling, hold := 3*time.Second, 20*time.Second, 12*time.Second
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": "200ms",
		"MAX_RUNTIME": ceiling.String(), "MAX_KEEPAWAKE": "1m",
	}, Lifecycle: "lc-a"})
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	kay, max, sue := testenv.NewClient(t, edge.URL), testenv.NewClient(t, edge.URL), testenv.NewClient(t, edge.URL)
	kayToken := kay.Signup("kay", "")
	max.Signup("max", "")
	sue.Signup("sue", "")

	for _, u := range []string{"kay", "max", "sue"} {
		running(t, w, u)
	}
	// Bad input changes nothing.
	for _, v := range []string{"2m", "-1s", "soon", ""} {
		if r := kay.Form("/_/keepawake", "for", v); r.StatusCode != http.StatusBadRequest {
			t.Fatalf("keep awake for %q: %d %s", v, r.StatusCode, r.Body)
		}
	}
	if r := kay.Do("POST", "/_/keepawake", strings.NewReader("for=1h"), "Content-Type", "application/x-www-form-urlencoded", "Origin", "http://evil.example"); r.StatusCode != http.StatusForbidden {
		t.Fatalf("a cross-origin keep-awake: %d", r.StatusCode)
	}
	r := kay.Form("/_/keepawake", "for", hold.String())
	if r.StatusCode != http.StatusOK {
		t.Fatalf("keep awake: %d %s", r.StatusCode, r.Body)
	}
	until, err := time.Parse(time.RFC3339, fmt.Sprint(r.JSON()["keep_awake_until"]))
	if err != nil || r.JSON()["suspend_at"] != r.JSON()["keep_awake_until"] {
		t.Fatalf("status after keep-awake: %s (%v)", r.Body, err)
	}
	// The audit is published after the answer: wait for it, then make
	// sure it stays one.
	testutil.Eventually(t, 10*time.Second, func() error {
		if a := w.Audit(events.AuditKeepAwake, "kay"); len(a) != 1 {
			return fmt.Errorf("keep-awakes audited: %+v", a)
		}
		return nil
	})

	// max types all along: busy, and stopped by the ceiling anyway.
	busy := dial(t, edge, max, "max")
	busy.typeEvery(500 * time.Millisecond)
	// sue asks for her own.
	if r := sue.Form("/_/suspend"); r.StatusCode != http.StatusAccepted {
		t.Fatalf("suspend now: %d %s", r.StatusCode, r.Body)
	}

	kayAt := suspendedAt(t, w, "kay", 2*time.Minute)
	if kayAt.Before(until) {
		t.Fatalf("kay suspended at %s, before her keep-awake ended (%s)", kayAt, until)
	}
	suspendedAt(t, w, "sue", time.Minute)
	suspendedAt(t, w, "max", 2*time.Minute)
	if ce := busy.closedWith(t, time.Minute); ce.Code != 4408 || !strings.Contains(ce.Text, "max_runtime") {
		t.Fatalf("max's socket closed with %d %q", ce.Code, ce.Text)
	}
	for user, want := range map[string]string{"kay": "idle", "max": "max_runtime", "sue": "user"} {
		if ls := lastSuspend(t, w, user); ls == nil || ls.Reason != want {
			t.Fatalf("%s's recorded suspend %+v, want %s", user, ls, want)
		}
	}
	if d, _ := w.Decision("max"); d.Detail == "" || !strings.Contains(d.Detail, "max_runtime") {
		t.Fatalf("max's decision: %+v", d)
	}
	for c, want := range map[*testenv.Client]string{max: "because it had been running for 20 seconds", sue: "because you suspended it"} {
		if r := c.Do("GET", "/_/status", nil, "Accept", "application/json"); !strings.Contains(fmt.Sprint(r.JSON()["slept"]), want) {
			t.Fatalf("status says %s, want %q", r.Body, want)
		}
	}

	// The pages say why, in Chromium: the starting page on coming back
	// (the navigation wakes it), then the user's page.
	ctx := testenv.Browser(t)
	testenv.Do(t, ctx, "sign in as kay",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.SendKeys(chromedp.ID("login-token"), kayToken),
		chromedp.Click(chromedp.ID("login-submit")),
	)
	// Signed in, the browser goes on to the sandbox, which wakes behind
	// the starting page. (Evaluated again after each navigation: a poll
	// does not survive the page it runs in.)
	var starting string
	testutil.Eventually(t, 2*time.Minute, func() error {
		at, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById("starting") ? document.getElementById("slept").textContent : document.getElementById("chat-input") ? "DSH" : ""`))
		if err != nil || at == "" {
			return fmt.Errorf("neither the starting page nor DSH yet: %q %v", at, err)
		}
		if at != "DSH" {
			starting = at
			testenv.Screenshot(t, ctx, "sleep-starting-page")
		}
		return nil
	})
	if !strings.Contains(starting, "because it was idle for 3 seconds; your files were kept") {
		t.Fatalf("the starting page said %q", starting)
	}
	// The starting page reloads itself the moment the sandbox is Ready,
	// which can cancel a navigation away begun in the same instant (the
	// browser is then back in DSH): go to kay's page until it is there.
	testutil.Eventually(t, time.Minute, func() error {
		_, err := chromedp.Run(ctx, chromedp.Steps(chromedp.Navigate(edge.URL+"/"), testenv.Until(`document.getElementById("slept") && !document.getElementById("slept").hidden`, 10*time.Second)))
		return err
	})
	text := testenv.Get(t, ctx, "the reason", chromedp.Evaluate[string](`document.getElementById("slept").textContent`))
	if !strings.Contains(text, "because it was idle for 3 seconds; your files were kept") {
		t.Fatalf("kay's page says %q", text)
	}
	testenv.Screenshot(t, ctx, "sleep-users-page")
}

// Dormancy with short settings: an account whose sandbox sleeps
// DORMANT_AFTER is audited dormant, and DORMANT_DELETE_AFTER later it is
// deleted, claim and volume; a hand-applied claim whose sandbox sleeps as
// long, in the same window, is untouched.
func TestDormantAccountsAreDeletedAndUnmanagedClaimsAreNot(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": "2s", "SWEEP_INTERVAL": "200ms",
		"DORMANT_AFTER": "3s", "DORMANT_DELETE_AFTER": "3s",
	}, Lifecycle: "lc-a"})
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	sc, ext, _ := pkg.Cluster.SandboxClients()
	ctx := testenv.Context(t, 5*time.Minute)
	// An operator's own claim, its sandbox put to sleep by hand.
	if _, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Create(ctx, &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "dsh-opal"},
		Spec:       extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var opal string
	testutil.Eventually(t, time.Minute, func() error {
		c, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(ctx, "dsh-opal", metav1.GetOptions{})
		if err != nil || c.Status.SandboxStatus.Name == "" {
			return errors.New("not adopted")
		}
		opal = c.Status.SandboxStatus.Name
		return nil
	})
	patch := []byte(`{"spec":{"operatingMode":"Suspended"}}`)
	if _, err := sc.AgentsV1beta1().Sandboxes(w.NS.Name).Patch(ctx, opal, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}

	c := testenv.NewClient(t, edge.URL)
	c.Signup("dot", "")
	running(t, w, "dot")
	box, _ := w.Sandboxes().Get("dot")
	volumes := func() []string {
		l, err := pkg.Cluster.Client.CoreV1().PersistentVolumeClaims(w.NS.Name).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, p := range l.Items {
			if strings.Contains(p.Name, box.Value.Sandbox) {
				out = append(out, p.Name)
			}
		}
		return out
	}
	if v := volumes(); len(v) == 0 {
		t.Fatalf("dot's sandbox %s has no volume to delete", box.Value.Sandbox)
	}
	suspendedAt(t, w, "dot", time.Minute)
	testutil.Eventually(t, 2*time.Minute, func() error {
		if _, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(ctx, "dsh-dot", metav1.GetOptions{}); err == nil {
			return errors.New("dot's claim is still there")
		}
		if v := volumes(); len(v) != 0 {
			return fmt.Errorf("dot's volumes are still there: %v", v)
		}
		return nil
	})
	var outcomes []string
	for _, a := range w.Audit(events.AuditDormant, "dot") {
		outcomes = append(outcomes, a.Outcome)
	}
	if fmt.Sprint(outcomes) != "[dormant deleting]" {
		t.Fatalf("dot's dormancy audited %v", outcomes)
	}
	w.WaitCommandsDone(time.Minute)
	if _, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(ctx, "dsh-opal", metav1.GetOptions{}); err != nil {
		t.Fatalf("the hand-applied claim: %v", err)
	}
	if a := w.Audit(events.AuditDormant, "opal"); len(a) != 0 {
		t.Fatalf("the hand-applied claim was judged dormant: %+v", a)
	}
}

// The webhook hears of each suspend warning and suspend once per event
// (its delivery id), signed, retried when it fails, and never with a token
// or cookie in it.
func TestTheWebhookIsToldOncePerEvent(t *testing.T) {
	secret := "webhook-secret-0123456789"
	var mu sync.Mutex
	attempts := map[string]int{}
	var bodies []string
	var got []notify.Notice
	hook := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Header.Get(notify.SignatureHeader) != notify.Sign([]byte(secret), body) {
			t.Errorf("a notice with a bad signature: %s", body)
		}
		var x notify.Notice
		if err := json.Unmarshal(body, &x); err != nil {
			t.Errorf("notice %s: %v", body, err)
		}
		mu.Lock()
		defer mu.Unlock()
		attempts[x.ID]++
		bodies = append(bodies, string(body)+r.Header.Get("Cookie")+r.Header.Get("Authorization"))
		if x.Kind == notify.KindSuspended && attempts[x.ID] == 1 {
			rw.WriteHeader(http.StatusServiceUnavailable) // the receiver is down once
			return
		}
		got = append(got, x)
	}))
	t.Cleanup(hook.Close)
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": "3s", "SWEEP_INTERVAL": "200ms",
		"NOTIFY_WEBHOOK_URL": hook.URL, "NOTIFY_WEBHOOK_SECRET": secret, "NOTIFY_WARN_BEFORE": "2s",
	}, Lifecycle: "lc-a"})
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("wes", "")
	running(t, w, "wes")
	suspendedAt(t, w, "wes", time.Minute)
	kinds := func() map[string]int {
		mu.Lock()
		defer mu.Unlock()
		n := map[string]int{}
		for _, x := range got {
			if x.User == "wes" {
				n[x.Kind]++
			}
		}
		return n
	}
	testutil.Eventually(t, time.Minute, func() error {
		if k := kinds(); k[notify.KindWarning] != 1 || k[notify.KindSuspended] != 1 {
			return fmt.Errorf("notices delivered %v, want one warning and one suspend", k)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	for _, x := range got {
		if x.Kind == notify.KindSuspended && (attempts[x.ID] != 2 || x.Reason != "idle") {
			t.Fatalf("the suspend notice %+v took %d attempts", x, attempts[x.ID])
		}
		if x.Kind == notify.KindWarning && (x.When.IsZero() || x.Reason != "idle") {
			t.Fatalf("the warning %+v", x)
		}
	}
	for _, b := range bodies {
		if strings.Contains(b, token) || strings.Contains(b, c.Cookie("dsh_gw_session").Value) {
			t.Fatalf("a notice carries a secret: %s", b)
		}
	}
}
