package faults

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// TestRollingRestartOfEveryEdge restarts the three edges one at a time
// under load, as a Deployment's rolling update does: SIGTERM, wait for the
// exit, start it again, wait until it is ready and serving again, next.
// The front retries idempotent requests on another edge, so none fails;
// an upload may meet the keep-alive race of a draining edge (a 502 from
// the front, at most one per restart); sockets are told 1001 and the
// clients reconnect with the same session.
func TestRollingRestartOfEveryEdge(t *testing.T) {
	s := newSystem(t, systemOptions{users: size(6, 20)})
	load := s.load(testenv.LoadOptions{})
	// Traffic flowing, every user's socket open.
	eventually(t, time.Minute, func() error {
		if r := load.Report(); r.Sent < 100 || r.Sockets < len(s.users) {
			return fmt.Errorf("%d requests answered, %d of %d sockets open", r.Sent, r.Sockets, len(s.users))
		}
		return nil
	})
	start := time.Now()
	var stopped []time.Duration
	for _, e := range s.edges {
		t0 := time.Now()
		e.Stop()
		stopped = append(stopped, time.Since(t0))
		if code := e.ExitCode(); code != 0 {
			t.Errorf("%s exited with %d on SIGTERM", e.Env["INSTANCE_ID"], code)
		}
		e.Restart(t)
		e.WaitReady(t, time.Minute)
		// The clients spread onto it again: the front sends it requests.
		eventually(t, time.Minute, func() error {
			if n := s.metric(e.Proc, "aaas_edge_requests_total"); n < 20 {
				return fmt.Errorf("%s served %v requests since its restart", e.Env["INSTANCE_ID"], n)
			}
			return nil
		})
	}
	rolled := time.Since(start)
	// After the rollout: every closed socket reopened, and a hundred more
	// requests answered.
	sent := load.Report().Sent
	eventually(t, time.Minute, func() error {
		r := load.Report()
		closed := 0
		for _, n := range r.Closed {
			closed += n
		}
		if r.Reconnected < closed || r.Sent < sent+100 {
			return fmt.Errorf("%d of %d closed sockets reconnected, %d requests since the rollout", r.Reconnected, closed, r.Sent-sent)
		}
		return nil
	})
	load.Stop()
	r := load.Report()
	lost := s.sessionsLost()
	report(t, "Rolling restart of 3 edges under load", [][2]string{
		row("users", len(s.users)),
		row("rollout took", seconds(rolled)),
		row("edge drains (SIGTERM to exit)", fmt.Sprint(stopped)),
	}, r.Rows(), [][2]string{row("sessions lost", lost)})

	if r.Failed != 0 {
		t.Errorf("%d of %d idempotent requests failed through the front: %v\n%s", r.Failed, r.Sent, r.Requests, strings.Join(r.Failures, "\n"))
	}
	if r.Sent < 100 {
		t.Errorf("only %d requests sent: the load did not run", r.Sent)
	}
	// The documented race: the front sent a POST on a pooled connection
	// the draining edge was closing, and no proxy retries a POST.
	if race := r.Requests["POST upload 502"]; r.UploadsFailed != race || race > len(s.edges) {
		t.Errorf("%d of %d uploads failed, %d of them 502s from the front; want only the keep-alive race, at most one per restart (%d)\n%s",
			r.UploadsFailed, r.Uploads, race, len(s.edges), strings.Join(r.Failures, "\n"))
	}
	closed := 0
	for code, n := range r.Closed {
		closed += n
		if code != 1001 {
			t.Errorf("%d sockets ended with %d, want every one closed with 1001 (going away)", n, code)
		}
	}
	// Every user had a socket on some edge, and every edge was restarted.
	if closed < len(s.users) {
		t.Errorf("%d sockets closed, want at least one per user (%d): the restarts did not reach them", closed, len(s.users))
	}
	if r.Lost != 0 {
		t.Errorf("%d echoes lost", r.Lost)
	}
	if lost != 0 {
		t.Errorf("%d sessions lost", lost)
	}
}
