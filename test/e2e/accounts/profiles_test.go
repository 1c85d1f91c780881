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
	"github.com/aaas-project/aaas/internal/state"
)

// Profiles through the edge: a user picks one at signup (the token edge)
// or at a recreate (the SSO edge, where groups open a profile). A profile
// PROFILES does not list is a 400 and one the user's groups do not open a
// 403, and neither changes a claim; a member's choice makes the claim
// from the profile's warm pool. The user's status and page say which.
func TestProfilesAreChosenAtSignupAndRecreate(t *testing.T) {
	const profiles = `[{"name":"small","warm_pool":"dsh-pool"},{"name":"large","description":"more of everything","warm_pool":"dsh-large","groups":["acme:ml"]}]`
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite, "PROFILES": profiles}, Lifecycle: "lc-a"})
	addPool(t, w, "dsh-large")
	_, ext, _ := pkg.Cluster.SandboxClients()
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

// addPool adds a warm pool named name to the stack's namespace, of the
// same template as the namespace's own dsh-pool.
func addPool(t *testing.T, w *testenv.Stack, name string) {
	t.Helper()
	_, ext, _ := pkg.Cluster.SandboxClients()
	pools := ext.ExtensionsV1beta1().SandboxWarmPools(w.NS.Name)
	own, err := pools.Get(testenv.Context(t, time.Minute), "dsh-pool", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pools.Create(testenv.Context(t, time.Minute), &extv1beta1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: w.NS.Name}, Spec: own.Spec}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// A profile's max_running queues its own users' wakes beyond it, and
// passes over no other profile's: with two large sandboxes running (its
// cap), a third large wake waits while a small wake made after it is
// served; when a large sandbox sleeps, the waiting one starts.
func TestAProfilesCapQueuesItsOwnWakesOnly(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite,
		"PROFILES": `[{"name":"small","warm_pool":"dsh-pool"},{"name":"large","warm_pool":"dsh-large","max_running":2}]`,
	}, Lifecycle: "lc-a"})
	addPool(t, w, "dsh-large")
	edge := w.Edge("edge-a", nil)
	clients := map[string]*testenv.Client{}
	for user, profile := range map[string]string{"l1": "large", "l2": "large", "l3": "large", "s1": "small"} {
		clients[user] = testenv.NewClient(t, edge.URL)
		if r := clients[user].Form("/users", "user", user, "invite", invite, "profile", profile); r.StatusCode != http.StatusCreated && r.StatusCode != http.StatusAccepted {
			t.Fatalf("signup of %s: %d %s", user, r.StatusCode, r.Body)
		}
	}
	for _, user := range []string{"l1", "l2", "l3", "s1"} {
		w.WaitPhase(t, user, state.PhaseReady, 2*time.Minute)
		w.Suspend(user)
	}
	open := func(user string) {
		t.Helper()
		if r := clients[user].WithTimeout(2*time.Minute).Do(http.MethodGet, "/u/"+user+"/api/files", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", user, r.StatusCode, r.Body)
		}
	}
	open("l1")
	open("l2")
	startingPage(t, clients["l3"], "l3", "number 1 of 1 in the queue")
	// s1 wakes after l3 queued, so it queues behind l3: it is served only
	// if admission passes over l3, whose profile is full.
	open("s1")
	if p := w.Box("l3").Phase; p != state.PhaseSuspended {
		t.Fatalf("l3 started beyond its profile's cap: %s", p)
	}
	startingPage(t, clients["l3"], "l3", "number 1 of 1 in the queue")
	w.Suspend("l1")
	w.WaitPhase(t, "l3", state.PhaseReady, 2*time.Minute)
	if p := w.Box("l2").Phase; p != state.PhaseReady {
		t.Fatalf("l2 is %s", p)
	}
}
