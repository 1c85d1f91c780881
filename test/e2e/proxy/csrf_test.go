package proxy_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// A state-changing request that carries the session cookie must come from
// the gateway's own pages: another site (or no stated origin at all) is
// refused before anything reaches DSH. Bearer tokens need no origin.
func TestCrossSiteMutationsNeverReachTheSandbox(t *testing.T) {
	w := newStack(t, nil)
	// The test client stands in for the ingress too: X-Forwarded-Proto
	// from it is believed.
	edge := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"})
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("bob", "")
	sid := "dsh_gw_session=" + c.Cookie("dsh_gw_session").Value
	httpsOrigin := "https://" + strings.TrimPrefix(edge.URL, "http://")
	expect(t, c.Do("GET", "/u/bob/api/files", nil), http.StatusOK, "warm-up (handshake)")

	cases := []struct {
		name    string
		headers []string
		want    int
	}{
		{"cookie, foreign Origin", []string{"Cookie", sid, "Origin", "https://evil.example"}, http.StatusForbidden},
		{"cookie, same host but http on https", []string{"Cookie", sid, "Origin", edge.URL, "X-Forwarded-Proto", "https"}, http.StatusForbidden},
		{"cookie, no Origin or Referer", []string{"Cookie", sid, "Origin", ""}, http.StatusForbidden},
		{"cookie, foreign Referer", []string{"Cookie", sid, "Origin", "", "Referer", "https://evil.example/page"}, http.StatusForbidden},
		{"cookie, cross-site fetch metadata", []string{"Cookie", sid, "Origin", "", "Sec-Fetch-Site", "cross-site"}, http.StatusForbidden},
		{"cookie, same Origin", []string{"Cookie", sid, "Origin", edge.URL}, http.StatusOK},
		{"cookie, same-origin fetch metadata", []string{"Cookie", sid, "Origin", "", "Sec-Fetch-Site", "same-origin"}, http.StatusOK},
		{"cookie, https Origin behind a TLS-terminating proxy", []string{"Cookie", sid, "Origin", httpsOrigin, "X-Forwarded-Proto", "https"}, http.StatusOK},
		{"bearer, foreign Origin", []string{"Authorization", "Bearer " + token, "Origin", "https://evil.example"}, http.StatusOK},
	}
	for i, tc := range cases {
		anon := testenv.NewClient(t, edge.URL)
		path := fmt.Sprintf("/u/bob/api/echo?case=%d", i)
		r := anon.Do("POST", path, strings.NewReader("do-something"), tc.headers...)
		if r.StatusCode != tc.want {
			t.Errorf("%s: %d, want %d (%s)", tc.name, r.StatusCode, tc.want, r.Body)
		}
	}
	// dshsim logs the method and path of every request it served, once
	// served: wait for the allowed ones (sent after every refused one),
	// then no refused one may be among them.
	seen := 0
	testutil.Eventually(t, 30*time.Second, func() error {
		if seen = strings.Count(w.PodLog("bob"), "POST /api/echo"); seen < countAllowed(cases) {
			return fmt.Errorf("DSH logged %d POSTs so far, want the %d allowed ones", seen, countAllowed(cases))
		}
		return nil
	})
	if seen != countAllowed(cases) {
		t.Errorf("DSH saw %d POSTs, want only the %d allowed ones", seen, countAllowed(cases))
	}

	// POST /logout from another site does not sign anyone out.
	r := c.Do("POST", "/logout", nil, "Origin", "https://evil.example")
	expect(t, r, http.StatusForbidden, "cross-site logout")
	expect(t, c.Do("GET", "/u/bob/api/files", nil), http.StatusOK, "still signed in")
}

func countAllowed(cases []struct {
	name    string
	headers []string
	want    int
}) int {
	n := 0
	for _, c := range cases {
		if c.want == http.StatusOK {
			n++
		}
	}
	return n
}

// A real browser on another origin submits a text/plain form (a "simple"
// request, no preflight) at the user's agent with the user's cookie: the
// edge refuses it and DSH never sees it.
func TestBrowserCrossSiteFormIsRefused(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	ctx := testenv.Browser(t)
	signIn(t, ctx, edge.URL, "eve")
	testenv.Do(t, ctx, "open the sandbox", chromedp.Navigate(edge.URL+"/u/eve/api/files"))

	evil := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(rw, `<form id="f" method="POST" enctype="text/plain" action="%s/u/eve/api/chat"><input name='{"message":"rm -rf","x":"' value='"}'></form><script>document.getElementById("f").submit()</script>`, edge.URL)
	}))
	defer evil.Close()
	testenv.Do(t, ctx, "the other site's form", chromedp.Navigate(evil.URL))
	// The form navigates the page away: poll until the answer is shown.
	var body string
	testutil.Eventually(t, 15*time.Second, func() error {
		href, err := chromedp.Run(ctx, chromedp.Evaluate[string](`location.href`))
		if err != nil {
			return err
		}
		if body, err = chromedp.Run(ctx, chromedp.Evaluate[string](`document.body ? document.body.innerText : ""`)); err != nil {
			return err
		}
		if !strings.Contains(href, "/u/eve/api/chat") || body == "" {
			return fmt.Errorf("at %s", href)
		}
		return nil
	})
	if !strings.Contains(body, "Cross-site request refused") && !strings.Contains(body, "must come from") {
		t.Fatalf("the form post was answered with %q", body)
	}
	if strings.Contains(w.PodLog("eve"), "POST /api/chat") {
		t.Fatal("the cross-site form reached DSH")
	}
}
