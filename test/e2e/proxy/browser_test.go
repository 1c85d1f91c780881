package proxy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/handshake"
)

func id(s string) chromedp.ID { return chromedp.ID(s) }

// signIn signs up through the API and hands the session to the browser.
func signIn(t *testing.T, ctx context.Context, base, user string) {
	t.Helper()
	c := testenv.NewClient(t, base)
	c.Signup(user, "")
	sid := c.Cookie("dsh_gw_session").Value
	testenv.Do(t, ctx, "set the session cookie",
		chromedp.Navigate(base+"/"),
		chromedp.Evaluate[chromedp.Void](`document.cookie = "dsh_gw_session=`+sid+`; path=/"`),
	)
}

// TestBrowserWakesASleepingSandbox navigates to a suspended sandbox: the
// starting page follows the wake and reloads into the app, where chat
// (streamed), the WebSocket, the SSE feed and an upload all work. The
// browser never sees the launch token or a DSH cookie.
func TestBrowserWakesASleepingSandbox(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	ctx := testenv.Browser(t)
	signIn(t, ctx, edge.URL, "kai")
	w.Suspend("kai")

	testenv.Do(t, ctx, "starting page",
		chromedp.Navigate(edge.URL+"/u/kai/"),
		chromedp.WaitVisible(id("starting")),
	)
	testenv.Screenshot(t, ctx, "starting")
	testenv.Do(t, ctx, "the app after the wake",
		chromedp.WaitVisible(id("chat-input")),
		testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, 30*time.Second),
	)
	testenv.Do(t, ctx, "chat, WebSocket and events",
		chromedp.SendKeys(id("chat-input"), "hi agent\n"),
		testenv.Until(`!!document.querySelector("#chat-log .assistant.done")`, 30*time.Second),
		chromedp.SendKeys(id("ws-input"), "ping-1\n"),
		testenv.Until(`[...document.querySelectorAll("#ws-log .in")].some(p => p.textContent === "ping-1")`, 30*time.Second),
		testenv.Until(`document.querySelectorAll("#events li").length >= 2`, 30*time.Second),
	)
	file := filepath.Join(t.TempDir(), "notes.txt")
	if err := os.WriteFile(file, []byte("uploaded from the browser"), 0o644); err != nil {
		t.Fatal(err)
	}
	testenv.Do(t, ctx, "upload",
		chromedp.SetUploadFiles(chromedp.CSS("#upload"), []string{file}),
		testenv.Until(`document.getElementById("files").textContent.includes("notes.txt")`, 30*time.Second),
	)
	testenv.Screenshot(t, ctx, "app")

	for _, name := range testenv.Cookies(t, ctx) {
		if name != "dsh_gw_session" {
			t.Fatalf("browser holds cookie %q", name)
		}
	}
	html := testenv.Get(t, ctx, "page source", chromedp.Evaluate[string](`document.documentElement.outerHTML`))
	logTok, err := handshake.TokenFromLog([]byte(w.PodLog("kai")))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(html, logTok) || strings.Contains(html, "dsh-auth-") {
		t.Fatal("the page holds the launch token or the DSH cookie")
	}
}

// TestBrowserStartingPageOnTheOrigin follows an old link in subdomain
// mode: the gateway's /u/kai/ of a suspended sandbox redirects to kai's
// origin (kai.localhost, which Chromium resolves to loopback), which
// signs in through the gateway and shows the starting page. That page is
// styled by the gateway's stylesheet, not by whatever the origin's
// /_/static/style.css (a path of the tenant's) would be, and reloads
// itself into the app once the sandbox is Ready.
func TestBrowserStartingPageOnTheOrigin(t *testing.T) {
	w := newStack(t, nil)
	front := w.FrontAddr()
	_, port, _ := strings.Cut(front, ":")
	domain := "localhost:" + port
	edge := w.Edge("edge-a", map[string]string{"SANDBOX_DOMAIN": domain})
	lb := testenv.NewBalancer(t, front, strings.TrimPrefix(edge.URL, "http://"))
	ctx := testenv.Browser(t)
	signIn(t, ctx, lb.URL(), "kai")
	w.Suspend("kai")

	origin := "http://kai." + domain + "/"
	testenv.Do(t, ctx, "follow the old link", chromedp.Navigate(lb.URL()+"/u/kai/"))
	// Polled with single evaluations: the page reloads itself every two
	// seconds, which ends a poll running in the page it replaces.
	want := fmt.Sprintf("%s starting %s/_/static/style.css spin", origin, edge.URL)
	testutil.Eventually(t, time.Minute, func() error {
		got, err := chromedp.Run(ctx, chromedp.Evaluate[string](`[location.href, document.getElementById("starting") ? "starting" : "not starting",
			document.querySelector('link[rel="stylesheet"]')?.href, document.querySelector(".spinner") && getComputedStyle(document.querySelector(".spinner")).animationName].join(" ")`))
		if err == nil && got != want {
			err = fmt.Errorf("the page is %q, want %q", got, want)
		}
		return err
	})
	testenv.Screenshot(t, ctx, "starting-on-origin")
	testenv.Do(t, ctx, "the app after the wake, on the origin",
		chromedp.WaitVisible(id("chat-input")),
		testenv.Until(`location.href === "`+origin+`" && document.getElementById("ws-status").textContent === "connected"`, 30*time.Second),
	)
}

// TestBrowserSocketMovesToAnotherEdge kills the edge that carries the
// page's WebSocket; the page reconnects through the other edge behind the
// balancer without signing in again.
func TestBrowserSocketMovesToAnotherEdge(t *testing.T) {
	w := newStack(t, nil)
	lbAddr := w.FrontAddr()
	a := w.Edge("edge-a", nil)
	b := w.Edge("edge-b", nil)
	lb := testenv.NewBalancer(t, lbAddr, strings.TrimPrefix(a.URL, "http://"), strings.TrimPrefix(b.URL, "http://"))
	ctx := testenv.Browser(t)
	signIn(t, ctx, lb.URL(), "lou")
	testenv.Do(t, ctx, "open the app",
		chromedp.Navigate(lb.URL()+"/u/lou/"),
		testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, 60*time.Second),
	)
	var carrier *testenv.Edge
	testutil.Eventually(t, 10*time.Second, func() error {
		for _, e := range []*testenv.Edge{a, b} {
			if m, _ := e.Metric("aaas_edge_websockets_open"); strings.HasSuffix(m, " 1") {
				carrier = e
				return nil
			}
		}
		return fmt.Errorf("no edge reports the socket")
	})
	carrier.Kill()
	testenv.Do(t, ctx, "reconnect through the other edge",
		testenv.Until(`document.getElementById("ws-status").textContent === "disconnected"`, 30*time.Second),
		testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, 30*time.Second),
		chromedp.SendKeys(id("ws-input"), "still-here\n"),
		testenv.Until(`[...document.querySelectorAll("#ws-log .in")].some(p => p.textContent === "still-here")`, 30*time.Second),
	)
	if loc := testenv.Get(t, ctx, "location", chromedp.Location()); !strings.HasSuffix(loc, "/u/lou/") {
		t.Fatalf("the page moved to %s (a new sign-in?)", loc)
	}
}
