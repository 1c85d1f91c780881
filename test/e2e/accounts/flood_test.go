package accounts_test

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

// One user's burst of recreates neither runs more than one recreate nor
// slows anyone else: 40 at once with ann's token join into one command,
// and bob's signups meanwhile succeed. How long they take is logged, not
// asserted: timing belongs in benchmarks (BenchmarkSignupLatency), and a
// bound here fails on a busy machine.
func TestARecreateBurstIsOneRecreateAndSlowsNobody(t *testing.T) {
	s := pkg.NewStack(t, testenv.StackOptions{Sandbox: func(_ *extv1beta1.SandboxTemplate, pool *extv1beta1.SandboxWarmPool) {
		n := int32(8) // the recreate and every signup adopt a spare
		pool.Spec.Replicas = &n
	}, Env: map[string]string{"SIGNUP_INVITE_CODE": invite}})
	lc := s.Lifecycle("lc-a")
	edge := s.Edge("edge-a", nil)
	ann := testenv.NewClient(t, edge.URL).WithTimeout(3 * time.Minute)
	token := ann.Signup("ann", invite)

	signup := func(user string) time.Duration {
		start := time.Now()
		testenv.NewClient(t, edge.URL).Signup(user, invite)
		return time.Since(start)
	}
	var unloaded []time.Duration
	for _, u := range []string{"bob1", "bob2", "bob3", "bob4", "bob5"} {
		unloaded = append(unloaded, signup(u))
	}
	slices.Sort(unloaded)
	base := unloaded[len(unloaded)/2]

	const burst = 40
	statuses := make([]int, burst)
	var wg sync.WaitGroup
	for i := range burst {
		wg.Go(func() {
			r := ann.Do("POST", "/recreate", nil, "Authorization", "Bearer "+token, "Accept", "application/json", "Origin", "")
			statuses[i] = r.StatusCode
		})
	}
	time.Sleep(50 * time.Millisecond) // the burst is under way
	var during []time.Duration
	for _, u := range []string{"bob6", "bob7", "bob8"} {
		during = append(during, signup(u))
	}
	wg.Wait()
	slices.Sort(during)
	loaded := during[1]

	counts := map[int]int{}
	for _, st := range statuses {
		counts[st]++
	}
	t.Logf("bob's signup, medians: unloaded %s, during the burst %s; burst answers %v", base, loaded, counts)
	// 202: joined the one recreate; 429: arrived once it was under way.
	if counts[http.StatusAccepted]+counts[http.StatusTooManyRequests] != burst || counts[http.StatusAccepted] == 0 {
		t.Fatalf("burst answers %v: want 202 (joined) or 429 (a recreate is under way) only", counts)
	}
	// The answer can reach the edge a moment before lifecycle logs it.
	testutil.Eventually(t, 10*time.Second, func() error {
		if done := strings.Count(lc.Logs(), `"verb":"recreate","user":"ann","outcome":"recreated"`); done != 1 {
			return fmt.Errorf("%d recreates of ann ran, want 1", done)
		}
		return nil
	})
}
