package accounts_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
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

// TestBrowserChoosesAProfile: in Chromium, a user picks a profile on the
// signup form and gets a sandbox of it (its claim draws from that
// profile's pool, and the page names it), then picks another on the
// recreate page and gets a sandbox of that one.
func TestBrowserChoosesAProfile(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite,
		"PROFILES": `[{"name":"small","warm_pool":"dsh-pool"},{"name":"large","description":"more of everything","warm_pool":"dsh-large"}]`,
	}, Lifecycle: "lc-a"})
	addPool(t, w, "dsh-large")
	edge := w.Edge("edge-a", nil)
	ctx := testenv.Browser(t)
	pool := func(want string) {
		t.Helper()
		_, ext, _ := pkg.Cluster.SandboxClients()
		testutil.Eventually(t, time.Minute, func() error {
			c, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(testenv.Context(t, time.Minute), sandbox.ClaimName("pia"), metav1.GetOptions{})
			if err != nil || c.Spec.WarmPoolRef.Name != want {
				return fmt.Errorf("pia's claim: %v %v, want pool %s", c, err, want)
			}
			return nil
		})
	}

	testenv.Do(t, ctx, "sign up with the large profile",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.WaitVisible(id("signup-profile")),
		chromedp.SendKeys(id("signup-user"), "pia"),
		chromedp.SendKeys(id("signup-invite"), invite),
		chromedp.SetValue(id("signup-profile"), "large"),
		chromedp.Click(id("signup-submit")),
		chromedp.WaitVisible(id("token-box")),
		chromedp.Click(id("continue")),
		chromedp.WaitVisible(id("chat-input")),
	)
	pool("dsh-large")
	testenv.Do(t, ctx, "the page names the profile",
		chromedp.Navigate(edge.URL+"/"),
		testenv.Until(`document.getElementById("profile").textContent === "large"`, 30*time.Second),
	)
	testenv.Do(t, ctx, "recreate with the small profile",
		chromedp.Click(chromedp.CSS("summary")),
		chromedp.WaitVisible(id("recreate")),
		chromedp.Click(id("recreate")),
		chromedp.WaitVisible(id("recreate-profile")),
		testenv.Until(`document.getElementById("recreate-profile").value === "large"`, 5*time.Second),
		chromedp.SetValue(id("recreate-profile"), "small"),
		chromedp.Click(id("confirm")),
		chromedp.WaitVisible(id("account")),
	)
	pool("dsh-pool")
	// The page is drawn from the edge's copy of the record, which may
	// lag the recreate's answer a moment.
	testutil.Eventually(t, 30*time.Second, func() error {
		testenv.Do(t, ctx, "load the page", chromedp.Navigate(edge.URL+"/"), chromedp.WaitVisible(id("profile")))
		if got := testenv.Get(t, ctx, "the profile shown", chromedp.Text(id("profile"))); got != "small" {
			return fmt.Errorf("the page says profile %q", got)
		}
		return nil
	})
}

// TestBrowserHasTwoSandboxesOfTwoProfiles: in Chromium, a user signed up
// with the default profile makes a second sandbox, big, of the large
// profile from their page, and opens each: DSH's page loads at
// /u/pia/ and at /u/pia--big/. Their page lists both, each with its
// profile, and offers no third (MAX_SANDBOXES_PER_USER=2); the claims
// draw from the two profiles' pools.
func TestBrowserHasTwoSandboxesOfTwoProfiles(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite, "MAX_SANDBOXES_PER_USER": "2",
		"PROFILES": `[{"name":"small","warm_pool":"dsh-pool"},{"name":"large","description":"more of everything","warm_pool":"dsh-large"}]`,
	}, Lifecycle: "lc-a"})
	addPool(t, w, "dsh-large")
	edge := w.Edge("edge-a", nil)
	ctx := testenv.Browser(t)
	row := func(name string) string { return `tr[data-sandbox="` + name + `"]` }

	testenv.Do(t, ctx, "sign up with the default profile",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.WaitVisible(id("signup-profile")),
		chromedp.SendKeys(id("signup-user"), "pia"),
		chromedp.SendKeys(id("signup-invite"), invite),
		chromedp.Click(id("signup-submit")),
		chromedp.WaitVisible(id("token-box")),
		chromedp.Click(id("continue")),
		chromedp.WaitVisible(id("chat-input")),
	)
	testenv.Do(t, ctx, "make big, of large, on the page",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.WaitVisible(id("new-sandbox")),
		chromedp.SendKeys(id("sandbox-name"), "big"),
		chromedp.SetValue(id("sandbox-profile"), "large"),
		chromedp.Click(id("create-sandbox")),
		chromedp.WaitVisible(chromedp.CSS(row("big"))),
	)
	testenv.Do(t, ctx, "open big",
		chromedp.Click(chromedp.CSS(row("big")+` a`)),
		chromedp.WaitVisible(id("chat-input")),
		testenv.Until(`location.pathname.startsWith("/u/pia--big/")`, 5*time.Second),
	)
	testenv.Do(t, ctx, "open the first from the list",
		chromedp.Navigate(edge.URL+"/"),
		chromedp.Click(chromedp.CSS(row("")+` a`)),
		chromedp.WaitVisible(id("chat-input")),
		testenv.Until(`location.pathname.startsWith("/u/pia/")`, 5*time.Second),
	)
	// The list, each with its profile (the page is drawn from the edge's
	// copy of the records, which may lag the create a moment), and no
	// form for a third.
	testutil.Eventually(t, 30*time.Second, func() error {
		testenv.Do(t, ctx, "load the page", chromedp.Navigate(edge.URL+"/"), chromedp.WaitVisible(id("sandbox-list")))
		got := testenv.Get(t, ctx, "the list", chromedp.Evaluate[string](`[...document.querySelectorAll("#sandbox-list tr")].map(r => r.dataset.sandbox + ":" + r.querySelector(".profile").textContent + ":" + r.querySelector(".phase").textContent).join(" ") + (document.getElementById("new-sandbox") ? " +form" : "")`))
		if got != ":small:Ready big:large:Ready" {
			return fmt.Errorf("the list says %q", got)
		}
		return nil
	})
	// big is kept awake from its row, for the first choice offered; the
	// first sandbox is not.
	testenv.Do(t, ctx, "keep big awake",
		chromedp.Click(chromedp.CSS(row("big")+` .keep-awake-sandbox`)),
		chromedp.WaitVisible(id("sandbox-list")),
	)
	awake := testutil.Open[state.KeepAwake](t, w.JS, state.BucketKeepAwake)
	testutil.Eventually(t, 10*time.Second, func() error {
		if keys, err := awake.Keys(testenv.Context(t, time.Minute), ">"); err != nil || strings.Join(keys, " ") != "pia--big" {
			return fmt.Errorf("kept awake: %v %v, want big alone", keys, err)
		}
		return nil
	})
	_, ext, _ := pkg.Cluster.SandboxClients()
	for key, pool := range map[string]string{"pia": "dsh-pool", "pia--big": "dsh-large"} {
		c, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(testenv.Context(t, time.Minute), sandbox.ClaimName(key), metav1.GetOptions{})
		if err != nil || c.Spec.WarmPoolRef.Name != pool {
			t.Fatalf("%s's claim: %v, want pool %s", key, err, pool)
		}
	}
}
