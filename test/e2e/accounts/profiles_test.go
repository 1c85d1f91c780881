package accounts_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/sandbox"
)

// Profiles through the edge: a user picks one at signup (the token edge)
// or at a recreate (the SSO edge, where groups open a profile). A profile
// PROFILES does not list is a 400 and one the user's groups do not open a
// 403, and neither changes a claim; a member's choice makes the claim
// from the profile's warm pool. The user's status and page say which.
func TestProfilesAreChosenAtSignupAndRecreate(t *testing.T) {
	const profiles = `[{"name":"small","warm_pool":"dsh-pool"},{"name":"large","description":"more of everything","warm_pool":"dsh-large","groups":["acme:ml"]}]`
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite, "PROFILES": profiles}, Lifecycle: "lc-a"})
	_, ext, _ := pkg.Cluster.SandboxClients()
	pools := ext.ExtensionsV1beta1().SandboxWarmPools(w.NS.Name)
	small, err := pools.Get(testenv.Context(t, time.Minute), "dsh-pool", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pools.Create(testenv.Context(t, time.Minute), &extv1beta1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "dsh-large", Namespace: w.NS.Name}, Spec: small.Spec}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	claim := func(user string) (uid, profile, pool string) {
		t.Helper()
		c, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(testenv.Context(t, time.Minute), sandbox.ClaimName(user), metav1.GetOptions{})
		if err != nil {
			return "", "", ""
		}
		return string(c.UID), c.Annotations[sandbox.ProfileAnnotation], c.Spec.WarmPoolRef.Name
	}

	// Token accounts belong to no group: the token edge offers (and the
	// lifecycle's PROFILES lists) large openly, so a signup can choose it.
	plain := w.Edge("edge-plain", map[string]string{"PROFILES": strings.Replace(profiles, `,"groups":["acme:ml"]`, "", 1)})
	c := testenv.NewClient(t, plain.URL)
	page := c.Do("GET", "/", nil, "Accept", "text/html")
	if !strings.Contains(string(page.Body), `<option value="large">large — more of everything</option>`) {
		t.Fatalf("the signup form offers no profiles: %s", page.Body)
	}
	for _, tc := range []struct {
		profile, says string
		status        int
	}{
		{"huge", `there is no profile \"huge\"; choose one of small, large`, http.StatusBadRequest},
		{"Large", "a profile name is", http.StatusBadRequest},
		{"large\"><script>", "a profile name is", http.StatusBadRequest},
	} {
		r := c.Form("/users", "user", "ann", "invite", invite, "profile", tc.profile)
		expect(t, r, tc.status, "signup into profile "+tc.profile)
		if !strings.Contains(string(r.Body), tc.says) {
			t.Fatalf("signup into %q: %s, want it to say %q", tc.profile, r.Body, tc.says)
		}
	}
	if w.Claims() != 0 {
		t.Fatal("a refused profile made a claim")
	}
	r := c.Form("/users", "user", "ann", "invite", invite, "profile", "large")
	if r.StatusCode != http.StatusCreated && r.StatusCode != http.StatusAccepted {
		t.Fatalf("signup into large: %d %s", r.StatusCode, r.Body)
	}
	if _, profile, pool := claim("ann"); profile != "large" || pool != "dsh-large" {
		t.Fatalf("ann's claim: profile %q, pool %q", profile, pool)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if got := c.Do("GET", "/_/status", nil).JSON()["profile"]; got != "large" {
			return fmt.Errorf("ann's status says profile %v", got)
		}
		return nil
	})

	// On the SSO edge, large is open to acme:ml alone.
	sso := w.Edge("edge-sso", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*"})
	as := func(login, groups string) func(method, path, body string) *testenv.Response {
		return func(method, path, body string) *testenv.Response {
			return testenv.NewClient(t, sso.URL).Do(method, path, strings.NewReader(body), "X-Forwarded-User", login, "X-Forwarded-Groups", groups,
				"Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json")
		}
	}
	carol, dana := as("carol", "acme:devs"), as("dana", "acme:devs, acme:ml")
	for who, do := range map[string]func(string, string, string) *testenv.Response{"carol": carol, "dana": dana} {
		expect(t, do("GET", "/_/status", ""), http.StatusOK, who+" signs in")
		if _, profile, pool := claim(who); profile != "small" || pool != "dsh-pool" {
			t.Fatalf("%s's first claim: profile %q, pool %q, want the default", who, profile, pool)
		}
	}
	before, _, _ := claim("carol")
	r = carol("POST", "/recreate", "profile=large")
	expect(t, r, http.StatusForbidden, "carol recreates into large")
	if !strings.Contains(string(r.Body), `the profile \"large\" is not open to you`) {
		t.Fatalf("carol's refusal: %s", r.Body)
	}
	expect(t, carol("POST", "/recreate", "profile=huge"), http.StatusBadRequest, "carol recreates into huge")
	// The recreate page offers each what their groups open.
	if page := string(carol("GET", "/_/confirm/recreate", "").Body); !strings.Contains(page, `<option value="small" selected>`) || strings.Contains(page, `value="large"`) {
		t.Fatalf("carol's recreate page: %s", page)
	}
	if page := string(dana("GET", "/_/confirm/recreate", "").Body); !strings.Contains(page, `<option value="large">large — more of everything</option>`) {
		t.Fatalf("dana's recreate page: %s", page)
	}
	// The positive control, in the same window: dana may.
	expect(t, dana("POST", "/recreate", "profile=large"), http.StatusAccepted, "dana recreates into large")
	if _, profile, pool := claim("dana"); profile != "large" || pool != "dsh-large" {
		t.Fatalf("dana's claim after her recreate: profile %q, pool %q", profile, pool)
	}
	if uid, profile, _ := claim("carol"); uid != before || profile != "small" {
		t.Fatalf("carol's claim after refused recreates: uid %s (was %s), profile %q", uid, before, profile)
	}
}
