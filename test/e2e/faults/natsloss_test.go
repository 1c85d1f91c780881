package faults

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/events"
)

// TestNATSNodeLoss SIGKILLs the NATS node that leads the command stream
// and every KV bucket during traffic and a burst of signups and wakes
// (new leaders are elected; every command must take effect exactly once,
// counted from etcd's history; no session is lost, writes continue), then
// a second node: with no quorum, Ready sandboxes keep being served from
// the edges' caches, every request to them answered, while signup and
// wake ride out NATS_FAILOVER_WAIT and answer 503 with Retry-After; when
// the nodes return, everything recovers without restarting any aaas
// process.
func TestNATSNodeLoss(t *testing.T) {
	// Wakes wait as long as the burst needs (WAKE_TIMEOUT 4m): on a
	// loaded machine, 50 sandboxes starting while every stream elects a
	// new leader take more than a minute; the table says how long.
	const failoverWait, wakeTimeout = 15 * time.Second, 4 * time.Minute
	s := newSystem(t, systemOptions{users: size(4, 20), noSweepers: true, env: map[string]string{
		"NATS_FAILOVER_WAIT": failoverWait.String(), "WAKE_TIMEOUT": wakeTimeout.String(),
	}})
	sleepers := userNames("z", size(6, 50))
	s.signup(sleepers...)
	for _, u := range sleepers {
		s.Suspend(u)
	}
	pids := s.pids()
	claimsBefore := s.Claims()
	kube := s.RecordKube()
	kube.Sync()
	mark := kube.Mark()
	handledBefore := s.handled()
	loaded := s.active(sleepers)
	load := s.load(testenv.LoadOptions{Users: loaded})
	// Let traffic flow: the load's first hundred answers.
	eventually(t, time.Minute, func() error {
		if r := load.Report(); r.Sent < 100 {
			return fmt.Errorf("%d requests answered", r.Sent)
		}
		return nil
	})

	// The node that leads the command stream leads every bucket too, so
	// killing it takes all their leaders at once.
	ctx := testenv.Context(t, 10*time.Minute)
	led := []string{events.StreamCommands}
	kvStreams, err := testenv.KVStreams(ctx, s.JS)
	if err != nil {
		t.Fatal(err)
	}
	led = append(led, kvStreams...)
	first, err := testenv.StreamLeader(ctx, s.JS, events.StreamCommands)
	if err != nil || first == "" {
		t.Fatalf("no leader of %s: %v", events.StreamCommands, err)
	}
	s.Cluster.MoveLeaders(t, s.JS, first, led...)

	// One node down, mid-burst.
	newcomers := userNames("n", size(10, 50))
	wakesPer := 4
	s.Cluster.Node(first).Kill()
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
		s.users[u].WithTimeout(wakeTimeout + time.Minute)
	}
	for _, u := range sleepers {
		for range wakesPer {
			c := s.users[u]
			wg.Go(func() {
				r, err := c.HTTP.Do(mustRequest(t, s.front.URL()+"/u/"+u+"/api/files"))
				if err != nil {
					note("wake", r, err)
					return
				}
				body, _ := io.ReadAll(io.LimitReader(r.Body, 300))
				r.Body.Close()
				note("wake", r, nil)
				if r.StatusCode >= 300 {
					// The answer's detail says which step refused.
					mu.Lock()
					failures = append(failures, fmt.Sprintf("wake %s: %s", u, body))
					mu.Unlock()
				}
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
	// Every stream the killed node led has another leader now.
	var moved []string
	eventually(t, time.Minute, func() error {
		moved = moved[:0]
		for _, st := range led {
			l, err := testenv.StreamLeader(ctx, s.JS, st)
			if err != nil || l == "" || l == first {
				return fmt.Errorf("%s led by %q after %s was killed (%v)", st, l, first, err)
			}
			moved = append(moved, st+"→"+l)
		}
		return nil
	})
	handled := s.handled()
	for outcome, n := range handledBefore {
		if handled[outcome] -= n; handled[outcome] == 0 {
			delete(handled, outcome)
		}
	}
	kube.Sync()
	var twice []string
	for _, u := range newcomers {
		if w := kube.Since(mark, "SandboxClaim", "dsh-"+u); testenv.Created(w) != 1 || testenv.Deleted(w) != 0 {
			twice = append(twice, fmt.Sprintf("claim of %s created %d times, deleted %d times", u, testenv.Created(w), testenv.Deleted(w)))
		}
	}
	for _, u := range sleepers {
		if m := testenv.ModeChanges(kube.Since(mark, "Sandbox", s.Box(u).Sandbox)); !slices.Equal(m, []string{"Suspended→Running"}) {
			twice = append(twice, fmt.Sprintf("%s's sandbox mode changes %v, want one Suspended→Running", u, m))
		}
	}
	claimWrites := kube.Since(mark, "SandboxClaim", "")
	claims := s.Claims()
	one := load.Report()
	lostOne := s.sessionsLost()

	// A second node down: no quorum. It is the new leader of the command
	// stream.
	late := sleepers[0]
	s.Suspend(late)
	second, err := testenv.StreamLeader(ctx, s.JS, events.StreamCommands)
	if err != nil || second == "" || second == first {
		t.Fatalf("leader of %s after %s died: %q %v", events.StreamCommands, first, second, err)
	}
	s.Cluster.Node(second).Kill()
	quorumLost := time.Now()
	// A client that waits three times NATS_FAILOVER_WAIT: an edge that
	// hung instead of answering would be seen giving no answer at all.
	patient := 3 * failoverWait
	start := time.Now()
	signup := testenv.NewClient(t, s.front.URL()).WithTimeout(patient).Form("/users", "user", "q0")
	signupTook := time.Since(start)
	start = time.Now()
	wake := s.users[late].WithTimeout(patient).Do(http.MethodGet, "/u/"+late+"/api/files", nil, "Accept", "application/json")
	wakeTook := time.Since(start)
	// Traffic to Ready sandboxes without quorum, until the load has
	// answered a hundred more.
	eventually(t, time.Minute, func() error {
		if r := load.Report(); r.Sent < one.Sent+100 {
			return fmt.Errorf("%d requests answered without quorum", r.Sent-one.Sent)
		}
		return nil
	})
	two := load.Report()

	// Both nodes back.
	s.Cluster.Node(first).Restart(t)
	s.Cluster.Node(second).Restart(t)
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
	load.Stop()
	all := load.Report()
	lostAll := s.sessionsLost()

	report(t, "NATS node loss (3-node cluster, R3)", [][2]string{
		row("users under load", len(loaded)),
		row("burst: signups, wake requests (sandboxes)", fmt.Sprintf("%d, %d (%d)", len(newcomers), len(sleepers)*wakesPer, len(sleepers))),
		row("burst answered within (after the kill)", seconds(burst)),
		row("burst outcomes", outcomes),
		row("killed node (leader of AAAS_CMD and every bucket), new leaders", fmt.Sprintf("%s; %s", first, strings.Join(moved, ", "))),
		row("commands handled by lifecycle during the burst, by outcome", handled),
		row("claims created / deleted in Kubernetes", fmt.Sprintf("%d / %d", testenv.Created(claimWrites), testenv.Deleted(claimWrites))),
		row("commands whose effect in Kubernetes was not once", len(twice)),
		row("claims before / after (want +signups)", fmt.Sprintf("%d / %d", claimsBefore, claims)),
		row("load during one node down: sent / failed", fmt.Sprintf("%d / %d", one.Sent, one.Failed)),
		row("sessions lost (one node down)", lostOne),
		row("no quorum: signup", fmt.Sprintf("%d in %s, Retry-After %q", signup.StatusCode, seconds(signupTook), signup.Header.Get("Retry-After"))),
		row("no quorum: wake", fmt.Sprintf("%d in %s, Retry-After %q", wake.StatusCode, seconds(wakeTook), wake.Header.Get("Retry-After"))),
		row("second node killed (the new leader of AAAS_CMD)", second),
		row("no quorum: load sent / failed", fmt.Sprintf("%d / %d", two.Sent-one.Sent, two.Failed-one.Failed)),
		row("quorum lost for", seconds(back.Sub(quorumLost))),
		row("signup works again after the nodes returned", seconds(recovered)),
		row("sessions lost (end)", lostAll),
	}, all.Rows())

	for _, e := range twice {
		t.Error(e)
	}
	if c, d := testenv.Created(claimWrites), testenv.Deleted(claimWrites); c != len(newcomers) || d != 0 {
		t.Errorf("claims created %d times and deleted %d times during the burst, want %d and 0", c, d, len(newcomers))
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
	// The edge rode out the election it could not tell from a lost
	// quorum for NATS_FAILOVER_WAIT before it answered, and answered by
	// itself (the patient client would have given up at 3 × that).
	for what, d := range map[string]time.Duration{"signup": signupTook, "wake": wakeTook} {
		if d < failoverWait {
			t.Errorf("%s without quorum answered after %s, before NATS_FAILOVER_WAIT (%s) was spent", what, d, failoverWait)
		}
	}
	// Every request the load sent was answered, and within Stall: those
	// still hanging when a report was taken count too.
	if all.Failed != 0 || all.UploadsFailed != 0 {
		t.Errorf("in all: %d of %d requests and %d of %d uploads failed (%d stalled, the slowest %s)\n%s",
			all.Failed, all.Sent, all.UploadsFailed, all.Uploads, all.Stalled, all.Slowest, strings.Join(all.Failures, "\n"))
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
