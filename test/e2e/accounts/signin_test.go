package accounts_test

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// Signing up and signing in send a browser to its sandbox where it is
// served. In subdomain mode that is the user's own origin (the sign-in
// code flow then runs by itself on the first navigation), not /u/<user>/,
// which only redirects now: the form's 303, the API's url, the landing
// page's link, the status and its stream all name
// http://<user>.<SANDBOX_DOMAIN>/. In path mode with ADMIN_HOSTS, the
// admin host serves no /u/: an administrator signing in there goes to the
// admin view, where the new session works, anyone else to /u/<user>/ on
// the public host (absolute); the public host's own answers stay relative.
func TestSignInSendsEachBrowserToItsSandbox(t *testing.T) {
	w := newStack(t)
	origins := w.Edge("edge-a", map[string]string{"SANDBOX_DOMAIN": "sbx.test"})
	form := []string{"Content-Type", "application/x-www-form-urlencoded", "Accept", "text/html"}
	redirect := func(r *testenv.Response, want, what string) {
		t.Helper()
		expect(t, r, http.StatusSeeOther, what)
		if loc := r.Header.Get("Location"); loc != want {
			t.Fatalf("%s: Location %q, want %q", what, loc, want)
		}
	}
	url := func(r *testenv.Response, want, what string) {
		t.Helper()
		if got, _ := r.JSON()["url"].(string); got != want {
			t.Fatalf("%s: url %q, want %q (%s)", what, got, want, r.Body)
		}
	}

	// Subdomain mode.
	ann := testenv.NewClient(t, origins.URL)
	redirect(ann.Do(http.MethodPost, "/users", strings.NewReader("user=ann&invite="+invite), form...), "http://ann.sbx.test/", "the sign-up form")
	r := testenv.NewClient(t, origins.URL).Form("/users", "user", "bo", "invite", invite)
	url(r, "http://bo.sbx.test/", "the API's sign-up")
	boToken, _ := r.JSON()["token"].(string)
	redirect(testenv.NewClient(t, origins.URL).Do(http.MethodPost, "/login", strings.NewReader("token="+boToken), form...), "http://bo.sbx.test/", "the sign-in form")
	url(testenv.NewClient(t, origins.URL).Form("/login", "token", boToken), "http://bo.sbx.test/", "the API's sign-in")
	r = ann.Do(http.MethodGet, "/", nil, "Accept", "text/html")
	expect(t, r, http.StatusOK, "the landing page")
	if !strings.Contains(string(r.Body), `id="open" href="http://ann.sbx.test/"`) {
		t.Fatalf("the landing page does not link ann's origin:\n%s", r.Body)
	}
	r = ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json")
	expect(t, r, http.StatusOK, "the status")
	url(r, "http://ann.sbx.test/", "the status")
	if ev := firstEvent(t, ann, "/_/status/stream"); !strings.Contains(ev, `"url":"http://ann.sbx.test/"`) {
		t.Fatalf("the status stream's first event: %q", ev)
	}

	// Path mode with an admin host, bo its administrator.
	cyToken := testenv.NewClient(t, origins.URL).Signup("cy", invite)
	public := w.Edge("edge-b", map[string]string{"ADMIN_HOSTS": "admin.test", "ADMIN_USERS": adminEntry("bo", boToken)})
	admin := func() *testenv.Client {
		return onHost(t, "http://admin.test", strings.TrimPrefix(public.URL, "http://"))
	}
	boAdmin := admin()
	redirect(boAdmin.Do(http.MethodPost, "/login", strings.NewReader("token="+boToken), form...), "/_/admin", "the administrator's sign-in on the admin host")
	expect(t, boAdmin.Do(http.MethodGet, "/_/admin", nil, "Accept", "text/html"), http.StatusOK, "the admin view, where that sign-in leads")
	cyAdmin := admin()
	redirect(cyAdmin.Do(http.MethodPost, "/login", strings.NewReader("token="+cyToken), form...), public.URL+"/u/cy/", "a user's sign-in on the admin host")
	url(admin().Form("/login", "token", cyToken), public.URL+"/u/cy/", "the API's sign-in on the admin host")
	if r := cyAdmin.Do(http.MethodGet, "/", nil, "Accept", "text/html"); !strings.Contains(string(r.Body), `id="open" href="`+public.URL+`/u/cy/"`) {
		t.Fatalf("the admin host's landing page does not link cy's sandbox on the public host:\n%s", r.Body)
	}
	// The public host: relative, for the administrator too (no admin view
	// is served there).
	redirect(testenv.NewClient(t, public.URL).Do(http.MethodPost, "/login", strings.NewReader("token="+cyToken), form...), "/u/cy/", "a user's sign-in on the public host")
	redirect(testenv.NewClient(t, public.URL).Do(http.MethodPost, "/login", strings.NewReader("token="+boToken), form...), "/u/bo/", "the administrator's sign-in on the public host")
}

// firstEvent is the first event of c's status stream at path.
func firstEvent(t *testing.T, c *testenv.Client, path string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.Base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the status stream: %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			return data
		}
	}
	t.Fatalf("the status stream ended without an event: %v", sc.Err())
	return ""
}
