package faults

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

// TestLifecycleKilledMidCommand SIGKILLs the lifecycle worker that took a
// claim, a wake, a handshake and a recreate while it is in the middle of
// its Kubernetes work (every API call is slowed by a fault proxy so it
// surely is), and checks that the other replica finished each from a
// redelivery of the same message, with the effect the user asked for and
// nothing done twice.
func TestLifecycleKilledMidCommand(t *testing.T) {
	s := newSystem(t, systemOptions{users: 2, noSweepers: true})
	s.Suspend("u0")
	for _, p := range s.lifecycles {
		s.Faults.Latency("kube-"+p.Env["INSTANCE_ID"], 500*time.Millisecond)
	}
	answers := make(chan *testenv.Response, 1)
	newcomer := testenv.NewClient(t, s.front.URL())
	cases := []struct {
		verb, user string
		// start sends what makes an edge publish the command.
		start func() *testenv.Response
		// want is the answer the user must get in the end.
		want int
	}{
		{"claim", "k0", func() *testenv.Response { return newcomer.Form("/users", "user", "k0") }, http.StatusCreated},
		{"wake", "u0", func() *testenv.Response {
			return s.users["u0"].Do(http.MethodGet, "/u/u0/api/files", nil, "Accept", "application/json")
		}, http.StatusOK},
		// A host the sandbox has no DSH cookie for yet: edge-a's own address.
		{"handshake", "u1", func() *testenv.Response {
			return s.users["u1"].At(s.edges[0].URL).Do(http.MethodGet, "/u/u1/api/files", nil, "Accept", "application/json")
		}, http.StatusOK},
		{"recreate", "u1", func() *testenv.Response {
			return s.users["u1"].Do(http.MethodPost, "/recreate", nil, "Accept", "application/json")
		}, http.StatusAccepted},
	}
	var rows [][2]string
	for _, tc := range cases {
		marks := map[*testenv.Proc]int{}
		for _, p := range s.lifecycles {
			marks[p] = len(p.Logs())
		}
		go func() { answers <- tc.start() }()
		var took *testenv.Proc
		eventually(t, time.Minute, func() error {
			for _, p := range s.lifecycles {
				if l := commandLines(p.Logs()[marks[p]:], "command received", tc.verb, tc.user); len(l) > 0 {
					took = p
					return nil
				}
			}
			return fmt.Errorf("no worker has taken the %s of %s", tc.verb, tc.user)
		})
		time.Sleep(700 * time.Millisecond) // inside its first API calls
		took.Kill()
		killed := time.Now()
		var r *testenv.Response
		select {
		case r = <-answers:
		case <-time.After(3 * time.Minute):
			t.Fatalf("%s: no answer 3 minutes after the kill", tc.verb)
		}
		finished := time.Since(killed)
		if r.StatusCode != tc.want {
			t.Errorf("%s of %s: %d %.300s, want %d", tc.verb, tc.user, r.StatusCode, r.Body, tc.want)
		}
		var other *testenv.Proc
		for _, p := range s.lifecycles {
			if p != took {
				other = p
			}
		}
		// The user's answer can come before the worker logs its completion.
		delivered := 0
		var done []commandLine
		testutil.Eventually(t, 30*time.Second, func() error {
			done = commandLines(other.Logs()[marks[other]:], "command done", tc.verb, tc.user)
			for _, l := range done {
				delivered = max(delivered, l.Delivered)
			}
			if delivered < 2 {
				return fmt.Errorf("%s of %s: the surviving worker's completions %+v show no redelivery", tc.verb, tc.user, done)
			}
			return nil
		})
		if tc.verb != "handshake" {
			s.waitPhase(tc.user, state.PhaseReady, 2*time.Minute)
		}
		rows = append(rows, row(fmt.Sprintf("%s of %s: killed %s; answered", tc.verb, tc.user, took.Env["INSTANCE_ID"]),
			fmt.Sprintf("%d after %s, finished by %s at delivery %d", r.StatusCode, seconds(finished), other.Env["INSTANCE_ID"], delivered)))
		took.Restart(t)
		took.WaitReady(t, time.Minute)
	}
	cl := s.commands()
	claims := s.Claims()
	rows = append(rows, row("commands carried out twice", cl.duplicated()), row("claims (want one per user)", fmt.Sprintf("%d for %d users", claims, len(s.users)+1)))
	report(t, "lifecycle SIGKILLed mid-command (API calls slowed by 2 × 500 ms)", rows)
	if d := cl.duplicated(); d != 0 {
		t.Errorf("%d commands carried out twice", d)
	}
	if claims != len(s.users)+1 {
		t.Errorf("%d claims for %d users", claims, len(s.users)+1)
	}
}

// commandLine is a lifecycle log line about a command.
type commandLine struct {
	Msg, Verb, User string
	Seq             uint64
	Delivered       int
	Outcome         string
}

func commandLines(logs, msg, verb, user string) []commandLine {
	var out []commandLine
	for _, l := range parseCommandLines(logs) {
		if l.Msg == msg && l.Verb == verb && l.User == user {
			out = append(out, l)
		}
	}
	return out
}

// parseCommandLines are the lines of a lifecycle log that name a command
// message.
func parseCommandLines(logs string) []commandLine {
	var out []commandLine
	for _, line := range strings.Split(logs, "\n") {
		var l commandLine
		if strings.HasPrefix(line, "{") && json.Unmarshal([]byte(line), &l) == nil && l.Seq != 0 {
			out = append(out, l)
		}
	}
	return out
}
