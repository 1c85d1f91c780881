package accounts_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// TestBrowserAccountJourney drives headless Chromium through the landing
// page, behind the pooling nginx front as behind an ingress: sign up, open
// the sandbox, see its state, sign out, sign in with the token, delete the
// account. The browser must never hold any cookie but the gateway's.
func TestBrowserAccountJourney(t *testing.T) {
	w := newStack(t)
	frontAddr := w.FrontAddr()
	backend := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"})
	front := testenv.NewFrontAt(t, frontAddr, strings.TrimPrefix(backend.URL, "http://"))
	edge := struct{ URL string }{front.URL()}
	ctx := testenv.Browser(t)
	onlyGatewayCookie := func(when string) {
		t.Helper()
		names := testenv.Cookies(t, ctx)
		for _, name := range names {
			if name != "dsh_gw_session" && name != auth.UserCookie("dsh_gw_session") {
				t.Fatalf("%s: the browser holds cookie %q (all: %v)", when, name, names)
			}
		}
	}

	testenv.Do(t, ctx, "sign up",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.WaitVisible(id("signup-user")),
		chromedp.SendKeys(id("signup-user"), "jo"),
		chromedp.SendKeys(id("signup-invite"), invite),
		chromedp.Click(id("signup-submit")),
		chromedp.WaitVisible(id("token-box")),
	)
	token := testenv.Get(t, ctx, "read the token", chromedp.Text(id("token")))
	if !strings.HasPrefix(token, "jo.") {
		t.Fatalf("token shown: %q", token)
	}
	testenv.Screenshot(t, ctx, "landing-token")
	testenv.Do(t, ctx, "open the sandbox",
		chromedp.Click(id("continue")),
		chromedp.WaitVisible(id("chat-input")),
	)
	if loc := testenv.Get(t, ctx, "location", chromedp.Location()); !strings.HasSuffix(loc, "/u/jo/") {
		t.Fatalf("landed on %s", loc)
	}
	onlyGatewayCookie("in the sandbox")

	testenv.Do(t, ctx, "landing page shows the sandbox",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.WaitVisible(id("account")),
		testenv.Until(`document.getElementById("phase").textContent === "Ready"`, 30*time.Second),
	)
	testenv.Screenshot(t, ctx, "landing")

	testenv.Do(t, ctx, "sign out",
		chromedp.Click(id("logout")),
		chromedp.WaitVisible(id("login-token")),
	)
	testenv.Do(t, ctx, "sign in with the token",
		chromedp.SendKeys(id("login-token"), token),
		chromedp.Click(id("login-submit")),
		chromedp.WaitVisible(id("chat-input")),
	)
	onlyGatewayCookie("after signing in")

	testenv.Do(t, ctx, "delete the account",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.Click(chromedp.CSS("summary")),
		chromedp.WaitVisible(id("delete")),
		chromedp.Click(id("delete")),
		// Confirmed on a page of its own.
		chromedp.WaitVisible(id("confirm")),
		chromedp.Click(id("confirm")),
		chromedp.WaitVisible(id("signup-user")),
	)
	onlyGatewayCookie("after deleting")
	r := testenv.NewClient(t, edge.URL).Do("GET", "/_/status", nil, "Authorization", "Bearer "+token)
	if r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("token after deleting in the browser: %d", r.StatusCode)
	}
}

func id(s string) chromedp.ID { return chromedp.ID(s) }
