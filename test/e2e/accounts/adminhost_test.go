package accounts_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// onHost is a client for base (http://<host>) whose connections all go to
// addr: the Host it sends is base's, the listener addr's, as a DNS record
// pointing another name at the same edges would make it.
func onHost(t *testing.T, base, addr string) *testenv.Client {
	c := testenv.NewClient(t, base)
	d := &net.Dialer{Timeout: 10 * time.Second}
	c.HTTP.Transport = &http.Transport{DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return d.DialContext(ctx, network, addr)
	}}
	return c
}

// Path mode (SANDBOX_DOMAIN empty) with ADMIN_HOSTS, against security
// review S1. The admin host serves the admin view and API to the
// administrator and no sandbox: /u/ answers 404 by token, cookie and
// WebSocket, and nothing reaches the proxy. The public host, where the
// sandboxes are, has no admin view: 404 by token and by the
// administrator's session there. An admin action sent the way a page
// under /u/ would send it (the admin host's session cookie, the public
// host's Origin) is refused and changes nothing; the admin host's own page
// carries it out. A page under /u/ still has its own user's account
// endpoints (it signs its user out). Without ADMIN_HOSTS, an edge with administrators refuses
// to start; with ADMIN_ON_SANDBOX_HOSTS=true it starts and serves the admin
// API on the sandboxes' own origin, where such a request is carried out:
// the risk README states for that switch.
func TestPathModeAdminHost(t *testing.T) {
	w := newStack(t)
	w.Env["ADMIN_HOSTS"] = "admin.test"
	a := w.Edge("edge-a", nil)
	bossPublic := testenv.NewClient(t, a.URL)
	bossToken := bossPublic.Signup("boss", invite)
	ann := testenv.NewClient(t, a.URL)
	annToken := ann.Signup("ann", invite)
	cy := testenv.NewClient(t, a.URL)
	cy.Signup("cy", invite)
	w.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)
	makeAdmin(t, w, "boss", bossToken, a)
	addr := strings.TrimPrefix(a.URL, "http://")
	admin := onHost(t, "http://admin.test", addr)
	bearer := []string{"Authorization", "Bearer " + bossToken, "Accept", "application/json"}

	// The admin host: the API and, once signed in there, the view, which
	// links to ann's sandbox on the public host.
	r := admin.Do(http.MethodGet, "/_/admin/users?q=ann", nil, bearer...)
	expect(t, r, http.StatusOK, "the admin API on the admin host")
	if users, _ := r.JSON()["users"].([]any); len(users) != 1 || users[0].(map[string]any)["url"] != a.URL+"/u/ann/" {
		t.Fatalf("ann's row: %s", r.Body)
	}
	expect(t, admin.Form("/login", "token", bossToken), http.StatusOK, "signing in on the admin host")
	r = admin.Do(http.MethodGet, "/_/admin?q=ann", nil)
	expect(t, r, http.StatusOK, "the admin view by the admin host's session")
	if !strings.Contains(string(r.Body), `id="open-ann" href="`+a.URL+`/u/ann/"`) {
		t.Fatalf("the view does not link ann's sandbox on the public host:\n%s", r.Body)
	}

	// No sandbox on the admin host, and the proxy sees none of it.
	proxied := func() float64 {
		n, err := a.MetricSum("aaas_edge_requests_total")
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := proxied()
	for _, tc := range []struct {
		what, path string
		headers    []string
	}{
		{"ann's sandbox by ann's token", "/u/ann/api/echo", []string{"Authorization", "Bearer " + annToken}},
		{"ann's sandbox's root by ann's token", "/u/ann/", []string{"Authorization", "Bearer " + annToken}},
		{"the administrator's sandbox by the admin host's session", "/u/boss/api/echo", nil},
		{"the administrator's sandbox by token", "/u/boss/api/files", []string{"Authorization", "Bearer " + bossToken}},
	} {
		r := admin.Do(http.MethodGet, tc.path, nil, append([]string{"Accept", "application/json"}, tc.headers...)...)
		expect(t, r, http.StatusNotFound, tc.what+" on the admin host")
		if !strings.Contains(string(r.Body), "serves the administration, not sandboxes") {
			t.Fatalf("%s: not the admin host's refusal: %s", tc.what, r.Body)
		}
	}
	dialer := websocket.Dialer{NetDial: func(network, _ string) (net.Conn, error) { return net.Dial(network, addr) }, HandshakeTimeout: 30 * time.Second}
	ws, resp, err := dialer.Dial("ws://admin.test/u/ann/api/ws", http.Header{"Authorization": {"Bearer " + annToken}})
	if err == nil {
		ws.Close()
		t.Fatal("a WebSocket to ann's sandbox opened on the admin host")
	}
	if resp == nil || resp.StatusCode != http.StatusNotFound {
		t.Fatalf("the WebSocket on the admin host: %v %+v", err, resp)
	}
	if n := proxied(); n != before {
		t.Fatalf("the proxy counted %v requests from the admin host", n-before)
	}
	// The control: the same request on the public host is proxied.
	expect(t, testenv.NewClient(t, a.URL).Do(http.MethodGet, "/u/ann/api/echo", nil, "Authorization", "Bearer "+annToken), http.StatusOK, "ann's sandbox on the public host")
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := proxied(); n == before {
			return fmt.Errorf("the proxy counted no request")
		}
		return nil
	})

	// No admin view on the public host: not by token, not by the
	// administrator's session there.
	for _, c := range []struct {
		who     string
		headers []string
	}{{"the administrator's token", bearer}, {"the administrator's session", []string{"Accept", "application/json"}}} {
		for _, req := range [][2]string{{http.MethodGet, "/_/admin"}, {http.MethodGet, "/_/admin/users"}, {http.MethodPost, "/_/admin/users/ann/revoke"}} {
			r := bossPublic.Do(req[0], req[1], strings.NewReader(`{"confirm":"ann"}`), append([]string{"Content-Type", "application/json"}, c.headers...)...)
			expect(t, r, http.StatusNotFound, c.who+" "+req[0]+" "+req[1]+" on the public host")
		}
	}

	// What path mode leaves: a page under /u/eve/, same-origin with the
	// account endpoints, signs eve out with her cookie.
	eve := testenv.NewClient(t, a.URL)
	eve.Signup("eve", invite)
	r = eve.Do(http.MethodPost, "/logout", nil, "Referer", a.URL+"/u/eve/evil.html", "Accept", "application/json")
	expect(t, r, http.StatusNoContent, "a logout sent from a page under /u/eve/")
	expect(t, eve.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"), http.StatusUnauthorized, "eve after that logout")

	// What a page under /u/ can send the admin host: the administrator's
	// session cookie there, the public host's Origin. Refused, and ann
	// stays signed in; the admin host's own page carries the action out.
	revoke := func(c *testenv.Client, user string, headers ...string) *testenv.Response {
		return c.Do(http.MethodPost, "/_/admin/users/"+user+"/revoke", strings.NewReader(`{"confirm":"`+user+`"}`),
			append([]string{"Content-Type", "application/json", "Accept", "application/json"}, headers...)...)
	}
	expect(t, revoke(admin, "ann", "Origin", a.URL, "Referer", a.URL+"/u/boss/evil.html"), http.StatusForbidden, "an admin action from the public host's origin")
	expect(t, ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"), http.StatusOK, "ann after the refused revoke")
	expect(t, revoke(admin, "ann"), http.StatusOK, "the revoke from the admin host's own origin")
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("ann's session after the revoke: %d", r.StatusCode)
		}
		return nil
	})
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := count(auditEvents(t, w), kind(events.AuditAdmin, "")); n != 1 {
			return fmt.Errorf("%d admin actions audited, want the one from the admin host", n)
		}
		return nil
	})

	// Administrators, path mode, no ADMIN_HOSTS: the edge refuses to start
	// and says why.
	env := maps.Clone(a.Env)
	delete(env, "ADMIN_HOSTS")
	delete(env, "METRICS_ADDR")
	env["LISTEN_ADDR"], env["INSTANCE_ID"] = testenv.FreeAddr(t), "edge-refused"
	env["PUBLIC_HOSTS"] = env["LISTEN_ADDR"]
	refused := pkg.Start(t, "edge", env)
	testutil.Eventually(t, time.Minute, func() error {
		if !refused.Exited() {
			return fmt.Errorf("still running")
		}
		return nil
	})
	if refused.ExitCode() != 1 || !strings.Contains(refused.Logs(), "edge: ADMIN_HOSTS: required with ADMIN_USERS or ADMIN_GROUPS while SANDBOX_DOMAIN is empty") {
		t.Fatalf("exit %d, want 1 naming ADMIN_HOSTS: %s", refused.ExitCode(), refused.Logs())
	}

	// The laptop switch: the same environment starts, and the admin API is
	// served where the sandboxes are. A request as a page under /u/boss/
	// sends it (the administrator's session, that host's Origin) ends cy's
	// sessions.
	env["ADMIN_ON_SANDBOX_HOSTS"], env["INSTANCE_ID"] = "true", "edge-laptop"
	laptop := pkg.Start(t, "edge", env)
	laptop.WaitReady(t, time.Minute)
	laptopURL := "http://" + env["LISTEN_ADDR"]
	boss := testenv.NewClient(t, laptopURL)
	expect(t, boss.Form("/login", "token", bossToken), http.StatusOK, "signing in on the laptop edge")
	expect(t, boss.Do(http.MethodGet, "/u/boss/api/echo", nil), http.StatusOK, "the administrator's sandbox on the laptop edge")
	expect(t, cy.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"), http.StatusOK, "cy before")
	expect(t, revoke(boss, "cy", "Referer", laptopURL+"/u/boss/evil.html"), http.StatusOK, "an admin action from a page under /u/boss/ on the laptop edge")
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := cy.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("cy's session after the revoke: %d", r.StatusCode)
		}
		return nil
	})
}
