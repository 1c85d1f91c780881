package accounts_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

// adminStack is a stack with "boss" as its administrator and two edges.
func adminStack(t *testing.T) (*testenv.Stack, *testenv.Edge, *testenv.Edge) {
	w := newStack(t)
	w.Env["ADMIN_USERS"] = "boss"
	return w, w.Edge("edge-a", nil), w.Edge("edge-b", nil)
}

// waitPhase waits until the stack's watch shows user's sandbox in phase.
func waitPhase(t *testing.T, w *testenv.Stack, user string, phase state.Phase) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, _, err := w.Sandboxes().Wait(ctx, user, func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase == phase }); err != nil {
		t.Fatalf("%s not %s: %+v", user, phase, w.Box(user))
	}
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
	w, a, b := adminStack(t)
	bossCookie := testenv.NewClient(t, a.URL)
	bossToken := bossCookie.Signup("boss", invite)
	boss := testenv.NewClient(t, b.URL)
	bearer := func(method, path, body string) *testenv.Response {
		return boss.Do(method, path, strings.NewReader(body), "Authorization", "Bearer "+bossToken, "Accept", "application/json", "Content-Type", "application/json")
	}
	ann := testenv.NewClient(t, a.URL)
	annToken := ann.Signup("ann", invite)
	testenv.NewClient(t, a.URL).Signup("cy", invite)
	waitPhase(t, w, "ann", state.PhaseReady)

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
	waitPhase(t, w, "ann", state.PhaseSuspended)
	// edge-b's cache may still say Suspending for a moment: 409 until then.
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := bearer(http.MethodPost, "/_/admin/users/ann/wake", `{"confirm":"ann"}`); r.StatusCode != http.StatusAccepted {
			return fmt.Errorf("wake: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
	waitPhase(t, w, "ann", state.PhaseReady)
	expect(t, ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"), http.StatusOK, "ann signed in")
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/revoke", `{"confirm":"ann"}`), http.StatusOK, "revoke")
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("ann's cookie after revoke: %d", r.StatusCode)
		}
		return nil
	})
	expect(t, bearer(http.MethodPost, "/_/admin/users/ann/recreate", `{"confirm":"ann"}`), http.StatusOK, "recreate")
	waitPhase(t, w, "ann", state.PhaseReady)
	expect(t, bearer(http.MethodPost, "/_/admin/users/cy/delete", `{"confirm":"cy"}`), http.StatusOK, "delete")
	testutil.Eventually(t, 30*time.Second, func() error {
		if m := row(t, boss, bossToken, "cy"); m != nil {
			return fmt.Errorf("cy still listed: %v", m)
		}
		return nil
	})

	audit := w.AuditLog()
	for _, action := range []string{"suspend", "wake", "revoke", "recreate", "delete"} {
		if !strings.Contains(audit, `"kind":"admin"`) || !strings.Contains(audit, `"outcome":"`+action+`: `) {
			t.Errorf("no admin audit event for %s", action)
		}
	}
	if !strings.Contains(audit, `by administrator boss`) {
		t.Error("lifecycle's suspend audit does not name the administrator")
	}
}

// On open signup nobody can take an administrator's name.
func TestAdminNameIsReservedOnOpenSignup(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"ADMIN_USERS": "boss"}, Lifecycle: "lc-a"})
	edge := w.Edge("edge-a", nil)
	r := testenv.NewClient(t, edge.URL).Form("/users", "user", "boss")
	expect(t, r, http.StatusForbidden, "open signup as an administrator")
	if !strings.Contains(string(r.Body), "reserved for an administrator") {
		t.Fatalf("unclear refusal: %s", r.Body)
	}
	if n := w.Claims(); n != 0 {
		t.Fatalf("%d claims after a refused signup", n)
	}
}

// The admin page in Chromium, behind the pooling front: the administrator
// signs in with the token, finds a user, suspends them after confirming
// on a page of its own, and sees the sandbox suspended.
func TestAdminPageInChromium(t *testing.T) {
	w := newStack(t)
	w.Env["ADMIN_USERS"] = "boss"
	frontAddr := w.FrontAddr()
	backend := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"})
	front := testenv.NewFrontAt(t, frontAddr, strings.TrimPrefix(backend.URL, "http://"))
	token := testenv.NewClient(t, backend.URL).Signup("boss", invite)
	testenv.NewClient(t, backend.URL).Signup("dee", invite)
	waitPhase(t, w, "dee", state.PhaseReady)

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
	waitPhase(t, w, "dee", state.PhaseSuspended)
	testenv.Do(t, ctx, "the table shows it",
		chromedp.Reload(),
		testenv.Until(`document.querySelector("#user-dee .phase").textContent.includes("Suspended")`, 30*time.Second),
	)
	testenv.Screenshot(t, ctx, "admin-suspended")
}
