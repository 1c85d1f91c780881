package faults

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
)

// TestAPIServerRestartMidOperation stops kube-apiserver and etcd for a few
// seconds while signups, a wake and a recreate are in flight, as a
// control-plane upgrade does. lifecycle's informers must resync by
// themselves, every pending command complete, and no claim be made twice.
func TestAPIServerRestartMidOperation(t *testing.T) {
	const down = 5 * time.Second
	s := newSystem(t, systemOptions{users: 3, noSweepers: true})
	s.Suspend("u0")
	// Every API call slowed, so the commands are surely mid-way when the
	// control plane goes.
	for _, p := range s.lifecycles {
		s.Faults.Latency("kube-"+p.Env["INSTANCE_ID"], 300*time.Millisecond)
	}
	newcomers := userNames("a", size(3, 10))
	var mu sync.Mutex
	answers := map[string]int{}
	took := map[string]time.Duration{}
	var wg sync.WaitGroup
	start := time.Now()
	do := func(what string, fn func() *testenv.Response) {
		wg.Go(func() {
			r := fn()
			mu.Lock()
			defer mu.Unlock()
			answers[fmt.Sprintf("%s %d", what, r.StatusCode)]++
			took[what] = max(took[what], time.Since(start))
			if r.StatusCode >= 300 {
				t.Errorf("%s: %d %.300s", what, r.StatusCode, r.Body)
			}
		})
	}
	for _, u := range newcomers {
		c := testenv.NewClient(t, s.front.URL())
		do("signup", func() *testenv.Response {
			r := c.Form("/users", "user", u)
			if r.StatusCode < 300 {
				mu.Lock()
				s.users[u] = c
				mu.Unlock()
			}
			return r
		})
	}
	do("wake", func() *testenv.Response {
		return s.users["u0"].Do(http.MethodGet, "/u/u0/api/files", nil, "Accept", "application/json")
	})
	do("recreate", func() *testenv.Response {
		return s.users["u1"].Do(http.MethodPost, "/recreate", nil, "Accept", "application/json")
	})
	eventually(t, time.Minute, func() error {
		if n := len(s.commands().received); n < len(newcomers)+2 {
			return fmt.Errorf("%d commands taken", n)
		}
		return nil
	})
	restartStart := time.Now()
	if err := pkg.Cluster.RestartControlPlane(testenv.Context(t, 3*time.Minute), down); err != nil {
		t.Fatal(err)
	}
	restarted := time.Since(restartStart)
	wg.Wait()
	for _, u := range append(newcomers, "u0", "u1") {
		s.waitPhase(u, state.PhaseReady, 2*time.Minute)
	}

	// The informers resynced: a suspend and a wake decided after the
	// restart see the pods come and go.
	for _, p := range s.lifecycles {
		s.Faults.Restore("kube-" + p.Env["INSTANCE_ID"])
	}
	resync := time.Now()
	s.Suspend("u2")
	if r := s.users["u2"].WithTimeout(2*time.Minute).Do(http.MethodGet, "/u/u2/api/files", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK {
		t.Errorf("wake after the restart: %d %.300s", r.StatusCode, r.Body)
	}
	cycle := time.Since(resync)
	cl := s.commands()
	claims := s.Claims()
	report(t, "kube-apiserver and etcd restarted mid-operation", [][2]string{
		row("in flight", fmt.Sprintf("%d signups, 1 wake, 1 recreate", len(newcomers))),
		row("control plane down for", seconds(down)),
		row("restart to API ready", seconds(restarted)),
		row("answers", answers),
		row("slowest answer per kind (from the start)", took),
		row("suspend + wake after the restart", seconds(cycle)),
		row("commands carried out twice", cl.duplicated()),
		row("claims (want one per user)", fmt.Sprintf("%d for %d users", claims, len(s.users))),
	})
	if d := cl.duplicated(); d != 0 {
		t.Errorf("%d commands carried out twice", d)
	}
	if claims != len(s.users) {
		t.Errorf("%d claims for %d users", claims, len(s.users))
	}
}
