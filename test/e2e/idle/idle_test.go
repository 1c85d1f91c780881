// Package idle tests idle suspension end to end: edges, lifecycle and
// sweepers as real processes against devcluster.
package idle_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

// newStack runs a stack whose edges beacon every second (trusted for 3s)
// and whose sweepers use idle.
func newStack(t *testing.T, idle time.Duration) *testenv.Stack {
	return pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": "200ms",
	}, Lifecycle: "lc-a"})
}

// suspendedAt waits for user's sandbox to be Suspended and returns when
// the watch saw it start suspending.
func suspendedAt(t *testing.T, s *testenv.Stack, user string, within time.Duration) time.Time {
	t.Helper()
	var at time.Time
	_, _, err := s.Sandboxes().Wait(testenv.Context(t, within), user, func(e kv.Entry[state.Sandbox], _ bool) bool {
		if at.IsZero() && (e.Value.Phase == state.PhaseSuspending || e.Value.Phase == state.PhaseSuspended) {
			at = time.Now()
		}
		return e.Value.Phase == state.PhaseSuspended
	})
	if err != nil {
		t.Fatalf("%s not suspended within %s", user, within)
	}
	return at
}

// staysReady fails if user's sandbox leaves Ready while the sweeper that
// sweeps follows makes rounds more rounds of decisions: the window is
// measured in what the sweeper did, not in wall-clock time.
func staysReady(t *testing.T, s *testenv.Stack, user string, sweeps *testenv.Sweeps, rounds int) {
	t.Helper()
	ctx, cancel := context.WithCancel(testenv.Context(t, 5*time.Minute))
	defer cancel()
	target := sweeps.Rounds() + rounds
	left := make(chan state.Phase, 1)
	go func() {
		if e, _, err := s.Sandboxes().Wait(ctx, user, func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase != state.PhaseReady }); err == nil {
			left <- e.Value.Phase
		}
	}()
	testutil.Eventually(t, 5*time.Minute, func() error {
		select {
		case p := <-left:
			t.Fatalf("%s became %s", user, p)
		default:
		}
		if n := sweeps.Rounds(); n < target {
			return fmt.Errorf("%d of %d rounds of decisions made", n, target)
		}
		return nil
	})
	select {
	case p := <-left:
		t.Fatalf("%s became %s", user, p)
	default:
	}
}

func TestIdleSandboxIsSuspendedAndWakesWithItsState(t *testing.T) {
	idle := 4 * time.Second
	w := newStack(t, idle)
	sweeps := map[string]*testenv.Sweeps{"sw-a": testenv.FollowSweeps(t, w.Sweeper("sw-a", nil))}
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("ann", "")
	if r := c.Do("PUT", "/u/ann/api/files/keep.txt", strings.NewReader("kept")); r.StatusCode != http.StatusCreated {
		t.Fatalf("upload %d", r.StatusCode)
	}
	if r := c.Do("POST", "/u/ann/api/chat", strings.NewReader(`{"message":"remember me"}`), "Content-Type", "application/json"); r.StatusCode != http.StatusOK {
		t.Fatalf("chat %d", r.StatusCode)
	}
	suspendedAt(t, w, "ann", time.Minute)
	w.DecidedOnTime("ann", idle, sweeps)

	r := c.Do("GET", "/u/ann/api/files/keep.txt", nil)
	if r.StatusCode != http.StatusOK || string(r.Body) != "kept" {
		t.Fatalf("file after wake: %d %q", r.StatusCode, r.Body)
	}
	if r := c.Do("GET", "/u/ann/api/chat?session=default", nil); !strings.Contains(string(r.Body), "remember me") {
		t.Fatalf("chat history after wake: %s", r.Body)
	}
}

func TestOpenWebSocketPinsTheSandboxUntilItsEdgeDies(t *testing.T) {
	idle := 3 * time.Second
	w := newStack(t, idle)
	sw := testenv.FollowSweeps(t, w.Sweeper("sw-a", nil))
	a := w.Edge("edge-a", nil)
	w.Edge("edge-b", nil)
	c := testenv.NewClient(t, a.URL)
	c.Signup("bo", "")
	ws, _, err := (&websocket.Dialer{}).Dial(strings.Replace(a.URL, "http", "ws", 1)+"/u/bo/api/ws",
		http.Header{"Cookie": {"dsh_gw_session=" + c.Cookie("dsh_gw_session").Value}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	// Silent for three idle timeouts' worth of the sweeper's rounds
	// (SWEEP_INTERVAL 200ms); edge B sees nothing from bo at all.
	staysReady(t, w, "bo", sw, int(3*idle/(200*time.Millisecond)))
	a.Kill()
	suspendedAt(t, w, "bo", time.Minute)
	// Its last beacon (work in flight) pinned it for BEACON_TTL: it fell
	// due once that and IDLE_TIMEOUT from it had passed.
	if i := w.Idleness("bo"); i.Pinned.IsZero() {
		t.Fatalf("bo's beacons reported no open socket: %+v", i)
	}
	w.DecidedOnTime("bo", idle, map[string]*testenv.Sweeps{"sw-a": sw})
}

func TestSweeperRestartAndFailover(t *testing.T) {
	idle := 6 * time.Second
	w := newStack(t, idle)
	s1 := w.Sweeper("sw-a", nil)
	sweeps := map[string]*testenv.Sweeps{"sw-a": testenv.FollowSweeps(t, s1)}
	edge := w.Edge("edge-a", nil)
	// Restart at half the idle time: the clock is rebuilt, not restarted
	// (which would suspend at 1.5 idle timeouts, many rounds too late).
	c := testenv.NewClient(t, edge.URL)
	c.Signup("cal", "")
	if r := c.Do("GET", "/u/cal/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("request: %d", r.StatusCode)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if half := w.Idleness("cal").Last.Add(idle / 2); time.Now().Before(half) {
			return fmt.Errorf("cal not idle for half the timeout yet (at %s)", half.Format(time.StampMilli))
		}
		return nil
	})
	s1.Stop()
	s1.Restart(t)
	s1.WaitReady(t, time.Minute)
	suspendedAt(t, w, "cal", time.Minute)
	w.DecidedOnTime("cal", idle, sweeps)

	// Two sweepers; kill the active one; the standby suspends, once.
	s2 := w.Sweeper("sw-b", nil)
	sweeps["sw-b"] = testenv.FollowSweeps(t, s2)
	active, standby := s1, s2
	if m, _ := s2.Metric("aaas_sweeper_leader"); strings.HasSuffix(m, " 1") {
		active, standby = s2, s1
	}
	testenv.NewClient(t, edge.URL).Signup("eli", "")
	active.Kill()
	suspendedAt(t, w, "eli", time.Minute)
	w.DecidedOnTime("eli", idle, sweeps)
	if d, _ := w.Decision("eli"); d.Source != standby.Env["INSTANCE_ID"] {
		t.Fatalf("eli's suspend decided by %s, not the standby %s", d.Source, standby.Env["INSTANCE_ID"])
	}
	if m, err := standby.Metric("aaas_sweeper_leader"); err != nil || !strings.HasSuffix(m, " 1") {
		t.Fatalf("the standby did not take over: %q %v", m, err)
	}
	// Once every command is carried out: one suspension of eli, by the
	// audit trail.
	w.WaitCommandsDone(time.Minute)
	var suspended int
	testutil.Eventually(t, 10*time.Second, func() error {
		suspended = 0
		for _, e := range w.Audit(events.AuditSuspend, "eli") {
			if e.Outcome == "suspended" {
				suspended++
			}
		}
		if suspended == 0 {
			return errors.New("eli's suspension not audited")
		}
		return nil
	})
	if suspended != 1 {
		t.Fatalf("eli suspended %d times", suspended)
	}
}

func TestHandAppliedClaimIsNeverSuspended(t *testing.T) {
	idle := 2 * time.Second
	w := newStack(t, idle)
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	sc, ext, _ := pkg.Cluster.SandboxClients()
	ctx := testenv.Context(t, time.Minute)
	if _, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Create(ctx, &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "dsh-zoe"},
		Spec:       extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var name string
	testutil.Eventually(t, 30*time.Second, func() error {
		c, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(ctx, "dsh-zoe", metav1.GetOptions{})
		if err != nil || c.Status.SandboxStatus.Name == "" {
			return errors.New("not adopted")
		}
		name = c.Status.SandboxStatus.Name
		return nil
	})
	// The control, in the same window: a sandbox of the gateway's own,
	// Ready after zoe's and as idle, is suspended; by then every command
	// the sweeper issued has been carried out.
	testenv.NewClient(t, edge.URL).Signup("ctl", "")
	suspendedAt(t, w, "ctl", time.Minute)
	w.WaitCommandsDone(time.Minute)
	sb, err := sc.AgentsV1beta1().Sandboxes(w.NS.Name).Get(ctx, name, metav1.GetOptions{})
	if err != nil || sb.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeSuspended {
		t.Fatalf("hand-applied sandbox: %v %v", sb.Spec.OperatingMode, err)
	}
	if a := w.Audit(events.AuditSuspend, "zoe"); len(a) != 0 {
		t.Fatalf("the sweeper decided about the hand-applied claim: %+v", a)
	}
}

func TestActivityAfterTheDecisionCancelsTheSuspend(t *testing.T) {
	w := newStack(t, 3*time.Second)
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("fin", "")
	if r := c.Do("GET", "/u/fin/api/files", nil); r.StatusCode != http.StatusOK { // caches the handshake
		t.Fatalf("first request: %d", r.StatusCode)
	}
	lc := w.Procs[0]
	lc.Stop() // the decision will wait in the queue
	outcomes := func() map[string]int {
		n := map[string]int{}
		for _, a := range w.Audit(events.AuditSuspend, "fin") {
			n[a.Outcome]++
		}
		return n
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if outcomes()["requested"] == 0 {
			return errors.New("no decision yet")
		}
		return nil
	})
	// The evidence the queued decision was made on.
	ctx := testenv.Context(t, time.Minute)
	cmds, err := w.JS.Stream(ctx, events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	m, err := cmds.GetLastMsgForSubject(ctx, events.CommandSubject(events.VerbSuspend, "fin"))
	if err != nil {
		t.Fatal(err)
	}
	decision, err := events.Decode[events.Command](m.Data)
	if err != nil {
		t.Fatal(err)
	}
	// The user comes back before lifecycle acts on the decision, and the
	// edge's beacon of it lands; a socket kept open keeps fin busy from
	// then on, so no later decision follows.
	if r := c.Do("GET", "/u/fin/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("request while the suspend is queued: %d", r.StatusCode)
	}
	ws, _, err := (&websocket.Dialer{}).Dial(strings.Replace(edge.URL, "http", "ws", 1)+"/u/fin/api/ws",
		http.Header{"Cookie": {"dsh_gw_session=" + c.Cookie("dsh_gw_session").Value}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	activity, err := w.JS.Stream(ctx, events.StreamActivity)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		m, err := activity.GetLastMsgForSubject(ctx, events.ActivitySubjectUser("fin"))
		if err != nil || m.Sequence <= decision.Suspend.ActivitySeq {
			return fmt.Errorf("no beacon of fin newer than the decision's evidence (%d): %v", decision.Suspend.ActivitySeq, err)
		}
		return nil
	})
	lc.Restart(t)
	lc.WaitReady(t, time.Minute)
	w.WaitCommandsDone(time.Minute)
	testutil.Eventually(t, 10*time.Second, func() error {
		if o := outcomes(); o["cancelled"] != 1 || o["suspended"] != 0 {
			return fmt.Errorf("suspend outcomes %v, want it cancelled", o)
		}
		return nil
	})
	if e, _ := w.Sandboxes().Get("fin"); e.Value.Phase != state.PhaseReady {
		t.Fatalf("phase %s after a cancelled suspend", e.Value.Phase)
	}
}
