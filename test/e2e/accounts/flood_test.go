package accounts_test

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// burstStack is a stack whose warm pool has a spare for a recreate and
// every signup of the burst tests, with ann signed up; it returns ann's
// client and token.
func burstStack(t testing.TB) (*testenv.Stack, *testenv.Edge, *testenv.Client, string) {
	s := pkg.NewStack(t, testenv.StackOptions{Sandbox: func(_ *extv1beta1.SandboxTemplate, pool *extv1beta1.SandboxWarmPool) {
		n := int32(8)
		pool.Spec.Replicas = &n
	}, Env: map[string]string{"SIGNUP_INVITE_CODE": invite}, Lifecycle: "lc-a"})
	edge := s.Edge("edge-a", nil)
	ann := testenv.NewClient(t, edge.URL).WithTimeout(3 * time.Minute)
	return s, edge, ann, ann.Signup("ann", invite)
}

// recreateBurst sends n recreates of ann at once with her token and
// returns their statuses.
func recreateBurst(ann *testenv.Client, token string, n int) map[int]int {
	statuses := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			statuses[i] = ann.Do("POST", "/recreate", nil, "Authorization", "Bearer "+token, "Accept", "application/json", "Origin", "").StatusCode
		})
	}
	wg.Wait()
	counts := map[int]int{}
	for _, st := range statuses {
		counts[st]++
	}
	return counts
}

// One user's burst of 40 recreates at once runs one recreate, counted
// where it happens: lifecycle's audit events and the claim in Kubernetes
// (a recreate replaces it, so its UID changes once). bob's signups while
// it runs succeed; how long they take beside it is
// BenchmarkSignupDuringARecreateBurst's to measure.
func TestARecreateBurstIsOneRecreate(t *testing.T) {
	s, edge, ann, token := burstStack(t)
	before, ok := account(t, s, "ann")
	if !ok || before.ClaimUID == "" {
		t.Fatalf("ann's account before the burst: %+v", before)
	}

	var counts map[int]int
	done := make(chan struct{})
	go func() { defer close(done); counts = recreateBurst(ann, token, 40) }()
	for _, u := range []string{"bob1", "bob2", "bob3"} {
		testenv.NewClient(t, edge.URL).Signup(u, invite)
	}
	<-done
	// 202: joined the one recreate; 429: arrived once it was under way.
	if counts[http.StatusAccepted]+counts[http.StatusTooManyRequests] != 40 || counts[http.StatusAccepted] == 0 {
		t.Fatalf("burst answers %v: want 202 (joined) or 429 (a recreate is under way) only", counts)
	}
	s.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)
	after, _ := account(t, s, "ann")
	if after.ClaimUID == before.ClaimUID || !after.RecreatingSince.IsZero() {
		t.Fatalf("ann's claim after the burst: %+v, before %+v", after, before)
	}
	evs := auditEvents(t, s)
	if n := count(evs, func(e events.AuditEvent) bool {
		return e.Kind == events.AuditRecreate && e.User == "ann" && e.Outcome == state.OutcomeRecreated
	}); n != 1 {
		t.Fatalf("lifecycle recreated ann %d times, want once", n)
	}
	t.Logf("burst answers %v; ann's claim %s → %s", counts, before.ClaimUID, after.ClaimUID)
}

// BenchmarkSignupDuringARecreateBurst measures whether one user's burst of
// recreates slows another's signups: the median signup beside a burst of
// 40, as a ratio to the median without one (the claim "slows nobody" is a
// ratio near 1). Run with -benchtime=3x.
func BenchmarkSignupDuringARecreateBurst(b *testing.B) {
	s, edge, ann, token := burstStack(b)
	signup := func(user string) time.Duration {
		start := time.Now()
		testenv.NewClient(b, edge.URL).Signup(user, invite)
		return time.Since(start)
	}
	var alone, beside []time.Duration
	b.ResetTimer()
	for i := range b.N {
		alone = append(alone, signup("alone"+string(rune('a'+i%26))+string(rune('a'+i/26%26))))
		s.WaitPhase(b, "ann", state.PhaseReady, 2*time.Minute)
		done := make(chan struct{})
		go func() { defer close(done); recreateBurst(ann, token, 40) }()
		beside = append(beside, signup("beside"+string(rune('a'+i%26))+string(rune('a'+i/26%26))))
		<-done
	}
	b.StopTimer()
	median := func(d []time.Duration) time.Duration { slices.Sort(d); return d[len(d)/2] }
	b.ReportMetric(float64(median(alone).Microseconds())/1000, "alone-ms")
	b.ReportMetric(float64(median(beside).Microseconds())/1000, "beside-ms")
	b.ReportMetric(float64(median(beside))/float64(median(alone)), "beside/alone")
}

// RECREATE_RATE_LIMIT (tests review T25): recreates and deletions past the
// limit in a window get 429 with a Retry-After inside the window and
// change nothing (the claim, the account, the sessions, lifecycle's audit
// trail); once the Retry-After has passed the next one runs.
func TestRecreatesPastTheLimitChangeNothing(t *testing.T) {
	const window = 20 * time.Second
	s := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite, "RECREATE_RATE_LIMIT": "2", "AUTH_RATE_WINDOW": window.String()}, Lifecycle: "lc-a"})
	edge := s.Edge("edge-a", nil)
	ann := testenv.NewClient(t, edge.URL).WithTimeout(3 * time.Minute)
	token := ann.Signup("ann", invite)
	recreate := func() *testenv.Response {
		return ann.Do("POST", "/recreate", nil, "Authorization", "Bearer "+token, "Accept", "application/json")
	}
	recreated := func() int {
		return count(auditEvents(t, s), func(e events.AuditEvent) bool {
			return e.Kind == events.AuditRecreate && e.User == "ann" && e.Outcome == state.OutcomeRecreated
		})
	}
	for i := range 2 {
		// One at a time: the previous one may still be finishing (429,
		// "being recreated"), which is not the limit.
		testutil.Eventually(t, time.Minute, func() error {
			switch r := recreate(); {
			case r.StatusCode == http.StatusAccepted:
				return nil
			case r.StatusCode == http.StatusTooManyRequests && strings.Contains(string(r.Body), "being recreated"):
				return fmt.Errorf("recreate %d: the previous one is still under way", i+1)
			default:
				t.Fatalf("recreate %d of 2: %d %s", i+1, r.StatusCode, r.Body)
				return nil
			}
		})
	}
	s.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)
	testutil.Eventually(t, time.Minute, func() error {
		if n := recreated(); n != 2 {
			return fmt.Errorf("lifecycle recreated ann %d times, want 2", n)
		}
		return nil
	})
	testutil.Eventually(t, time.Minute, func() error {
		if a, _ := account(t, s, "ann"); !a.RecreatingSince.IsZero() {
			return fmt.Errorf("ann's second recreate is still finishing")
		}
		return nil
	})
	before, _ := account(t, s, "ann")
	browser := testenv.NewClient(t, edge.URL)
	expect(t, browser.Form("/login", "token", token), http.StatusOK, "a second session")

	// The edge's cache may say "being recreated" a moment longer.
	var third *testenv.Response
	testutil.Eventually(t, 10*time.Second, func() error {
		if third = recreate(); strings.Contains(string(third.Body), "being recreated") {
			return fmt.Errorf("the edge still sees the second recreate under way")
		}
		return nil
	})
	for what, r := range map[string]*testenv.Response{
		"a third recreate": third,
		"a deletion":       ann.Do("DELETE", "/users/ann", nil, "Authorization", "Bearer "+token, "Accept", "application/json"),
	} {
		expect(t, r, http.StatusTooManyRequests, what)
		if !strings.Contains(string(r.Body), "too many recreates or deletions") {
			t.Fatalf("%s refused for another reason than the limit: %s", what, r.Body)
		}
		if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 || ra > int(window.Seconds())+1 {
			t.Fatalf("%s: Retry-After %q, want 1..%d", what, r.Header.Get("Retry-After"), int(window.Seconds())+1)
		}
	}
	after, ok := account(t, s, "ann")
	if !ok || after.ClaimUID != before.ClaimUID || !after.RecreatingSince.IsZero() || !after.DeletingSince.IsZero() {
		t.Fatalf("refused actions changed ann's account: %+v, before %+v", after, before)
	}
	expect(t, browser.Do("GET", "/_/status", nil), http.StatusOK, "ann's other session after the refusals")
	if n := recreated(); n != 2 {
		t.Fatalf("lifecycle recreated ann %d times after refusals, want 2", n)
	}
	// The limit, not anything else, refused them: once the first recreate
	// leaves the window another runs (refused attempts are not counted, so
	// asking meanwhile changes nothing).
	testutil.Eventually(t, 2*window, func() error {
		if r := recreate(); r.StatusCode != http.StatusAccepted {
			return fmt.Errorf("recreate after Retry-After: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
	testutil.Eventually(t, time.Minute, func() error {
		if n := recreated(); n != 3 {
			return fmt.Errorf("lifecycle recreated ann %d times, want 3", n)
		}
		return nil
	})
}
