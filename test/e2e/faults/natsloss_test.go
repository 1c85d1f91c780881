package faults

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/testenv"
)

// TestNATSNodeLoss SIGKILLs one NATS node during traffic and a burst of
// signups and wakes (every command must take effect exactly once, no
// session is lost, writes continue), then a second node: with no quorum,
// Ready sandboxes keep being served from the edges' caches while signup
// and wake answer 503 with Retry-After at once; when the nodes return,
// everything recovers without restarting any aaas process.
func TestNATSNodeLoss(t *testing.T) {
	s := newSystem(t, systemOptions{users: size(4, 20), noSweepers: true})
	sleepers := userNames("z", size(6, 50))
	s.signup(sleepers...)
	for _, u := range sleepers {
		s.Suspend(u)
	}
	pids := s.pids()
	claimsBefore := s.Claims()
	loaded := s.active(sleepers)
	load := s.load(testenv.LoadOptions{Users: loaded})
	time.Sleep(2 * time.Second)

	// One node down, mid-burst.
	newcomers := userNames("n", size(10, 50))
	wakesPer := 4
	s.Cluster.Nodes[0].Kill()
	killed := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]int{}
	var failures []string
	note := func(what string, r *http.Response, err error) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case err != nil:
			outcomes[what+" error"]++
			failures = append(failures, fmt.Sprintf("%s: %v", what, err))
		default:
			outcomes[fmt.Sprintf("%s %d", what, r.StatusCode)]++
			if r.StatusCode >= 300 {
				failures = append(failures, fmt.Sprintf("%s: %s", what, r.Status))
			}
		}
	}
	for _, u := range newcomers {
		c := testenv.NewClient(t, s.front.URL())
		wg.Go(func() {
			r := c.Form("/users", "user", u)
			note("signup", r.Response, nil)
			if r.StatusCode >= 300 {
				mu.Lock()
				failures = append(failures, fmt.Sprintf("signup %s: %.300s", u, r.Body))
				mu.Unlock()
			}
			if r.StatusCode < 300 {
				mu.Lock()
				s.users[u] = c
				mu.Unlock()
			}
		})
	}
	for _, u := range sleepers {
		for range wakesPer {
			c := s.users[u]
			wg.Go(func() {
				r, err := c.HTTP.Do(mustRequest(t, s.front.URL()+"/u/"+u+"/api/files"))
				if err == nil {
					r.Body.Close()
				}
				note("wake", r, err)
			})
		}
	}
	wg.Wait()
	burst := time.Since(killed)
	if len(failures) > 0 {
		t.Fatalf("burst with one node down: %v\n%s", outcomes, strings.Join(failures, "\n"))
	}
	for _, u := range append(newcomers, sleepers...) {
		s.waitPhase(u, "Ready", 2*time.Minute)
	}
	cl := s.commands()
	claims := s.Claims()
	one := load.Report()
	lostOne := s.sessionsLost()

	// A second node down: no quorum.
	late := sleepers[0]
	s.Suspend(late)
	s.Cluster.Nodes[1].Kill()
	quorumLost := time.Now()
	time.Sleep(2 * time.Second)
	start := time.Now()
	signup := testenv.NewClient(t, s.front.URL()).WithTimeout(time.Minute).Form("/users", "user", "q0")
	signupTook := time.Since(start)
	start = time.Now()
	wake := s.users[late].WithTimeout(time.Minute).Do(http.MethodGet, "/u/"+late+"/api/files", nil, "Accept", "application/json")
	wakeTook := time.Since(start)
	time.Sleep(5 * time.Second) // traffic to Ready sandboxes without quorum
	two := load.Report()

	// Both nodes back.
	s.Cluster.Nodes[0].Restart(t)
	s.Cluster.Nodes[1].Restart(t)
	back := time.Now()
	s.Cluster.WaitCurrent(t, 2*time.Minute)
	recovered := eventually(t, 2*time.Minute, func() error {
		r := testenv.NewClient(t, s.front.URL()).Form("/users", "user", "q1")
		if r.StatusCode != http.StatusCreated && r.StatusCode != http.StatusAccepted {
			return fmt.Errorf("signup after the nodes returned: %d %.200s", r.StatusCode, r.Body)
		}
		return nil
	})
	s.waitPhase("q1", "Ready", 2*time.Minute)
	if r := s.users[late].WithTimeout(2*time.Minute).Do(http.MethodGet, "/u/"+late+"/api/files", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK {
		t.Errorf("wake after the nodes returned: %d %.200s", r.StatusCode, r.Body)
	}
	time.Sleep(2 * time.Second)
	load.Stop()
	all := load.Report()
	lostAll := s.sessionsLost()

	report(t, "NATS node loss (3-node cluster, R3)", [][2]string{
		row("users under load", len(loaded)),
		row("burst: signups, wake requests (sandboxes)", fmt.Sprintf("%d, %d (%d)", len(newcomers), len(sleepers)*wakesPer, len(sleepers))),
		row("burst answered within (after the kill)", seconds(burst)),
		row("burst outcomes", outcomes),
		row("commands received / done by lifecycle", fmt.Sprintf("%d / %d", len(cl.received), len(cl.done))),
		row("commands carried out twice", cl.duplicated()),
		row("claims before / after (want +signups)", fmt.Sprintf("%d / %d", claimsBefore, claims)),
		row("load during one node down: sent / failed", fmt.Sprintf("%d / %d", one.Sent, one.Failed)),
		row("sessions lost (one node down)", lostOne),
		row("no quorum: signup", fmt.Sprintf("%d in %s, Retry-After %q", signup.StatusCode, seconds(signupTook), signup.Header.Get("Retry-After"))),
		row("no quorum: wake", fmt.Sprintf("%d in %s, Retry-After %q", wake.StatusCode, seconds(wakeTook), wake.Header.Get("Retry-After"))),
		row("no quorum: load sent / failed", fmt.Sprintf("%d / %d", two.Sent-one.Sent, two.Failed-one.Failed)),
		row("quorum lost for", seconds(back.Sub(quorumLost))),
		row("signup works again after the nodes returned", seconds(recovered)),
		row("sessions lost (end)", lostAll),
	}, all.Rows())

	if d := cl.duplicated(); d != 0 {
		t.Errorf("%d commands carried out twice", d)
	}
	if want := claimsBefore + len(newcomers); claims != want {
		t.Errorf("%d claims after the burst, want %d (one per new user)", claims, want)
	}
	if one.Failed != 0 || lostOne != 0 {
		t.Errorf("one node down: %d requests failed, %d sessions lost\n%s", one.Failed, lostOne, strings.Join(one.Failures, "\n"))
	}
	if two.Failed != one.Failed {
		t.Errorf("no quorum: %d requests to Ready sandboxes failed\n%s", two.Failed-one.Failed, strings.Join(two.Failures, "\n"))
	}
	for what, r := range map[string]*testenv.Response{"signup": signup, "wake": wake} {
		if r.StatusCode != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" {
			t.Errorf("%s without quorum: %d (Retry-After %q) %.300s, want 503 with Retry-After", what, r.StatusCode, r.Header.Get("Retry-After"), r.Body)
		}
	}
	// No hang: the answer comes once NATS_FAILOVER_WAIT (15 s) is spent,
	// give or take one publish attempt (5 s) and a reconnection.
	for what, d := range map[string]time.Duration{"signup": signupTook, "wake": wakeTook} {
		if d > 25*time.Second {
			t.Errorf("%s without quorum took %s to answer", what, d)
		}
	}
	if lostAll != 0 {
		t.Errorf("%d sessions lost", lostAll)
	}
	if now := s.pids(); fmt.Sprint(now) != fmt.Sprint(pids) {
		t.Errorf("aaas processes restarted: pids %v, then %v", pids, now)
	}
}

// active are the signed-in users other than except, for the load.
func (s *system) active(except []string) map[string]*testenv.Client {
	skip := map[string]bool{}
	for _, u := range except {
		skip[u] = true
	}
	out := map[string]*testenv.Client{}
	for u, c := range s.users {
		if !skip[u] {
			out[u] = c
		}
	}
	return out
}

// pids are the aaas processes' pids, or 0 for one that exited.
func (s *system) pids() []int {
	var pids []int
	for _, p := range s.Procs {
		if p.Exited() {
			pids = append(pids, 0)
		} else {
			pids = append(pids, p.PID())
		}
	}
	return pids
}

func mustRequest(t *testing.T, url string) *http.Request {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "application/json")
	return req
}
