package accounts_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
)

// adminEntry is the ADMIN_USERS entry binding name to the account whose
// token this is, as README's Administration section computes it.
func adminEntry(name, token string) string { return name + ":" + ident.HashHex(token) }

// makeAdmin restarts edges with ADMIN_USERS binding name to the account of
// token, as an operator does once the account exists; edges started later
// get the same. These stacks are in path mode, so unless the stack names
// ADMIN_HOSTS, the edges serve the admin view on the sandboxes' hosts by
// ADMIN_ON_SANDBOX_HOSTS (TestPathModeAdminHost is the separation).
func makeAdmin(t *testing.T, w *testenv.Stack, name, token string, edges ...*testenv.Edge) {
	t.Helper()
	w.Env["ADMIN_USERS"] = adminEntry(name, token)
	if w.Env["ADMIN_HOSTS"] == "" {
		w.Env["ADMIN_ON_SANDBOX_HOSTS"] = "true"
	}
	for _, e := range edges {
		e.Stop()
		for _, k := range []string{"ADMIN_USERS", "ADMIN_ON_SANDBOX_HOSTS"} {
			if v, ok := w.Env[k]; ok {
				e.Env[k] = v
			}
		}
		e.Restart(t)
		e.WaitReady(t, time.Minute)
	}
}

// adminStack is a stack with two edges and "boss" as its administrator,
// signed up on edge-a (the client holds the session cookie).
func adminStack(t *testing.T) (w *testenv.Stack, a, b *testenv.Edge, boss *testenv.Client, token string) {
	w = newStack(t)
	a = w.Edge("edge-a", nil)
	boss = testenv.NewClient(t, a.URL)
	token = boss.Signup("boss", invite)
	makeAdmin(t, w, "boss", token, a)
	return w, a, w.Edge("edge-b", nil), boss, token
}

// row finds user in the admin list as an edge serves it to the
// administrator's token.
func row(t *testing.T, c *testenv.Client, token, user string) map[string]any {
	t.Helper()
	r := c.Do(http.MethodGet, "/_/admin/users?q="+user, nil, "Authorization", "Bearer "+token)
	expect(t, r, http.StatusOK, "admin list")
	users, _ := r.JSON()["users"].([]any)
	for _, u := range users {
		if m, _ := u.(map[string]any); m["user"] == user {
			return m
		}
	}
	return nil
}

// The admin API, on an edge other than the one the users came through:
// only the administrator sees it (everyone else, signed in or not, gets
// 404); every action needs confirming, changes nothing without it, and is
// audited; the list shows each edge's work in flight.
func TestAdminAPIAcrossTwoEdges(t *testing.T) {
	w, a, b, bossCookie, bossToken := adminStack(t)
	boss := testenv.NewClient(t, b.URL)
	bearer := func(method, path, body string) *testenv.Response {
		return boss.Do(method, path, strings.NewReader(body), "Authorization", "Bearer "+bossToken, "Accept", "application/json", "Content-Type", "application/json")
	}
	ann := testenv.NewClient(t, a.URL)
	annToken := ann.Signup("ann", invite)
	testenv.NewClient(t, a.URL).Signup("cy", invite)
	w.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)

	// Nobody else sees it: not ann with her cookie or token, not a
	// stranger, not a forged SSO header (SSO is off).
	for _, tc := range []struct {
		who     string
		c       *testenv.Client
		headers []string
	}{
		{"ann's cookie", ann.At(b.URL), nil},
		{"ann's token", testenv.NewClient(t, b.URL), []string{"Authorization", "Bearer " + annToken}},
		{"a stranger", testenv.NewClient(t, b.URL), nil},
		{"a forged SSO header", testenv.NewClient(t, b.URL), []string{"X-Forwarded-User", "boss", "X-Forwarded-Groups", "admins"}},
	} {
		for _, req := range [][2]string{{http.MethodGet, "/_/admin"}, {http.MethodGet, "/_/admin/users"}, {http.MethodPost, "/_/admin/users/cy/delete"}} {
			r := tc.c.Do(req[0], req[1], strings.NewReader(`{"confirm":"cy"}`), append([]string{"Content-Type", "application/json", "Accept", "application/json"}, tc.headers...)...)
			expect(t, r, http.StatusNotFound, tc.who+" "+req[0]+" "+req[1])
		}
	}

	// The list, with ann's open WebSocket on edge-a shown per edge.
	ws, _, err := websocket.DefaultDialer.Dial(strings.Replace(a.URL, "http", "ws", 1)+"/u/ann/api/ws", http.Header{"Authorization": {"Bearer " + annToken}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	testutil.Eventually(t, 30*time.Second, func() error {
		r := bearer(http.MethodGet, "/_/admin/users?q=ann", "")
		if r.StatusCode != http.StatusOK {
			return fmt.Errorf("list: %d %s", r.StatusCode, r.Body)
		}
		body := string(r.Body)
		if !strings.Contains(body, `"user":"ann","phase":"Ready"`) || !strings.Contains(body, `"edge":"edge-a","in_flight":1`) {
			return fmt.Errorf("ann's row: %s", body)
		}
		return nil
	})
	ws.Close()

	// The rollout's state, as lifecycle counted every sandbox: the
	// default profile's template revision, which ann's is of.
	annRev := w.Sandboxes()
	testutil.Eventually(t, 30*time.Second, func() error {
		box, _ := annRev.Get("ann")
		r := bearer(http.MethodGet, "/_/admin/rollouts", "")
		var got struct{ Rollouts []state.Rollout }
		if err := json.Unmarshal(r.Body, &got); r.StatusCode != http.StatusOK || err != nil {
			return fmt.Errorf("rollouts: %d %s", r.StatusCode, r.Body)
		}
		if rev := box.Value.Revision; len(got.Rollouts) != 1 || rev == "" || got.Rollouts[0].Target != rev || got.Rollouts[0].Sandboxes[rev] < 2 {
			return fmt.Errorf("rollouts %+v, ann's revision %q", got.Rollouts, rev)
		}
		return nil
	})
	expect(t, ann.At(b.URL).Do(http.MethodGet, "/_/admin/rollouts", nil, "Accept", "application/json"), http.StatusNotFound, "ann's rollouts")
	for _, bad := range []string{"limit=0", "limit=501", "limit=x", "phase=Sleeping", "after=" + strings.Repeat("a", 40)} {
		expect(t, bearer(http.MethodGet, "/_/admin/users?"+bad, ""), http.StatusBadRequest, "list with "+bad)
	}

	// Bad actions change nothing.
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/suspend", ""), http.StatusBadRequest, "suspend without confirming")
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/suspend", `{"confirm":"cy"}`), http.StatusBadRequest, "suspend confirming another user")
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/explode", `{"confirm":"ann"}`), http.StatusNotFound, "unknown action")
	expect(t, bearer(http.MethodPost, "/_/admin/users/nobody/suspend", `{"confirm":"nobody"}`), http.StatusNotFound, "unknown user")
	expect(t, bearer(http.MethodPost, "/_/admin/users/Ann/suspend", `{"confirm":"Ann"}`), http.StatusNotFound, "a name no account can have")
	expect(t, bossCookie.Do(http.MethodPost, "/_/admin/users/ann/suspend", strings.NewReader(`{"confirm":"ann"}`), "Content-Type", "application/json", "Accept", "application/json", "Origin", "https://evil.example"),
		http.StatusForbidden, "the administrator's cookie from another site")
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/wake", `{"confirm":"ann"}`), http.StatusConflict, "wake a Ready sandbox")
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/suspend", `{"confirm":"ann","force":true}`), http.StatusBadRequest, "unknown field")
	if p := w.Box("ann").Phase; p != state.PhaseReady {
		t.Fatalf("refused actions changed ann's sandbox: %s", p)
	}

	// Suspend (however recently used), wake, revoke, recreate, delete.
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/suspend", `{"confirm":"ann"}`), http.StatusAccepted, "suspend")
	w.WaitPhase(t, "ann", state.PhaseSuspended, 2*time.Minute)
	// edge-b's cache may still say Suspending for a moment: 409 until then.
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := bearer(http.MethodPost, "/_/admin/users/ann/wake", `{"confirm":"ann"}`); r.StatusCode != http.StatusAccepted {
			return fmt.Errorf("wake: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
	w.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)
	expect(t, ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"), http.StatusOK, "ann signed in")
	r := bearer(http.MethodPost, "/_/admin/users/ann/revoke", `{"confirm":"ann"}`)
	expect(t, r, http.StatusOK, "revoke")
	if out, _ := r.JSON()["outcome"].(string); !strings.Contains(out, "sessions ended; the account's bearer token still works") {
		t.Fatalf("revoke's outcome %q does not say what it leaves", out)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("ann's cookie after revoke: %d", r.StatusCode)
		}
		return nil
	})
	// As it says: her token still signs her in.
	expect(t, testenv.NewClient(t, b.URL).Do(http.MethodGet, "/_/status", nil, "Authorization", "Bearer "+annToken, "Accept", "application/json"), http.StatusOK, "ann's token after revoke")
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/recreate", `{"confirm":"ann"}`), http.StatusOK, "recreate")
	w.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)
	expect(t, bearer(http.MethodPost, "/_/admin/users/cy/delete", `{"confirm":"cy"}`), http.StatusOK, "delete")
	testutil.Eventually(t, 30*time.Second, func() error {
		if m := row(t, boss, bossToken, "cy"); m != nil {
			return fmt.Errorf("cy still listed: %v", m)
		}
		return nil
	})

	evs := auditEvents(t, w)
	for _, action := range []string{"suspend", "wake", "revoke", "recreate", "delete"} {
		if count(evs, func(e events.AuditEvent) bool {
			return e.Kind == events.AuditAdmin && strings.HasPrefix(e.Outcome, action+": ") && e.Detail == "by boss"
		}) == 0 {
			t.Errorf("no admin audit event for %s by boss", action)
		}
	}
	if count(evs, func(e events.AuditEvent) bool {
		return e.Kind == events.AuditSuspend && e.User == "ann" && strings.Contains(e.Detail, "by administrator boss")
	}) == 0 {
		t.Error("lifecycle's suspend audit does not name the administrator")
	}
}

// Admin rights follow the account's identity, never its name (security
// review S7). With an invite code and ADMIN_USERS binding ops: the real
// ops administers, by token and by session, on an edge it never signed up
// on, and still after a recreate; another invitee does not. Once ops's
// account is deleted, an invitee signs up under the name ops and
// administers nothing: not by token, not by session, and an admin action
// it asks for changes nothing.
func TestAdminRightsFollowTheAccountNotItsName(t *testing.T) {
	w := newStack(t)
	w.Env["AUTH_RATE_LIMIT"] = "1000" // the signup retried below is one client's many attempts
	a := w.Edge("edge-a", nil)
	ops := testenv.NewClient(t, a.URL).WithTimeout(3 * time.Minute)
	opsToken := ops.Signup("ops", invite)
	annToken := testenv.NewClient(t, a.URL).Signup("ann", invite)
	makeAdmin(t, w, "ops", opsToken, a)
	b := w.Edge("edge-b", nil)
	list := func(c *testenv.Client, headers ...string) int {
		return c.Do(http.MethodGet, "/_/admin/users", nil, append([]string{"Accept", "application/json"}, headers...)...).StatusCode
	}
	isAdmin := func(what string, c *testenv.Client, headers ...string) {
		t.Helper()
		if st := list(c, headers...); st != http.StatusOK {
			t.Fatalf("%s: the admin list answered %d, want 200", what, st)
		}
	}
	isNot := func(what string, c *testenv.Client, headers ...string) {
		t.Helper()
		if st := list(c, headers...); st != http.StatusNotFound {
			t.Fatalf("%s: the admin list answered %d, want 404", what, st)
		}
	}
	isAdmin("ops's token on the other edge", testenv.NewClient(t, b.URL), "Authorization", "Bearer "+opsToken)
	isAdmin("ops's session on the other edge", ops.At(b.URL))
	isNot("another invitee's token", testenv.NewClient(t, b.URL), "Authorization", "Bearer "+annToken)

	// A recreate keeps the token, and with it the rights.
	before, _ := account(t, w, "ops")
	expect(t, ops.Do(http.MethodPost, "/recreate", nil, "Authorization", "Bearer "+opsToken, "Accept", "application/json"), http.StatusAccepted, "ops recreates")
	w.WaitPhase(t, "ops", state.PhaseReady, 2*time.Minute)
	if after, _ := account(t, w, "ops"); after.ClaimUID == before.ClaimUID {
		t.Fatalf("ops's claim is the same after the recreate: %s", after.ClaimUID)
	}
	isAdmin("ops's token after a recreate", testenv.NewClient(t, b.URL), "Authorization", "Bearer "+opsToken)

	// ops's account goes; the name is free, and an invitee takes it.
	expect(t, ops.Do(http.MethodDelete, "/users/ops", nil, "Authorization", "Bearer "+opsToken, "Accept", "application/json"), http.StatusNoContent, "delete ops")
	testutil.Eventually(t, time.Minute, func() error {
		if _, ok := account(t, w, "ops"); ok {
			return fmt.Errorf("ops's account is still there")
		}
		return nil
	})
	// edge-b's cache may hold the account a moment longer: 409 until then.
	squatter := testenv.NewClient(t, b.URL)
	var squatterToken string
	testutil.Eventually(t, time.Minute, func() error {
		switch r := squatter.Form("/users", "user", "ops", "invite", invite); r.StatusCode {
		case http.StatusCreated, http.StatusAccepted:
			squatterToken, _ = r.JSON()["token"].(string)
			return nil
		case http.StatusConflict:
			return fmt.Errorf("the name ops is not free yet on edge-b")
		default:
			t.Fatalf("the invitee's signup as ops: %d %s", r.StatusCode, r.Body)
			return nil
		}
	})
	for _, e := range []*testenv.Edge{a, b} {
		isNot("the new ops's token on "+e.URL, testenv.NewClient(t, e.URL), "Authorization", "Bearer "+squatterToken)
		isNot("the new ops's session on "+e.URL, squatter.At(e.URL))
	}
	r := squatter.Do(http.MethodPost, "/_/admin/users/ann/delete", strings.NewReader(`{"confirm":"ann"}`), "Authorization", "Bearer "+squatterToken, "Content-Type", "application/json", "Accept", "application/json")
	expect(t, r, http.StatusNotFound, "the new ops deleting ann")
	if _, ok := account(t, w, "ann"); !ok {
		t.Fatal("ann's account is gone after the new ops asked to delete it")
	}
	if n := count(auditEvents(t, w), kind(events.AuditAdmin, "")); n != 0 {
		t.Fatalf("%d admin actions audited; nobody administered anything", n)
	}
}

// The admin page in Chromium, behind the pooling front: the administrator
// signs in with the token, finds a user, suspends them after confirming
// on a page of its own, and sees the sandbox suspended.
func TestAdminPageInChromium(t *testing.T) {
	w := newStack(t)
	frontAddr := w.FrontAddr()
	backend := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"})
	token := testenv.NewClient(t, backend.URL).Signup("boss", invite)
	makeAdmin(t, w, "boss", token, backend)
	front := testenv.NewFrontAt(t, frontAddr, strings.TrimPrefix(backend.URL, "http://"))
	testenv.NewClient(t, backend.URL).Signup("dee", invite)
	w.WaitPhase(t, "dee", state.PhaseReady, 2*time.Minute)

	ctx := testenv.Browser(t)
	testenv.Do(t, ctx, "sign in",
		chromedp.Navigate(front.URL()+"/"),
		chromedp.WaitVisible(id("login-token")),
		chromedp.SendKeys(id("login-token"), token),
		chromedp.Click(id("login-submit")),
		chromedp.WaitVisible(id("chat-input")),
	)
	testenv.Do(t, ctx, "find dee",
		chromedp.Navigate(front.URL()+"/_/admin"),
		chromedp.WaitVisible(id("users")),
		chromedp.SendKeys(id("q"), "de"),
		chromedp.Click(id("filter")),
		chromedp.WaitNotPresent(id("user-boss")),
		chromedp.WaitVisible(id("user-dee")),
	)
	if rows := testenv.Get(t, ctx, "rows", chromedp.Text(id("users"))); strings.Contains(rows, "boss") || !strings.Contains(rows, "Ready") {
		t.Fatalf("filtered table: %s", rows)
	}
	testenv.Screenshot(t, ctx, "admin")
	testenv.Do(t, ctx, "suspend dee, confirming",
		chromedp.Click(id("suspend-dee")),
		chromedp.WaitVisible(id("confirm")),
	)
	if p := w.Box("dee").Phase; p != state.PhaseReady {
		t.Fatalf("asking to confirm changed dee's sandbox: %s", p)
	}
	testenv.Do(t, ctx, "confirm",
		chromedp.Click(id("confirm")),
		chromedp.WaitVisible(id("notice")),
	)
	w.WaitPhase(t, "dee", state.PhaseSuspended, 2*time.Minute)
	testenv.Do(t, ctx, "the table shows it",
		chromedp.Reload(),
		testenv.Until(`document.querySelector("#user-dee .phase").textContent.includes("Suspended")`, 30*time.Second),
	)
	testenv.Screenshot(t, ctx, "admin-suspended")
}
