// Package idle tests idle suspension end to end: edges, lifecycle and
// sweepers as real processes against devcluster.
package idle_test

import (
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

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
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

// staysReady fails if user's sandbox leaves Ready during d.
func staysReady(t *testing.T, s *testenv.Stack, user string, d time.Duration) {
	t.Helper()
	e, _, err := s.Sandboxes().Wait(testenv.Context(t, d), user, func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase != state.PhaseReady })
	if err == nil {
		t.Fatalf("%s became %s", user, e.Value.Phase)
	}
}

func within(t *testing.T, what string, got, lo, hi time.Duration) {
	t.Helper()
	t.Logf("%s after %s (expected %s..%s)", what, got.Round(10*time.Millisecond), lo, hi)
	if got < lo || got > hi {
		t.Fatalf("%s after %s, want between %s and %s", what, got, lo, hi)
	}
}

func TestIdleSandboxIsSuspendedAndWakesWithItsState(t *testing.T) {
	idle := 4 * time.Second
	w := newStack(t, idle)
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("ann", "")
	if r := c.Do("PUT", "/u/ann/api/files/keep.txt", strings.NewReader("kept")); r.StatusCode != http.StatusCreated {
		t.Fatalf("upload %d", r.StatusCode)
	}
	if r := c.Do("POST", "/u/ann/api/chat", strings.NewReader(`{"message":"remember me"}`), "Content-Type", "application/json"); r.StatusCode != http.StatusOK {
		t.Fatalf("chat %d", r.StatusCode)
	}
	last := time.Now()
	within(t, "suspended", suspendedAt(t, w, "ann", time.Minute).Sub(last), idle-500*time.Millisecond, idle+4*time.Second)

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
	w.Sweeper("sw-a", nil)
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
	// Silent for three idle timeouts; edge B sees nothing from bo at all.
	staysReady(t, w, "bo", 3*idle)
	killed := time.Now()
	a.Kill()
	within(t, "suspended after the edge died", suspendedAt(t, w, "bo", time.Minute).Sub(killed), 0, idle+3*time.Second+3*time.Second)
}

func TestSweeperRestartAndFailover(t *testing.T) {
	idle := 6 * time.Second
	w := newStack(t, idle)
	s1 := w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	// Restart at half the idle time: the clock is rebuilt, not restarted
	// (which would suspend at 1.5 idle timeouts).
	c := testenv.NewClient(t, edge.URL)
	c.Signup("cal", "")
	if r := c.Do("GET", "/u/cal/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("request: %d", r.StatusCode)
	}
	last := time.Now()
	time.Sleep(idle / 2)
	s1.Stop()
	s1.Restart(t)
	s1.WaitReady(t, time.Minute)
	within(t, "suspended across a sweeper restart", suspendedAt(t, w, "cal", time.Minute).Sub(last), idle-500*time.Millisecond, idle+2500*time.Millisecond)

	// Two sweepers; kill the active one; the standby suspends, once.
	s2 := w.Sweeper("sw-b", nil)
	active, standby := s1, s2
	if m, _ := s2.Metric("aaas_sweeper_leader"); strings.HasSuffix(m, " 1") {
		active, standby = s2, s1
	}
	testenv.NewClient(t, edge.URL).Signup("eli", "")
	active.Kill()
	suspendedAt(t, w, "eli", time.Minute)
	if m, err := standby.Metric("aaas_sweeper_leader"); err != nil || !strings.HasSuffix(m, " 1") {
		t.Fatalf("the standby did not take over: %q %v", m, err)
	}
	lc := w.Procs[0]
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := strings.Count(lc.Logs(), `"verb":"suspend","user":"eli","outcome":"suspended"`); n != 1 {
			return fmt.Errorf("%d suspends of eli", n)
		}
		return nil
	})
}

func TestHandAppliedClaimIsNeverSuspended(t *testing.T) {
	idle := 2 * time.Second
	w := newStack(t, idle)
	w.Sweeper("sw-a", nil)
	_, ext, _ := pkg.Cluster.SandboxClients()
	sc, _, _ := pkg.Cluster.SandboxClients()
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
	time.Sleep(4 * idle)
	sb, err := sc.AgentsV1beta1().Sandboxes(w.NS.Name).Get(ctx, name, metav1.GetOptions{})
	if err != nil || sb.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeSuspended {
		t.Fatalf("hand-applied sandbox: %v %v", sb.Spec.OperatingMode, err)
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
	audit := func() string {
		s, _ := w.JS.Stream(testenv.Context(t, time.Minute), events.StreamAudit)
		m, err := s.GetLastMsgForSubject(testenv.Context(t, time.Minute), events.AuditSubject(events.AuditSuspend, "fin"))
		if err != nil {
			return ""
		}
		return string(m.Data)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if !strings.Contains(audit(), `"outcome":"requested"`) {
			return errors.New("no decision yet")
		}
		return nil
	})
	// The user comes back before lifecycle acts on the decision.
	if r := c.Do("GET", "/u/fin/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("request while the suspend is queued: %d", r.StatusCode)
	}
	time.Sleep(1500 * time.Millisecond) // let the beacon land
	lc.Restart(t)
	lc.WaitReady(t, time.Minute)
	testutil.Eventually(t, 30*time.Second, func() error {
		if !strings.Contains(audit(), `"outcome":"cancelled"`) {
			return fmt.Errorf("suspend not cancelled: %s", audit())
		}
		return nil
	})
	if e, _ := w.Sandboxes().Get("fin"); e.Value.Phase != state.PhaseReady {
		t.Fatalf("phase %s after a cancelled suspend", e.Value.Phase)
	}
}
