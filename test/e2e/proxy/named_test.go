package proxy_test

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/state"
)

// TestNamedSandboxesThroughTheEdge: with MAX_SANDBOXES_PER_USER=2, alice
// makes a named sandbox, work, through the edge's API: it is reached at
// /u/alice--work/ (woken, handshaken), has its own volume (a file written
// there is not in her first sandbox), and sleeps alone. Refusals change
// nothing: a bad name (400), a name in use or a third sandbox (409), an
// unknown profile (400), another user's sandbox name (404). Bob, signed in,
// reaches alice--work by none of the path encodings that never reach
// alice's first sandbox either (the same matrix), nor by WebSocket (4401),
// while his own named sandbox is his. Deleting work takes its claim and
// record; her first sandbox stays.
func TestNamedSandboxesThroughTheEdge(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Env: map[string]string{"MAX_SANDBOXES_PER_USER": "2"}})
	edge := w.Edge("edge-a", nil)
	alice := testenv.NewClient(t, edge.URL)
	alice.Signup("alice", "")
	expect(t, alice.Do("PUT", "/u/alice/api/files/first.txt", strings.NewReader("first")), http.StatusCreated, "a file in alice's first sandbox")

	r := alice.Form("/_/sandboxes", "name", "work")
	expect(t, r, http.StatusCreated, "alice makes work")
	if got := r.JSON(); got["url"] != "/u/alice--work/" || got["name"] != "work" {
		t.Fatalf("made: %v", got)
	}
	expect(t, alice.Do("PUT", "/u/alice--work/api/files/work.txt", strings.NewReader("work")), http.StatusCreated, "a file in work")
	if r := alice.Do("GET", "/u/alice--work/api/files/work.txt", nil); r.StatusCode != http.StatusOK || string(r.Body) != "work" {
		t.Fatalf("work's file: %d %q", r.StatusCode, r.Body)
	}
	if r := alice.Do("GET", "/u/alice--work/api/files/first.txt", nil); r.StatusCode != http.StatusNotFound {
		t.Fatalf("the first sandbox's file in work: %d %q", r.StatusCode, r.Body)
	}
	if w.Box("alice--work").PodUID == w.Box("alice").PodUID {
		t.Fatal("work shares alice's pod")
	}
	list := alice.Do("GET", "/_/sandboxes", nil).JSON()
	if got := fmt.Sprint(list["sandboxes"]); !strings.Contains(got, "name: ") || !strings.Contains(got, "name:work") || list["max"] != float64(2) {
		t.Fatalf("alice's list: %v", list)
	}

	// Refusals, and no claim made by any.
	claims := w.Claims()
	for _, tc := range []struct {
		name, profile string
		status        int
	}{
		{"Work", "", http.StatusBadRequest},
		{"w--x", "", http.StatusBadRequest},
		{strings.Repeat("w", 21), "", http.StatusBadRequest},
		{"play", "huge", http.StatusBadRequest},
		{"work", "", http.StatusConflict},
		{"play", "", http.StatusConflict}, // the first and work: 2 of 2
	} {
		expect(t, alice.Form("/_/sandboxes", "name", tc.name, "profile", tc.profile), tc.status, "make "+tc.name)
	}
	if n := w.Claims(); n != claims {
		t.Fatalf("%d claims after the refusals, were %d", n, claims)
	}

	// Bob and the matrix: every encoding that reaches no other user's
	// first sandbox reaches no named one either.
	bob := testenv.NewClient(t, edge.URL)
	bob.Signup("bob", "")
	expect(t, bob.Form("/_/sandboxes", "name", "work"), http.StatusCreated, "bob makes his own work")
	expect(t, bob.Do("GET", "/u/bob--work/api/files", nil), http.StatusOK, "bob on his own named sandbox")
	expect(t, bob.Form("/_/sandboxes/work/delete"), http.StatusNoContent, "bob deletes his work by form")
	expect(t, bob.Do("DELETE", "/_/sandboxes/play", nil), http.StatusNotFound, "bob deletes a sandbox he has not")
	before := strings.Count(w.PodLog("alice--work"), "/api/echo")
	paths := []string{
		"/u/alice--work/api/echo", "/u/alice--work/", "/u/%61lice--work/api/echo", "/u/alice%2d%2dwork/api/echo", "/u/alice--work%2fapi/echo",
		"/U/alice--work/api/echo", "/u/bob/../alice--work/api/echo", "/u/bob/%2e%2e/alice--work/api/echo", "/u/bob--work/%2e%2e%2falice--work%2fapi/echo",
		"/u/bob%2f..%2falice--work/api/echo", "/u//alice--work/api/echo", "//u/alice--work/api/echo", "/u/./alice--work/api/echo",
		"/u/bob/..%5calice--work/api/echo", "/u/alice--WORK/api/echo", "/u/alice--work./api/echo",
	}
	for _, p := range reaching(t, edge, bob.Cookie("dsh_gw_session").Value, paths, "/u/alice") {
		t.Errorf("%s reached alice--work's pod", p)
	}
	ws, _, err := wsDial(t, edge.URL+"/u/alice--work/api/ws", http.Header{"Cookie": {"dsh_gw_session=" + bob.Cookie("dsh_gw_session").Value}})
	if err != nil {
		t.Fatalf("bob's upgrade to alice--work: %v, want it accepted and closed with 4401", err)
	}
	if _, _, err = ws.ReadMessage(); closeCode(err) != 4401 {
		t.Fatalf("bob's socket to alice--work: %v, want close 4401", err)
	}
	// Positive control in the same window: alice's own echo gets there.
	expect(t, alice.Do("GET", "/u/alice--work/api/echo", nil), http.StatusOK, "alice's echo")
	if after := strings.Count(w.PodLog("alice--work"), "/api/echo"); after != before+1 {
		t.Fatalf("alice--work's pod logged %d echo requests, want alice's 1", after-before)
	}

	// work sleeps alone; her first sandbox stays up.
	expect(t, alice.Form("/_/sandboxes/work/suspend"), http.StatusAccepted, "alice suspends work")
	testutil.Eventually(t, time.Minute, func() error {
		if p := w.Box("alice--work").Phase; p != state.PhaseSuspended {
			return fmt.Errorf("work is %s", p)
		}
		return nil
	})
	if p := w.Box("alice").Phase; p != state.PhaseReady {
		t.Fatalf("alice's first sandbox is %s after work's suspend", p)
	}

	// Deleting work: its claim and record go, the first stays.
	expect(t, alice.Do("DELETE", "/_/sandboxes/work", nil), http.StatusNoContent, "alice deletes work")
	testutil.Eventually(t, time.Minute, func() error {
		// alice's first and bob's; both works gone.
		if n := w.Claims(); n != claims {
			return fmt.Errorf("%d claims", n)
		}
		return nil
	})
	if r := alice.Do("GET", "/u/alice/api/files/first.txt", nil); r.StatusCode != http.StatusOK || string(r.Body) != "first" {
		t.Fatalf("alice's first sandbox after work's delete: %d %q", r.StatusCode, r.Body)
	}
	if got := fmt.Sprint(alice.Do("GET", "/_/sandboxes", nil).JSON()["sandboxes"]); strings.Contains(got, "work") {
		t.Fatalf("alice's list after the delete: %s", got)
	}
}

// TestNamedSandboxOrigins: with SANDBOX_DOMAIN, a named sandbox is served
// on its own origin, <user>--<name>.<domain>. Its owner's bearer token
// reaches it (DSH sees that origin as X-Forwarded-Host); another user's
// does not, in any spelling of the host a browser or client may send
// (case, trailing dot, default port) nor on its previews; the gateway
// mints him no sign-in code for it. The owner's code for it makes a
// cookie that opens that origin only, not her first sandbox's.
func TestNamedSandboxOrigins(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Env: map[string]string{"MAX_SANDBOXES_PER_USER": "2"}})
	a := w.Edge("edge-a", map[string]string{"SANDBOX_DOMAIN": sandboxDomain})
	st := newOriginState(t, w)
	ann := testenv.NewClient(t, a.URL)
	token := ann.Signup("ann", "")
	gw := ann.Cookie("dsh_gw_session").Value
	r := ann.Form("/_/sandboxes", "name", "work")
	expect(t, r, http.StatusCreated, "ann makes work")
	host := "ann--work." + sandboxDomain
	if got := r.JSON()["url"]; got != "http://"+host+"/" {
		t.Fatalf("work's URL %v", got)
	}
	bob := testenv.NewClient(t, a.URL)
	bobToken := bob.Signup("bob", "")

	// The create answers once the claim is made; its pod's log is read
	// once there is a pod.
	w.WaitPhase(t, "ann--work", state.PhaseReady, time.Minute)
	before := strings.Count(w.PodLog("ann--work"), "/api/echo")
	for _, h := range []string{host, "ANN--WORK." + sandboxDomain, host + ".", host + ":80", "5173-" + host} {
		r := at(t, a, "GET", h, "/api/echo", nil, "Authorization", "Bearer "+bobToken, "Accept", "application/json")
		if r.StatusCode == http.StatusOK {
			t.Errorf("bob's token on %s: 200", h)
		}
	}
	r = at(t, a, "GET", gatewayHost(a), "/_/signin/sandbox?next="+url.QueryEscape("http://"+host+"/"), nil, "Cookie", "dsh_gw_session="+bob.Cookie("dsh_gw_session").Value, "Accept", "text/html")
	expect(t, r, http.StatusForbidden, "a code for ann--work's origin, as bob")
	// The control, in the same window: ann's token reaches work, as work.
	r = at(t, a, "GET", host, "/api/echo", nil, "Authorization", "Bearer "+token)
	expect(t, r, http.StatusOK, "ann's token on work's origin")
	if e := decodeEcho(t, r); strings.Join(e.Headers["X-Forwarded-Host"], ",") != host {
		t.Fatalf("work's DSH saw %+v", e.Headers)
	}
	if after := strings.Count(w.PodLog("ann--work"), "/api/echo"); after != before+1 {
		t.Fatalf("work's pod logged %d echo requests, want ann's 1", after-before)
	}

	// ann's sign-in on work's origin is that origin's alone.
	_, trade := originSignIn(t, a, gw, host, "/api/echo")
	r = at(t, a, "GET", host, trade, nil, "Accept", "text/html")
	expect(t, r, http.StatusSeeOther, "the trade on work's origin")
	var sid string
	for _, ck := range r.Cookies() {
		if ck.Name == "aaas_sandbox" {
			sid = ck.Value
		}
	}
	if sessions := st.sandboxSessions(t, "ann"); sid == "" || len(sessions) != 1 || sessions[0].Host != host {
		t.Fatalf("ann's sandbox sessions %+v (cookie %v)", sessions, sid != "")
	}
	expect(t, at(t, a, "GET", host, "/api/echo", nil, "Cookie", "aaas_sandbox="+sid, "Accept", "application/json"), http.StatusOK, "work's cookie on work")
	expect(t, at(t, a, "GET", "ann."+sandboxDomain, "/api/echo", nil, "Cookie", "aaas_sandbox="+sid, "Accept", "application/json"), http.StatusUnauthorized, "work's cookie on ann's first origin")
}
