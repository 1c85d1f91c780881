package faults

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// TestEdgeCutOffFromNATS cuts edge-a off from every NATS node for 60 s
// while its users work through it (the nodes see no connection of it, and
// no beacon of it is stored, until the cut ends): it keeps serving them
// from its caches, and no busy sandbox is suspended while its beacons'
// BEACON_TTL (75 s here) is unexpired; after the cut its beacons resume.
// At the same time edge-b, whose beacons are trusted for 5 s only, is cut
// with a socket open: once that TTL has passed its silence counts as
// idleness and the sandbox is suspended, as a crashed edge's would be.
// Each suspension is judged against the user's idle clock in the stream
// and the rounds the deciding sweeper made, not a wall-clock window.
func TestEdgeCutOffFromNATS(t *testing.T) {
	const idle, cut = 10 * time.Second, 60 * time.Second
	// The sweepers start once every user is busy: signing 20 users up
	// can take longer than IDLE_TIMEOUT on a loaded machine.
	s := newSystem(t, systemOptions{users: size(4, 20), env: map[string]string{"IDLE_TIMEOUT": idle.String()}, noSweepers: true,
		edgeEnv: map[string]map[string]string{"edge-a": {"BEACON_TTL": "75s"}, "edge-b": {"BEACON_TTL": "5s"}}})
	a, b := s.edges[0], s.edges[1]
	s.signup("p0")
	users := s.active([]string{"p0"})
	load := testenv.StartLoad(t, a.URL, testenv.LoadOptions{Users: users})
	// p0 keeps one socket open on edge-b and is otherwise silent.
	ws := dialThrough(t, b.URL, "p0", s.users["p0"])
	defer ws.Close()
	ctx := testenv.Context(t, 10*time.Minute)
	activity := stream(t, s)
	// lastBeacon is when the stream stored edge's newest beacon of u, and
	// when the edge sent it.
	lastBeacon := func(u, edge string) (stored, sent time.Time, err error) {
		m, err := activity.GetLastMsgForSubject(ctx, events.ActivitySubject(u, edge))
		if err != nil {
			return time.Time{}, time.Time{}, err
		}
		b, err := events.Decode[events.Beacon](m.Data)
		return m.Time, b.SentAt, err
	}
	// Handshakes for edge-a's host done and beacons flowing: every user's
	// requests answered through edge-a and beaconed from it, p0's socket
	// beaconed from edge-b.
	eventually(t, time.Minute, func() error {
		if r := load.Report(); r.Sent < 100 || r.Failed > 0 {
			return fmt.Errorf("%d requests answered, %d failed", r.Sent, r.Failed)
		}
		for u := range users {
			if _, _, err := lastBeacon(u, "edge-a"); err != nil {
				return fmt.Errorf("no beacon of %s from edge-a: %v", u, err)
			}
		}
		if i := s.Idleness("p0"); i.Stamped["edge-b"].IsZero() || i.Pinned.IsZero() {
			return fmt.Errorf("no beacon of p0's socket from edge-b: %+v", i)
		}
		return nil
	})
	s.startSweepers()
	sweeps := map[string]*testenv.Sweeps{}
	for _, sw := range s.sweepers {
		sweeps[sw.Env["INSTANCE_ID"]] = testenv.FollowSweeps(t, sw)
	}
	before := load.Report()
	for _, e := range []string{"edge/edge-a", "edge/edge-b"} {
		if n, err := s.Cluster.Connections(e); err != nil || n == 0 {
			t.Fatalf("%s has no NATS connection before the cut (%d, %v)", e, n, err)
		}
	}

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
	cutAt := time.Now()
	s.Faults.Cut("edge-a")
	s.Faults.Cut("edge-b")
	// The nodes' own view: neither edge has a connection left.
	eventually(t, 30*time.Second, func() error {
		for _, e := range []string{"edge/edge-a", "edge/edge-b"} {
			if n, err := s.Cluster.Connections(e); err != nil || n != 0 {
				return fmt.Errorf("%s still has %d NATS connections (%v)", e, n, err)
			}
		}
		return nil
	})
	gone := time.Now()
	suspendedWithin(t, s, "p0", cut)
	p0Late := s.DecidedOnTime("p0", idle, sweeps)
	time.Sleep(time.Until(cutAt.Add(cut)))
	during := load.Report()
	// Until the end of the cut: still no connection of edge-a, and no
	// beacon of it stored that it sent after the cut began (one on its way
	// at that moment may have been stored just after).
	if n, err := s.Cluster.Connections("edge/edge-a"); err != nil || n != 0 {
		t.Errorf("edge-a had %d NATS connections at the end of the cut (%v)", n, err)
	}
	var stored []string
	for u := range users {
		at, sent, err := lastBeacon(u, "edge-a")
		if err != nil || (!at.Before(cutAt) && !sent.Before(cutAt)) {
			stored = append(stored, fmt.Sprintf("%s sent %s, stored %s (%v)", u, sent.Format(time.StampMilli), at.Format(time.StampMilli), err))
		}
	}
	s.Faults.Restore("edge-a")
	s.Faults.Restore("edge-b")
	restored := time.Now()

	resumed := eventually(t, time.Minute, func() error {
		for u := range users {
			at, _, err := lastBeacon(u, "edge-a")
			if err != nil || !at.After(restored) {
				return fmt.Errorf("no beacon from edge-a for %s since the cut ended (%v)", u, err)
			}
		}
		return nil
	})
	close(stop)
	watch.Wait()
	load.Stop()
	after := load.Report()
	// Idle now: the sweeper must suspend them, IDLE_TIMEOUT after their
	// last activity.
	var slowest time.Duration
	for u := range users {
		suspendedWithin(t, s, u, 2*time.Minute)
		slowest = max(slowest, s.DecidedOnTime(u, idle, sweeps))
	}

	report(t, "Edge cut off from NATS", [][2]string{
		row("users on edge-a (BEACON_TTL 75s)", len(users)),
		row("cut", seconds(cut)),
		row("edges' NATS connections gone after the cut", seconds(gone.Sub(cutAt))),
		row("edge-a beacons stored during the cut", len(stored)),
		row("requests during the cut: sent / failed", fmt.Sprintf("%d / %d", during.Sent-before.Sent, during.Failed-before.Failed)),
		row("busy sandboxes suspended during the cut", len(left)),
		row("edge-a beacons resumed after the cut", seconds(resumed)),
		row("p0 on edge-b (BEACON_TTL 5s, socket open): suspend decided after it fell due", seconds(p0Late)),
		row("edge-a users after the load stopped (IDLE_TIMEOUT 10s): latest decision after due", seconds(slowest)),
	}, after.Rows())

	if len(stored) > 0 {
		t.Errorf("edge-a beacons stored while it was cut off: %v", stored)
	}
	if n := during.Failed - before.Failed; n != 0 || during.Sent-before.Sent < 100 {
		t.Errorf("during the cut: %d of %d requests failed\n%s", n, during.Sent-before.Sent, strings.Join(during.Failures, "\n"))
	}
	if after.Failed != 0 || after.UploadsFailed != 0 {
		t.Errorf("in all: %d of %d requests and %d of %d uploads failed\n%s", after.Failed, after.Sent, after.UploadsFailed, after.Uploads, strings.Join(after.Failures, "\n"))
	}
	if during.Sockets != before.Sockets {
		t.Errorf("sockets through edge-a were reopened during the cut: %v", during.Closed)
	}
	if len(left) != 0 {
		t.Errorf("busy sandboxes left Ready while their edge was cut off: %v", left)
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
