package faults

import (
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/state"
)

// TestLifecycleKilledMidCommand SIGKILLs the lifecycle worker that took a
// claim, a wake, a handshake and a recreate while it is in the middle of
// its Kubernetes work (every API call is slowed by a fault proxy, so the
// answer to a write it made is still on its way back when the test sees
// the write in etcd and kills it), and checks that the other replica
// took each over from a redelivery of the same message, with the effect
// the user asked for, done once: every create, delete and mode change of
// the namespace's claims and sandboxes is read from etcd's history.
func TestLifecycleKilledMidCommand(t *testing.T) {
	s := newSystem(t, systemOptions{users: 2, noSweepers: true})
	s.Suspend("u0")
	kube := s.RecordKube()
	for _, p := range s.lifecycles {
		s.Faults.Latency("kube-"+p.Env["INSTANCE_ID"], 500*time.Millisecond)
	}
	answers := make(chan *testenv.Response, 1)
	newcomer := testenv.NewClient(t, s.front.URL())
	oldClaim := ""
	cases := []struct {
		verb, user string
		// start sends what makes an edge publish the command.
		start func() *testenv.Response
		// want is the answer the user must get in the end.
		want int
		// midway is what the worker has done in Kubernetes when it is
		// killed ("" when the command writes nothing there: then it is
		// killed as soon as it runs it), and done reports it.
		midway string
		done   func(mark int64) bool
		// once checks the writes of the whole command, wherever made.
		once func(mark int64) error
	}{
		{verb: "claim", user: "k0", want: http.StatusCreated,
			start:  func() *testenv.Response { return newcomer.Form("/users", "user", "k0") },
			midway: "created the claim",
			done: func(mark int64) bool {
				return testenv.Created(kube.Since(mark, "SandboxClaim", "dsh-k0")) > 0
			},
			once: func(mark int64) error {
				w := kube.Since(mark, "SandboxClaim", "dsh-k0")
				if c, d := testenv.Created(w), testenv.Deleted(w); c != 1 || d != 0 {
					return fmt.Errorf("claim dsh-k0 created %d times, deleted %d times", c, d)
				}
				return nil
			}},
		{verb: "wake", user: "u0", want: http.StatusOK,
			start: func() *testenv.Response {
				return s.users["u0"].Do(http.MethodGet, "/u/u0/api/files", nil, "Accept", "application/json")
			},
			midway: "set the sandbox Running",
			done: func(mark int64) bool {
				return len(testenv.ModeChanges(kube.Since(mark, "Sandbox", s.Box("u0").Sandbox))) > 0
			},
			once: func(mark int64) error {
				if m := testenv.ModeChanges(kube.Since(mark, "Sandbox", s.Box("u0").Sandbox)); !slices.Equal(m, []string{"Suspended→Running"}) {
					return fmt.Errorf("u0's sandbox mode changes %v, want one Suspended→Running", m)
				}
				return unchangedClaims(kube, mark)
			}},
		// A host the sandbox has no DSH cookie for yet: edge-a's own address.
		{verb: "handshake", user: "u1", want: http.StatusOK,
			start: func() *testenv.Response {
				return s.users["u1"].At(s.edges[0].URL).Do(http.MethodGet, "/u/u1/api/files", nil, "Accept", "application/json")
			},
			once: func(mark int64) error {
				if m := testenv.ModeChanges(kube.Since(mark, "Sandbox", "")); len(m) > 0 {
					return fmt.Errorf("a handshake changed sandbox modes: %v", m)
				}
				return unchangedClaims(kube, mark)
			}},
		{verb: "recreate", user: "u1", want: http.StatusAccepted,
			start: func() *testenv.Response {
				oldClaim = s.Box("u1").Claim
				return s.users["u1"].Do(http.MethodPost, "/recreate", nil, "Accept", "application/json")
			},
			midway: "started deleting the old claim",
			done: func(mark int64) bool {
				for _, w := range kube.Since(mark, "SandboxClaim", "dsh-u1") {
					if w.Deleting || w.Deleted {
						return true
					}
				}
				return false
			},
			once: func(mark int64) error {
				w := kube.Since(mark, "SandboxClaim", "dsh-u1")
				if c, d, uids := testenv.Created(w), testenv.Deleted(w), testenv.UIDs(w); c != 1 || d != 1 || len(uids) != 2 {
					return fmt.Errorf("claim dsh-u1 (was %s): created %d times, deleted %d times, UIDs %v; want the old one deleted and one new", oldClaim, c, d, uids)
				}
				return nil
			}},
	}
	var rows [][2]string
	for _, tc := range cases {
		kube.Sync()
		mark := kube.Mark()
		before := map[*testenv.Proc]float64{}
		for _, p := range s.lifecycles {
			before[p] = s.metric(p, "aaas_lifecycle_commands_redelivered_total", "verb", tc.verb)
		}
		go func() { answers <- tc.start() }()
		// The worker that took it is the one running a command of its verb.
		var took, other *testenv.Proc
		eventually(t, time.Minute, func() error {
			for _, p := range s.lifecycles {
				if s.metric(p, "aaas_lifecycle_commands_running", "verb", tc.verb) > 0 {
					took = p
					return nil
				}
			}
			return fmt.Errorf("no worker is running the %s of %s", tc.verb, tc.user)
		})
		for _, p := range s.lifecycles {
			if p != took {
				other = p
			}
		}
		if tc.done != nil {
			eventually(t, time.Minute, func() error {
				if !tc.done(mark) {
					return fmt.Errorf("%s has not %s for the %s of %s", took.Env["INSTANCE_ID"], tc.midway, tc.verb, tc.user)
				}
				return nil
			})
		}
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
		// The killed worker never acknowledged the command: the survivor
		// had it again. (The user's answer can come before the survivor's
		// handler returns.)
		eventually(t, 30*time.Second, func() error {
			if s.metric(other, "aaas_lifecycle_commands_redelivered_total", "verb", tc.verb) <= before[other] {
				return fmt.Errorf("%s of %s: %s took no redelivery of it over", tc.verb, tc.user, other.Env["INSTANCE_ID"])
			}
			return nil
		})
		if tc.verb != "handshake" {
			s.waitPhase(tc.user, state.PhaseReady, 2*time.Minute)
		}
		kube.Sync()
		if err := tc.once(mark); err != nil {
			t.Errorf("%s of %s: %v", tc.verb, tc.user, err)
		}
		what := "while running it"
		if tc.midway != "" {
			what = "after it had " + tc.midway
		}
		rows = append(rows, row(fmt.Sprintf("%s of %s: %s killed %s; answered", tc.verb, tc.user, took.Env["INSTANCE_ID"], what),
			fmt.Sprintf("%d after %s, taken over by %s from a redelivery", r.StatusCode, seconds(finished), other.Env["INSTANCE_ID"])))
		took.Restart(t)
		took.WaitReady(t, time.Minute)
	}
	kube.Sync()
	all := kube.Since(0, "SandboxClaim", "")
	claims := s.Claims()
	rows = append(rows,
		row("claims created / deleted in Kubernetes (want 2 / 1: k0's, u1's new one; u1's old one)", fmt.Sprintf("%d / %d", testenv.Created(all), testenv.Deleted(all))),
		row("claims (want one per user)", fmt.Sprintf("%d for %d users", claims, len(s.users)+1)))
	report(t, "lifecycle SIGKILLed mid-command (API calls slowed by 2 × 500 ms)", rows)
	if c, d := testenv.Created(all), testenv.Deleted(all); c != 2 || d != 1 {
		t.Errorf("claims created %d times and deleted %d times in all, want 2 and 1", c, d)
	}
	if claims != len(s.users)+1 {
		t.Errorf("%d claims for %d users", claims, len(s.users)+1)
	}
}

// unchangedClaims fails if a claim was created or deleted since mark.
func unchangedClaims(kube *testenv.KubeWrites, mark int64) error {
	w := kube.Since(mark, "SandboxClaim", "")
	if c, d := testenv.Created(w), testenv.Deleted(w); c != 0 || d != 0 {
		return fmt.Errorf("claims created %d times, deleted %d times", c, d)
	}
	return nil
}
