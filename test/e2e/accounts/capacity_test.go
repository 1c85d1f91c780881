package accounts_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// usage follows every change of the sandboxes bucket and keeps the
// highest numbers of managed sandboxes holding a pod and starting that
// were ever true at once since the last reset: a cap is proved by every
// state the bucket went through, not by samples.
type usage struct {
	mu                    sync.Mutex
	phases                map[string]state.Phase
	running, starting     int
	maxRunning, maxStarts int
}

func watchUsage(t *testing.T, w *testenv.Stack) *usage {
	u := &usage{phases: map[string]state.Phase{}}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	b, err := kv.Open[state.Sandbox](ctx, w.JS, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.NewCache(ctx, b, ">", testenv.Logger(), kv.OnChange(func(key string, e kv.Entry[state.Sandbox], deleted bool) {
		u.mu.Lock()
		defer u.mu.Unlock()
		if deleted || !e.Value.Managed {
			delete(u.phases, key)
		} else {
			u.phases[key] = e.Value.Phase
		}
		u.running, u.starting = 0, 0
		for _, p := range u.phases {
			if p.Running() {
				u.running++
			}
			if p == state.PhaseWaking {
				u.starting++
			}
		}
		u.maxRunning, u.maxStarts = max(u.maxRunning, u.running), max(u.maxStarts, u.starting)
	})); err != nil {
		t.Fatal(err)
	}
	return u
}

func (u *usage) reset() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.maxRunning, u.maxStarts = u.running, u.starting
}

func (u *usage) peaks() (running, starting int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.maxRunning, u.maxStarts
}

// starting asks for user's sandbox as a browser navigation does and
// returns the starting page it gets until that says want.
func startingPage(t *testing.T, c *testenv.Client, user, want string) {
	t.Helper()
	testutil.Eventually(t, 30*time.Second, func() error {
		r := c.Do(http.MethodGet, "/u/"+user+"/", nil, "Accept", "text/html")
		if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), want) {
			return fmt.Errorf("%s's page: %d, want 503 saying %q: %s", user, r.StatusCode, want, shownState(r.Body))
		}
		return nil
	})
}

// shownState is the state line of a starting page (or the start of any
// other body), for failure messages.
func shownState(body []byte) string {
	s := string(body)
	if i := strings.Index(s, `id="phase"`); i >= 0 {
		s = s[i:]
		if j := strings.Index(s, "</p>"); j >= 0 {
			s = s[:j]
		}
	}
	return fmt.Sprintf("%.400s", s)
}

// With MAX_RUNNING_SANDBOXES=2 and MAX_CONCURRENT_STARTS=1, on two edges:
// wakes start one at a time and never beyond two running; the others wait
// in order, see their place on either edge, and take the places as they
// free up, oldest first.
func TestWakesQueueForAPlaceAcrossTwoEdges(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"SIGNUP_INVITE_CODE": invite, "MAX_RUNNING_SANDBOXES": "2", "MAX_CONCURRENT_STARTS": "1",
	}, Lifecycle: "lc-a"})
	edges := []*testenv.Edge{w.Edge("edge-a", nil), w.Edge("edge-b", nil)}
	use := watchUsage(t, w)
	users := []string{"q1", "q2", "q3", "q4"}
	clients := map[string]*testenv.Client{}
	for i, u := range users {
		clients[u] = testenv.NewClient(t, edges[i%2].URL)
		clients[u].Signup(u, invite)
	}
	for _, u := range users {
		w.WaitPhase(t, u, state.PhaseReady, 2*time.Minute)
		w.Suspend(u)
	}
	use.reset()

	// q1 and q2 at once: both served, one start at a time.
	var wg sync.WaitGroup
	for _, u := range users[:2] {
		wg.Go(func() {
			if r := clients[u].WithTimeout(2*time.Minute).Do(http.MethodGet, "/u/"+u+"/api/files", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK {
				t.Errorf("%s: %d %s", u, r.StatusCode, r.Body)
			}
		})
	}
	wg.Wait()

	// q3 then q4 wait, and see where they stand on either edge.
	startingPage(t, clients["q3"], "q3", "number 1 of 1 in the queue")
	startingPage(t, clients["q4"], "q4", "number 2 of 2 in the queue")
	for _, e := range edges {
		r := clients["q3"].At(e.URL).Do(http.MethodGet, "/_/status", nil, "Accept", "application/json")
		if m := r.JSON(); m["phase"] != "Queued" || !strings.Contains(fmt.Sprint(m["reason"]), "number 1 of 2") {
			t.Errorf("q3's status on %s: %s", e.URL, r.Body)
		}
	}
	time.Sleep(2 * time.Second) // eight rounds of admission: nobody may start
	for _, u := range []string{"q3", "q4"} {
		if p := w.Box(u).Phase; p != state.PhaseSuspended {
			t.Fatalf("%s started without a place: %s", u, p)
		}
	}

	// A place frees: the oldest waiting takes it, the other moves up.
	w.Suspend("q1")
	w.WaitPhase(t, "q3", state.PhaseReady, 2*time.Minute)
	if p := w.Box("q4").Phase; p != state.PhaseSuspended {
		t.Fatalf("q4 started before its turn: %s", p)
	}
	startingPage(t, clients["q4"], "q4", "number 1 of 1 in the queue")
	w.Suspend("q2")
	w.WaitPhase(t, "q4", state.PhaseReady, 2*time.Minute)

	running, starting := use.peaks()
	t.Logf("peaks: %d running, %d starting", running, starting)
	if running > 2 || starting > 1 {
		t.Fatalf("caps broken: %d running (cap 2), %d starting (cap 1) at once", running, starting)
	}
	if starting != 1 {
		t.Fatalf("no start was ever seen (peak %d): the test proves nothing", starting)
	}
	if a := w.AuditLog(); !strings.Contains(a, "in the queue") {
		t.Error("no audit event says a sandbox started from the queue")
	}
}

// IDLE_EVICT: while a wake waits for the only place, the sweeper suspends
// the running sandbox to make room, but never while it has work in
// flight (an open WebSocket).
func TestIdleEvictMakesRoomButNeverForABusySandbox(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"SIGNUP_INVITE_CODE": invite, "MAX_RUNNING_SANDBOXES": "1",
	}, Lifecycle: "lc-a"})
	w.Sweeper("sw-a", map[string]string{"IDLE_EVICT": "true", "IDLE_TIMEOUT": "1h", "SWEEP_INTERVAL": "200ms"})
	edge := w.Edge("edge-a", nil)
	busyToken := testenv.NewClient(t, edge.URL).Signup("busy", invite)
	waiter := testenv.NewClient(t, edge.URL)
	waiter.Signup("waiter", invite)
	w.WaitPhase(t, "waiter", state.PhaseReady, 2*time.Minute)
	w.Suspend("waiter")

	ws, _, err := websocket.DefaultDialer.Dial(strings.Replace(edge.URL, "http", "ws", 1)+"/u/busy/api/ws", http.Header{"Authorization": {"Bearer " + busyToken}})
	if err != nil {
		t.Fatal(err)
	}
	startingPage(t, waiter, "waiter", "number 1 of 1 in the queue")
	time.Sleep(3 * time.Second) // fifteen sweeps
	if p := w.Box("busy").Phase; p != state.PhaseReady {
		t.Fatalf("a sandbox with an open WebSocket was evicted: %s", p)
	}
	if p := w.Box("waiter").Phase; p != state.PhaseSuspended {
		t.Fatalf("the waiter started beyond the cap: %s", p)
	}
	ws.Close()
	w.WaitPhase(t, "busy", state.PhaseSuspended, 2*time.Minute)
	w.WaitPhase(t, "waiter", state.PhaseReady, 2*time.Minute)
	if a := w.AuditLog(); !strings.Contains(a, `"user":"busy"`) || !strings.Contains(a, "evicted since") {
		t.Error("no audit event says busy was evicted")
	}
}
