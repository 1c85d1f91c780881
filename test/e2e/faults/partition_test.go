package faults

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
)

// TestEdgeCutOffFromNATS cuts edge-a off from every NATS node for 60 s
// while its users work through it: it keeps serving them from its caches,
// and no busy sandbox is suspended while its beacons' BEACON_TTL (75 s
// here) is unexpired; after the cut its beacons resume. At the same time
// edge-b, whose beacons are trusted for 5 s only, is cut with a socket
// open: once that TTL has passed its silence counts as idleness and the
// sandbox is suspended, as a crashed edge's would be.
func TestEdgeCutOffFromNATS(t *testing.T) {
	const idle, cut = 10 * time.Second, 60 * time.Second
	s := newSystem(t, systemOptions{users: size(4, 20), env: map[string]string{"IDLE_TIMEOUT": idle.String()},
		edgeEnv: map[string]map[string]string{"edge-a": {"BEACON_TTL": "75s"}, "edge-b": {"BEACON_TTL": "5s"}}})
	a, b := s.edges[0], s.edges[1]
	s.signup("p0")
	users := s.active([]string{"p0"})
	load := testenv.StartLoad(t, a.URL, testenv.LoadOptions{Users: users})
	// p0 keeps one socket open on edge-b and is otherwise silent.
	ws := dialThrough(t, b.URL, "p0", s.users["p0"])
	defer ws.Close()
	time.Sleep(5 * time.Second) // handshakes for edge-a's host done, beacons flowing
	before := load.Report()

	var mu sync.Mutex
	left := map[string]state.Phase{}
	stop := make(chan struct{})
	var watch sync.WaitGroup
	watch.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
			for u := range users {
				if p := s.Box(u).Phase; p != state.PhaseReady {
					mu.Lock()
					left[u] = p
					mu.Unlock()
				}
			}
		}
	})
	s.Faults.Cut("edge-a")
	s.Faults.Cut("edge-b")
	cutAt := time.Now()
	p0Suspended := suspendedWithin(t, s, "p0", cut)
	time.Sleep(time.Until(cutAt.Add(cut)))
	during := load.Report()
	s.Faults.Restore("edge-a")
	s.Faults.Restore("edge-b")
	restored := time.Now()

	resumed := eventually(t, time.Minute, func() error {
		for u := range users {
			m, err := stream(t, s).GetLastMsgForSubject(testenv.Context(t, 10*time.Second), events.ActivitySubject(u, "edge-a"))
			if err != nil || !m.Time.After(restored) {
				return fmt.Errorf("no beacon from edge-a for %s since the cut ended (%v)", u, err)
			}
		}
		return nil
	})
	close(stop)
	watch.Wait()
	load.Stop()
	stopped := time.Now()
	after := load.Report()
	// Idle now: the sweeper must suspend them, IDLE_TIMEOUT after their
	// last activity.
	var slowest time.Duration
	for u := range users {
		if d := suspendedWithin(t, s, u, idle+30*time.Second).Sub(stopped); d > slowest {
			slowest = d
		}
	}

	report(t, "Edge cut off from NATS", [][2]string{
		row("users on edge-a (BEACON_TTL 75s)", len(users)),
		row("cut", seconds(cut)),
		row("requests during the cut: sent / failed", fmt.Sprintf("%d / %d", during.Sent-before.Sent, during.Failed-before.Failed)),
		row("busy sandboxes suspended during the cut", len(left)),
		row("edge-a beacons resumed after the cut", seconds(resumed)),
		row("p0 on edge-b (BEACON_TTL 5s, socket open) suspended after", seconds(p0Suspended.Sub(cutAt))),
		row("edge-a users suspended after the load stopped (IDLE_TIMEOUT 10s)", seconds(slowest)),
	}, after.Rows())

	if n := during.Failed - before.Failed; n != 0 || during.Sent-before.Sent < 100 {
		t.Errorf("during the cut: %d of %d requests failed\n%s", n, during.Sent-before.Sent, strings.Join(during.Failures, "\n"))
	}
	if after.UploadsFailed != 0 {
		t.Errorf("%d of %d uploads failed\n%s", after.UploadsFailed, after.Uploads, strings.Join(after.Failures, "\n"))
	}
	if during.Sockets != before.Sockets {
		t.Errorf("sockets through edge-a were reopened during the cut: %v", during.Closed)
	}
	if len(left) != 0 {
		t.Errorf("busy sandboxes left Ready while their edge was cut off: %v", left)
	}
	if d := p0Suspended.Sub(cutAt); d < 5*time.Second || d > idle+10*time.Second {
		t.Errorf("p0 suspended %s after edge-b was cut, want after its 5s BEACON_TTL and within IDLE_TIMEOUT+10s", d)
	}
	if slowest < idle-2*time.Second || slowest > idle+10*time.Second {
		t.Errorf("idle users suspended up to %s after the load stopped, want about IDLE_TIMEOUT (%s)", slowest, idle)
	}
}

// suspendedWithin waits until user's sandbox leaves Ready for
// suspension and returns when it was seen.
func suspendedWithin(t *testing.T, s *system, user string, within time.Duration) time.Time {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if p := s.Box(user).Phase; p == state.PhaseSuspending || p == state.PhaseSuspended {
			return time.Now()
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s not suspended within %s: %+v", user, within, s.Box(user))
	return time.Time{}
}

func dialThrough(t *testing.T, base, user string, c *testenv.Client) *websocket.Conn {
	t.Helper()
	h := http.Header{"Origin": {base}}
	for _, ck := range c.HTTP.Jar.Cookies(mustURL(t, base)) {
		h.Add("Cookie", ck.Name+"="+ck.Value)
	}
	d := websocket.Dialer{HandshakeTimeout: 30 * time.Second}
	ws, resp, err := d.Dial(strings.Replace(base, "http://", "ws://", 1)+"/u/"+user+"/api/ws", h)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	return ws
}
