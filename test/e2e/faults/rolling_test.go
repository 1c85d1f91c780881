package faults

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/testenv"
)

// TestRollingRestartOfEveryEdge restarts the three edges one at a time
// under load, as a Deployment's rolling update does: SIGTERM, wait for the
// exit, start it again, wait until it is ready, next. The front retries
// idempotent requests on another edge; sockets are told 1001 and the
// clients reconnect with the same session.
func TestRollingRestartOfEveryEdge(t *testing.T) {
	s := newSystem(t, systemOptions{users: size(6, 20)})
	load := s.load(testenv.LoadOptions{})
	time.Sleep(3 * time.Second)
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
		time.Sleep(2 * time.Second) // let the clients spread onto it again
	}
	rolled := time.Since(start)
	time.Sleep(3 * time.Second)
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
	if r.Reconnected < closed {
		t.Errorf("%d sockets reconnected after %d closes", r.Reconnected, closed)
	}
	if r.Lost != 0 {
		t.Errorf("%d echoes lost", r.Lost)
	}
	if lost != 0 {
		t.Errorf("%d sessions lost", lost)
	}
}
