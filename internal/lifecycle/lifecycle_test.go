package lifecycle_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

// fixture is one test's world: a testenv stack (its own NATS and
// namespace with the production lifecycle Role) plus typed views of KV.
type fixture struct {
	*testenv.Stack
	t          testing.TB
	pub        *events.Publisher
	sealer     *handshake.Sealer
	sandboxes  *kv.Bucket[state.Sandbox]
	users      *kv.Bucket[state.User]
	sessions   *kv.Bucket[state.Session]
	handshakes *kv.Bucket[state.Handshake]
	requests   *kv.Bucket[state.Result]
	boxes      *kv.Cache[state.Sandbox]
	// readyIn is how long a fresh worker took to become ready (rbac_test).
	readyIn time.Duration
}

// setup makes a fixture on a fresh stack, or on stack[0] when given (made
// with the options a test needs; mutate is then ignored).
func setup(t testing.TB, mutate func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool), stack ...*testenv.Stack) *fixture {
	t.Helper()
	var st *testenv.Stack
	if len(stack) > 0 {
		st = stack[0]
	} else {
		st = pkg.NewStack(t, testenv.StackOptions{Sandbox: mutate})
	}
	ctx := testenv.Context(t, 5*time.Minute)
	f := &fixture{Stack: st, t: t, pub: events.NewPublisher(st.JS, "test", testenv.Logger())}
	k, _ := handshake.ParseKey(st.Key)
	f.sealer, _ = handshake.NewSealer(k)
	f.sandboxes = must(kv.Open[state.Sandbox](ctx, st.JS, state.BucketSandboxes))
	f.users = must(kv.Open[state.User](ctx, st.JS, state.BucketUsers))
	f.sessions = must(kv.Open[state.Session](ctx, st.JS, state.BucketSessions))
	f.handshakes = must(kv.Open[state.Handshake](ctx, st.JS, state.BucketHandshakes))
	f.requests = must(kv.Open[state.Result](ctx, st.JS, state.BucketRequests))
	f.boxes = st.Sandboxes()
	return f
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// lifecycle starts a lifecycle process that authenticates as the
// manifests' ServiceAccount.
func (f *fixture) lifecycle(id string) *testenv.Proc { return f.Lifecycle(id) }

func ctx(t testing.TB) context.Context { return testenv.Context(t, 3*time.Minute) }

func tokenHash() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// command publishes c and, when it carries a request id, waits for the
// answer.
func (f *fixture) command(c events.Command) state.Result {
	f.t.Helper()
	if _, err := f.pub.Command(ctx(f.t), c); err != nil {
		f.t.Fatal(err)
	}
	if c.RequestID == "" {
		return state.Result{}
	}
	var res state.Result
	testutil.Eventually(f.t, 60*time.Second, func() error {
		e, err := f.requests.Get(ctx(f.t), c.RequestID)
		res = e.Value
		return err
	})
	return res
}

func (f *fixture) signup(user string) string {
	f.t.Helper()
	hash := tokenHash()
	if res := f.command(events.NewClaim(user, "req-"+user+"-"+hash[:8], hash, "")); res.Outcome != state.OutcomeCreated {
		f.t.Fatalf("claim %s: %+v", user, res)
	}
	f.waitPhase(user, state.PhaseReady)
	return hash
}

func (f *fixture) waitPhase(user string, phase state.Phase) state.Sandbox {
	f.t.Helper()
	e, _, err := f.boxes.Wait(testenv.Context(f.t, 90*time.Second), user, func(e kv.Entry[state.Sandbox], ok bool) bool {
		return ok && e.Value.Phase == phase
	})
	if err != nil {
		f.t.Fatalf("%s never reached %s (last %+v)", user, phase, e.Value)
	}
	return e.Value
}

func (f *fixture) claims() []extv1beta1.SandboxClaim {
	_, ext, _ := pkg.Cluster.SandboxClients()
	l, err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).List(ctx(f.t), metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return l.Items
}

// handshake asks for a cookie for the user's current pod and returns it
// unsealed, or the recorded failure.
func (f *fixture) handshake(user, host string, stale uint64) (string, string) {
	f.t.Helper()
	box, _ := f.boxes.Get(user)
	f.command(events.NewHandshake(user, events.HandshakeArgs{PodUID: box.Value.PodUID, Host: host, Proto: "http", StaleRevision: stale}))
	key := state.HandshakeKey(user, box.Value.PodUID, host)
	var hs kv.Entry[state.Handshake]
	testutil.Eventually(f.t, 30*time.Second, func() error {
		var err error
		hs, err = f.handshakes.Get(ctx(f.t), key)
		if err == nil && hs.Revision <= stale {
			return errors.New("old record")
		}
		return err
	})
	if hs.Value.Error != "" {
		return "", hs.Value.Error
	}
	cookie, err := f.sealer.Open(hs.Value.Sealed, []byte(key))
	if err != nil {
		f.t.Fatal(err)
	}
	return string(cookie), ""
}

// dsh sends a request straight to the user's pod.
func (f *fixture) dsh(user, method, path, cookie string, body io.Reader) (int, []byte) {
	f.t.Helper()
	box, _ := f.boxes.Get(user)
	req, _ := http.NewRequest(method, "http://"+box.Value.Address+path, body)
	req.Host = "localhost"
	req.Header.Set("Cookie", cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func (f *fixture) lastActivitySeq(user string) uint64 {
	s, _ := f.JS.Stream(ctx(f.t), events.StreamActivity)
	m, err := s.GetLastMsgForSubject(ctx(f.t), events.ActivitySubjectUser(user))
	if err != nil {
		return 0
	}
	return m.Sequence
}

func (f *fixture) beacon(user string) uint64 {
	f.t.Helper()
	now := time.Now()
	fut, err := f.pub.Beacon(events.Beacon{User: user, Edge: "edge-a", InFlight: 0, LastActive: now, SentAt: now, TTL: 10 * time.Second})
	if err != nil {
		f.t.Fatal(err)
	}
	select {
	case ack := <-fut.Ok():
		return ack.Sequence
	case err := <-fut.Err():
		f.t.Fatal(err)
	}
	return 0
}

func TestClaimConflictAndRedelivery(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	hash := f.signup("bob")
	u, err := f.users.Get(ctx(t), "bob")
	if err != nil || u.Value.TokenHash != hash || !u.Value.Managed || u.Value.Claim != "dsh-bob" {
		t.Fatalf("user record = %+v %v", u.Value, err)
	}
	box, _ := f.boxes.Get("bob")
	if box.Value.PodUID == "" || !strings.HasSuffix(box.Value.Address, ":3080") {
		t.Fatalf("sandbox record = %+v", box.Value)
	}

	// Someone else asks for bob.
	if res := f.command(events.NewClaim("bob", "req-other", tokenHash(), "")); res.Outcome != state.OutcomeConflict {
		t.Fatalf("second claim for bob: %+v", res)
	}
	// Our own claim again (what a redelivery carries): created, not conflict.
	if res := f.command(events.NewClaim("bob", "req-again", hash, "")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("redelivered claim: %+v", res)
	}
	if n := len(f.claims()); n != 1 {
		t.Fatalf("%d claims, want exactly one", n)
	}
	c := f.claims()[0]
	if c.Labels["aaas.example.com/managed-by"] != "dsh-gateway" || c.Annotations[sandbox.TokenHashAnnotation] != hash || c.Spec.WarmPoolRef.Name != "dsh-pool" {
		t.Fatalf("claim = %+v", c.ObjectMeta)
	}
}

func TestRedeliveryAfterTheKubernetesWriteIsCreated(t *testing.T) {
	f := setup(t, nil)
	hash := tokenHash()
	// A worker created the claim and died before answering: the claim
	// exists, nothing else does.
	_, ext, _ := pkg.Cluster.SandboxClients()
	_, err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Create(ctx(t), &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "dsh-cara", Labels: map[string]string{"aaas.example.com/managed-by": "dsh-gateway"}, Annotations: map[string]string{sandbox.TokenHashAnnotation: hash}},
		Spec:       extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	f.lifecycle("lc-a")
	if res := f.command(events.NewClaim("cara", "req-cara", hash, "")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("redelivered claim: %+v", res)
	}
	f.waitPhase("cara", state.PhaseReady)
}

func TestSuspendWakeAndHandshake(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	f.signup("dora")
	cookie, failure := f.handshake("dora", "localhost", 0)
	if failure != "" {
		t.Fatal(failure)
	}
	if code, _ := f.dsh("dora", "PUT", "/api/files/keep.txt", cookie, strings.NewReader("kept")); code != http.StatusCreated {
		t.Fatalf("upload: %d", code)
	}
	before, _ := f.boxes.Get("dora")

	f.command(events.NewSuspend("dora", f.lastActivitySeq("dora"), before.Revision, time.Now(), "idle", ""))
	f.waitPhase("dora", state.PhaseSuspended)
	// A suspend reads as one, even when the mirror sees the pod go before
	// the sandbox's suspend (separate watches): it never passes through
	// Waking, as a pod lost while running does.
	testutil.Eventually(t, 10*time.Second, func() error {
		var went []string
		for _, e := range f.auditEvents(events.AuditStateChange) {
			if e.User == "dora" && e.At.After(before.Value.ReadySince) {
				went = append(went, e.Outcome)
			}
		}
		if len(went) == 0 || went[len(went)-1] != string(state.PhaseSuspended) {
			return fmt.Errorf("dora's state changes since Ready: %v, not yet Suspended", went)
		}
		if slices.Contains(went, string(state.PhaseWaking)) {
			t.Fatalf("dora's suspend went %v", went)
		}
		return nil
	})
	testutil.Eventually(t, 10*time.Second, func() error {
		keys, err := f.handshakes.Keys(ctx(t), "dora.>")
		if err != nil || len(keys) != 0 {
			return fmt.Errorf("handshakes left: %v %v", keys, err)
		}
		return nil
	})

	susp, _ := f.boxes.Get("dora")
	f.command(events.NewWake("dora", susp.Revision))
	after := f.waitPhase("dora", state.PhaseReady)
	if after.PodUID == before.Value.PodUID || after.PodUID == "" {
		t.Fatalf("pod UID after wake %q, before %q", after.PodUID, before.Value.PodUID)
	}
	cookie, failure = f.handshake("dora", "localhost", 0)
	if failure != "" {
		t.Fatal(failure)
	}
	if code, body := f.dsh("dora", "GET", "/api/files/keep.txt", cookie, nil); code != http.StatusOK || string(body) != "kept" {
		t.Fatalf("file after wake: %d %q", code, body)
	}
}

func TestCompareAndSuspendRefusesWhenActivityIsNewer(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	f.signup("emil")
	decided := f.beacon("emil")
	box, _ := f.boxes.Get("emil")
	f.beacon("emil") // the user came back after the sweeper decided
	f.command(events.NewSuspend("emil", decided, box.Revision, time.Now(), "idle", ""))
	// The command is handled (the queue drains) and nothing changes.
	testutil.Eventually(t, 20*time.Second, func() error {
		s, _ := f.JS.Stream(ctx(t), events.StreamCommands)
		info, err := s.Info(ctx(t))
		if err != nil || info.State.Msgs != 0 {
			return fmt.Errorf("queue not drained: %v", err)
		}
		return nil
	})
	sc, _, _ := pkg.Cluster.SandboxClients()
	sb, err := sc.AgentsV1beta1().Sandboxes(f.NS.Name).Get(ctx(t), box.Value.Sandbox, metav1.GetOptions{})
	if err != nil || sb.Spec.OperatingMode != sandboxv1beta1.SandboxOperatingModeRunning {
		t.Fatalf("sandbox mode after a cancelled suspend: %v %v", sb.Spec.OperatingMode, err)
	}
	if b, _ := f.boxes.Get("emil"); b.Value.Phase != state.PhaseReady {
		t.Fatalf("phase = %s", b.Value.Phase)
	}
	// With no newer activity the same decision goes through.
	f.command(events.NewSuspend("emil", f.lastActivitySeq("emil"), box.Revision+1, time.Now(), "idle", ""))
	f.waitPhase("emil", state.PhaseSuspended)
}

func TestUnmanagedClaimIsNeverSuspendedOrTaken(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	f.signup("ctl") // managed: the control suspended in the same window
	_, ext, _ := pkg.Cluster.SandboxClients()
	sc, _, _ := pkg.Cluster.SandboxClients()
	// An operator applies dsh-alice by hand, without our label.
	if _, err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Create(ctx(t), &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "dsh-alice"},
		Spec:       extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var sbName string
	testutil.Eventually(t, 30*time.Second, func() error {
		c, err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Get(ctx(t), "dsh-alice", metav1.GetOptions{})
		if err != nil || c.Status.SandboxStatus.Name == "" {
			return fmt.Errorf("not adopted yet: %v", err)
		}
		sbName = c.Status.SandboxStatus.Name
		return nil
	})
	ctl, _ := f.boxes.Get("ctl")
	f.command(events.NewSuspend("alice", 1<<40, 1, time.Now(), "idle", ""))
	f.command(events.NewSuspend("alice", 1<<40, 2, time.Now(), "idle", ""))
	f.command(events.NewSuspend("ctl", f.lastActivitySeq("ctl"), ctl.Revision, time.Now(), "idle", ""))
	f.waitPhase("ctl", state.PhaseSuspended)
	f.drained(t) // alice's suspends were handled, not left waiting
	if res := f.command(events.NewClaim("alice", "req-alice", tokenHash(), "")); res.Outcome != state.OutcomeConflict {
		t.Fatalf("signup as alice: %+v", res)
	}
	sb, err := sc.AgentsV1beta1().Sandboxes(f.NS.Name).Get(ctx(t), sbName, metav1.GetOptions{})
	if err != nil || sb.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeSuspended {
		t.Fatalf("hand-applied sandbox mode %q (%v)", sb.Spec.OperatingMode, err)
	}
	if _, err := f.users.Get(ctx(t), "alice"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("unmanaged claim became an account: %v", err)
	}
	if res := f.command(events.NewDelete("alice", "req-del-alice")); res.Outcome != state.OutcomeFailed {
		t.Fatalf("delete of an unmanaged claim: %+v", res)
	}
	if _, err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Get(ctx(t), "dsh-alice", metav1.GetOptions{}); err != nil {
		t.Fatalf("hand-applied claim was deleted: %v", err)
	}
}

func TestKilledWorkerMidClaimAndMidWakeIsFinishedByAnother(t *testing.T) {
	// Every lifecycle's Kubernetes API traffic goes through a fault link,
	// so a worker can be cut off from the API server with a command in
	// hand: it is then surely in the middle of it when it is killed.
	st := pkg.NewStack(t, testenv.StackOptions{Faults: true})
	f := setup(t, nil, st)
	a := f.lifecycle("lc-a")
	f.Faults.Blackhole("kube-lc-a")
	hash := tokenHash()
	if _, err := f.pub.Command(ctx(t), events.NewClaim("finn", "req-finn", hash, "")); err != nil {
		t.Fatal(err)
	}
	f.takenNotDone(t)
	a.Kill()
	b := f.lifecycle("lc-b")
	testutil.Eventually(t, 60*time.Second, func() error {
		e, err := f.requests.Get(ctx(t), "req-finn")
		if err != nil {
			return err
		}
		if e.Value.Outcome != state.OutcomeCreated {
			return fmt.Errorf("outcome %s", e.Value.Outcome)
		}
		return nil
	})
	// b finished it from a redelivery of the message a held.
	if v := metric(b, `aaas_lifecycle_commands_redelivered_total{verb="claim"}`); v < 1 {
		t.Fatalf("b took up %v claims from a redelivery, want the one a held", v)
	}
	f.waitPhase("finn", state.PhaseReady)
	if n := len(f.claims()); n != 1 {
		t.Fatalf("%d claims after the crash, want 1", n)
	}

	// Now a wake, with b killed as it takes it and a third replica left.
	box, _ := f.boxes.Get("finn")
	f.command(events.NewSuspend("finn", f.lastActivitySeq("finn"), box.Revision, time.Now(), "idle", ""))
	f.waitPhase("finn", state.PhaseSuspended)
	f.drained(t)
	f.Faults.Blackhole("kube-lc-b")
	susp, _ := f.boxes.Get("finn")
	if _, err := f.pub.Command(ctx(t), events.NewWake("finn", susp.Revision)); err != nil {
		t.Fatal(err)
	}
	f.takenNotDone(t)
	b.Kill()
	c := f.lifecycle("lc-c")
	ready := f.waitPhase("finn", state.PhaseReady)
	if v := metric(c, `aaas_lifecycle_commands_redelivered_total{verb="wake"}`); v < 1 {
		t.Fatalf("c took up %v wakes from a redelivery, want the one b held", v)
	}

	// KV matches the cluster.
	claims := f.claims()
	if len(claims) != 1 {
		t.Fatalf("%d claims", len(claims))
	}
	pod, err := pkg.Cluster.Client.CoreV1().Pods(f.NS.Name).Get(ctx(t), ready.PodName, metav1.GetOptions{})
	if err != nil || string(pod.UID) != ready.PodUID || pod.Status.PodIP+":3080" != ready.Address {
		t.Fatalf("KV %+v does not match pod %v (%v)", ready, pod.UID, err)
	}
}

// takenNotDone waits until the one command published last has been
// delivered to a worker and not acknowledged.
func (f *fixture) takenNotDone(t *testing.T) {
	t.Helper()
	testutil.Eventually(t, 20*time.Second, func() error {
		c, err := f.JS.Consumer(ctx(t), events.StreamCommands, events.CommandConsumer)
		if err != nil {
			return err
		}
		if i := c.CachedInfo(); i.NumPending != 0 || i.NumAckPending != 1 {
			return fmt.Errorf("consumer: %d pending, %d awaiting an ack; want the command taken", i.NumPending, i.NumAckPending)
		}
		return nil
	})
}

func TestTokenRotationAndMissingToken(t *testing.T) {
	f := setup(t, nil)
	lc := f.lifecycle("lc-a")
	f.signup("gina")
	cookie, failure := f.handshake("gina", "localhost", 0)
	if failure != "" {
		t.Fatal(failure)
	}
	box, _ := f.boxes.Get("gina")
	if err := pkg.Cluster.Node.Signal(f.NS.Name, box.Value.PodName, "dsh", syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if code, _ := f.dsh("gina", "GET", "/api/files", cookie, nil); code != http.StatusUnauthorized {
			return fmt.Errorf("old cookie still accepted (%d)", code)
		}
		return nil
	})
	key := state.HandshakeKey("gina", box.Value.PodUID, "localhost")
	old, _ := f.handshakes.Get(ctx(t), key)
	fresh, failure := f.handshake("gina", "localhost", old.Revision)
	if failure != "" || fresh == cookie {
		t.Fatalf("refresh: %q %q", fresh, failure)
	}
	if code, _ := f.dsh("gina", "GET", "/api/files", fresh, nil); code != http.StatusOK {
		t.Fatalf("fresh cookie: %d", code)
	}
	secrets := []string{cookie, fresh, strings.SplitN(cookie, "=", 2)[1], strings.SplitN(fresh, "=", 2)[1]}
	secrets = append(secrets, podTokens(t, f.NS.Name, box.Value.PodName)...)
	assertNoSecrets(t, f, []*testenv.Proc{lc}, secrets)
}

func podTokens(t *testing.T, ns, pod string) []string {
	b, err := pkg.Cluster.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{}).DoRaw(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	var toks []string
	for _, line := range strings.Split(string(b), "\n") {
		if tok, err := handshake.TokenFromLog([]byte(line)); err == nil {
			toks = append(toks, tok)
		}
	}
	if len(toks) < 2 {
		t.Fatalf("expected a rotated token in the pod log, found %d", len(toks))
	}
	return toks
}

// assertNoSecrets greps process output and the whole audit stream.
func assertNoSecrets(t *testing.T, f *fixture, procs []*testenv.Proc, secrets []string) {
	t.Helper()
	audit := f.AuditLog()
	if audit == "" {
		t.Fatal("no audit events at all")
	}
	for _, sec := range secrets {
		if len(sec) < 8 {
			t.Fatalf("secret %q too short to grep for", sec)
		}
		for _, p := range procs {
			if strings.Contains(p.Logs(), sec) {
				t.Errorf("%s logged a secret", p.Name)
			}
		}
		if strings.Contains(audit, sec) {
			t.Errorf("audit stream holds a secret")
		}
	}
}

func TestNoTokenLineIsARecordedFailure(t *testing.T) {
	f := setup(t, func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		c.Env = append(c.Env, corev1.EnvVar{Name: "DSHSIM_NO_TOKEN", Value: "1"})
	})
	f.lifecycle("lc-a")
	f.signup("hugo")
	_, failure := f.handshake("hugo", "localhost", 0)
	if failure != "missing launch token" {
		t.Fatalf("failure = %q", failure)
	}
}

func TestDeleteRemovesEverything(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	f.signup("ivan")
	if _, err := f.sessions.Put(ctx(t), state.SessionKey("ivan", "abc"), state.Session{User: "ivan"}); err != nil {
		t.Fatal(err)
	}
	f.handshake("ivan", "localhost", 0)
	if res := f.command(events.NewDelete("ivan", "req-del")); res.Outcome != state.OutcomeDeleted {
		t.Fatalf("delete: %+v", res)
	}
	for name, err := range map[string]error{
		"user":    getErr(f.users.Get(ctx(t), "ivan")),
		"sandbox": getErr(f.sandboxes.Get(ctx(t), "ivan")),
		"session": getErr(f.sessions.Get(ctx(t), state.SessionKey("ivan", "abc"))),
	} {
		if !errors.Is(err, kv.ErrNotFound) {
			t.Errorf("%s record after delete: %v", name, err)
		}
	}
	if keys, _ := f.handshakes.Keys(ctx(t), "ivan.>"); len(keys) != 0 {
		t.Errorf("handshakes after delete: %v", keys)
	}
	testutil.Eventually(t, 60*time.Second, func() error {
		if n := len(f.claims()); n != 0 {
			return fmt.Errorf("%d claims", n)
		}
		return nil
	})
	// Deleting again is fine (a redelivery).
	if res := f.command(events.NewDelete("ivan", "req-del-2")); res.Outcome != state.OutcomeDeleted {
		t.Fatalf("second delete: %+v", res)
	}
}

func getErr[T any](_ T, err error) error { return err }

func TestRecreateGivesAFreshVolumeUnderTheSameAccount(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	hash := f.signup("jane")
	cookie, _ := f.handshake("jane", "localhost", 0)
	if code, _ := f.dsh("jane", "PUT", "/api/files/old.txt", cookie, strings.NewReader("old")); code != http.StatusCreated {
		t.Fatalf("upload %d", code)
	}
	if _, err := f.sessions.Put(ctx(t), state.SessionKey("jane", "s1"), state.Session{User: "jane"}); err != nil {
		t.Fatal(err)
	}
	before, _ := f.boxes.Get("jane")
	oldClaim := f.claims()[0]

	if res := f.command(events.NewRecreate("jane", "req-re", "")); res.Outcome != state.OutcomeRecreated {
		t.Fatalf("recreate: %+v", res)
	}
	// The old claim and its sandbox were gone before the new claim came.
	claims := f.claims()
	if len(claims) != 1 || claims[0].UID == oldClaim.UID || claims[0].Annotations[sandbox.TokenHashAnnotation] != hash {
		t.Fatalf("claims after recreate: %+v", claims)
	}
	sc, _, _ := pkg.Cluster.SandboxClients()
	if _, err := sc.AgentsV1beta1().Sandboxes(f.NS.Name).Get(ctx(t), before.Value.Sandbox, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("old sandbox still there: %v", err)
	}
	after := f.waitPhase("jane", state.PhaseReady)
	if after.Sandbox == before.Value.Sandbox {
		t.Fatal("same sandbox after recreate")
	}
	if _, err := f.sessions.Get(ctx(t), state.SessionKey("jane", "s1")); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("session survived recreate: %v", err)
	}
	u, err := f.users.Get(ctx(t), "jane")
	if err != nil || u.Value.TokenHash != hash || !u.Value.RecreatingSince.IsZero() || u.Value.ClaimUID != string(claims[0].UID) {
		t.Fatalf("user after recreate: %+v %v", u.Value, err)
	}
	cookie, _ = f.handshake("jane", "localhost", 0)
	if code, _ := f.dsh("jane", "GET", "/api/files/old.txt", cookie, nil); code != http.StatusNotFound {
		t.Fatalf("old file after recreate: %d", code)
	}
}

func TestClaimDeletedOutsideTheGatewayRemovesTheUser(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	f.signup("kim")
	if _, err := f.sessions.Put(ctx(t), state.SessionKey("kim", "s"), state.Session{User: "kim"}); err != nil {
		t.Fatal(err)
	}
	_, ext, _ := pkg.Cluster.SandboxClients()
	if err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Delete(ctx(t), "dsh-kim", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if _, err := f.users.Get(ctx(t), "kim"); !errors.Is(err, kv.ErrNotFound) {
			return fmt.Errorf("user: %v", err)
		}
		if _, err := f.sessions.Get(ctx(t), state.SessionKey("kim", "s")); !errors.Is(err, kv.ErrNotFound) {
			return fmt.Errorf("session: %v", err)
		}
		return nil
	})
}

func TestMirrorFailsOverToAnotherReplica(t *testing.T) {
	f := setup(t, nil)
	a := f.lifecycle("lc-a")
	testutil.Eventually(t, 10*time.Second, func() error {
		m, err := a.Metric("aaas_lifecycle_mirror_leader")
		if err != nil || !strings.HasSuffix(m, " 1") {
			return fmt.Errorf("a is not leading: %q %v", m, err)
		}
		return nil
	})
	b := f.lifecycle("lc-b")
	a.Kill()
	testutil.Eventually(t, 15*time.Second, func() error {
		m, err := b.Metric("aaas_lifecycle_mirror_leader")
		if err != nil || !strings.HasSuffix(m, " 1") {
			return fmt.Errorf("b is not leading: %q %v", m, err)
		}
		return nil
	})
	f.signup("lena") // Ready in KV means b mirrors
}

// The mirror is level-based on the KV side too: a record that changes
// while nothing changes in Kubernetes (another writer, or the mirror's own
// write brought late by a watch that lagged after a NATS node loss) is
// derived again and set right, not left standing until the next event of
// the user's objects — which for a suspended sandbox may never come.
func TestMirrorSetsRightARecordChangedBehindItsBack(t *testing.T) {
	f := setup(t, nil)
	f.lifecycle("lc-a")
	f.signup("rita")
	ready, _ := f.boxes.Get("rita")
	f.command(events.NewSuspend("rita", f.lastActivitySeq("rita"), ready.Revision, time.Now(), "idle", ""))
	suspended := f.waitPhase("rita", state.PhaseSuspended)
	// The pod's last events are over: it is gone from the API server.
	testutil.Eventually(t, 30*time.Second, func() error {
		_, err := pkg.Cluster.Client.CoreV1().Pods(f.NS.Name).Get(ctx(t), ready.Value.PodName, metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("pod %s still there: %v", ready.Value.PodName, err)
		}
		return nil
	})
	wrong := ready.Value
	wrong.Phase = state.PhaseSuspending
	rev, err := f.sandboxes.Put(ctx(t), "rita", wrong)
	if err != nil {
		t.Fatal(err)
	}
	e, _, err := f.boxes.Wait(testenv.Context(t, 30*time.Second), "rita", func(e kv.Entry[state.Sandbox], ok bool) bool {
		return ok && e.Revision > rev
	})
	if err != nil {
		t.Fatalf("the record written behind the mirror's back stood: %+v", e.Value)
	}
	if e.Value.Phase != state.PhaseSuspended || e.Value.PodUID != "" || e.Value.Sandbox != suspended.Sandbox {
		t.Fatalf("set right to %+v, want it as before: %+v", e.Value, suspended)
	}
}

// Compare-and-suspend reads the idle rule: a keep-awake that holds
// cancels the sweeper's decision; a forced reason (MAX_RUNTIME) is carried
// out despite newer activity, and why is recorded on the Sandbox and in
// the record; a reason this build does not know never forces anything.
func TestSuspendReasonsAndKeepAwake(t *testing.T) {
	f := setup(t, nil)
	lc := f.lifecycle("lc-a")
	f.signup("kai")
	f.signup("fay")
	awake, err := kv.Open[state.KeepAwake](ctx(t), f.JS, state.BucketKeepAwake)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := awake.Put(ctx(t), "kai", state.KeepAwake{Until: time.Now().Add(time.Hour), At: time.Now()}); err != nil {
		t.Fatal(err)
	}
	box, _ := f.boxes.Get("kai")
	f.command(events.NewSuspend("kai", f.lastActivitySeq("kai"), box.Revision, time.Now(), "idle", "it was idle for 15 minutes"))
	decided := f.beacon("fay")
	f.beacon("fay") // fay came back after the decision
	fayBox, _ := f.boxes.Get("fay")
	f.command(events.NewSuspend("fay", decided, fayBox.Revision, time.Now(), "sleepy", "a reason from nowhere"))
	f.drained(t)
	for _, u := range []string{"kai", "fay"} {
		if b, _ := f.boxes.Get(u); b.Value.Phase != state.PhaseReady || b.Value.LastSuspend != nil {
			t.Fatalf("%s after a cancelled suspend: %+v", u, b.Value)
		}
	}
	// The audit is published as the command ends: the last one may still
	// be on its way when the commands are drained.
	testutil.Eventually(t, 10*time.Second, func() error {
		cancelled := map[string]string{}
		for _, a := range f.auditEvents(events.AuditSuspend) {
			if a.Outcome == "cancelled" {
				cancelled[a.User] = a.Detail
			}
		}
		if !strings.Contains(cancelled["kai"], "kept awake until") || !strings.Contains(cancelled["fay"], "newer") {
			return fmt.Errorf("cancellations %v", cancelled)
		}
		return nil
	})

	// The ceiling, with activity newer than its decision: carried out.
	f.beacon("kai")
	box, _ = f.boxes.Get("kai")
	f.command(events.NewSuspend("kai", 1, box.Revision, time.Now(), "max_runtime", "it had been running for 8 hours"))
	got := f.waitPhase("kai", state.PhaseSuspended)
	if ls := got.LastSuspend; ls == nil || ls.Reason != "max_runtime" || ls.Detail != "it had been running for 8 hours" || time.Since(ls.At) > time.Minute {
		t.Fatalf("recorded suspend %+v", got.LastSuspend)
	}
	sc, _, _ := pkg.Cluster.SandboxClients()
	sb, err := sc.AgentsV1beta1().Sandboxes(f.NS.Name).Get(ctx(t), got.Sandbox, metav1.GetOptions{})
	if err != nil || !strings.Contains(sb.Annotations["aaas.example.com/last-suspend"], `"reason":"max_runtime"`) {
		t.Fatalf("the Sandbox's annotations %v (%v)", sb.Annotations, err)
	}
	// It wakes, and the record still says why it last slept. Two wakes of
	// one sleep (an edge that saw it Suspending, then Suspended, asks for
	// each revision) wake it once: the second finds it running, however
	// far the cache lags, and one wake is audited.
	asleep, _ := f.boxes.Get("kai")
	woken := `aaas_lifecycle_command_duration_seconds_count{outcome="woken",verb="wake"}`
	running := `aaas_lifecycle_command_duration_seconds_count{outcome="running",verb="wake"}`
	wokenBefore, runningBefore := metric(lc, woken), metric(lc, running)
	f.command(events.NewWake("kai", asleep.Revision))
	f.command(events.NewWake("kai", asleep.Revision+1))
	testutil.Eventually(t, time.Minute, func() error {
		if b, _ := f.boxes.Get("kai"); b.Value.Phase != state.PhaseReady || b.Value.LastSuspend == nil {
			return fmt.Errorf("after the wake: %+v", b.Value)
		}
		return nil
	})
	f.drained(t)
	if w, r := metric(lc, woken), metric(lc, running); w != wokenBefore+1 || r != runningBefore+1 {
		t.Fatalf("two wakes of one sleep: woken %v -> %v, running %v -> %v; want one of each", wokenBefore, w, runningBefore, r)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := len(of(f.auditEvents(events.AuditWake), "kai")); n != 1 {
			return fmt.Errorf("%d wake audits of kai, want 1", n)
		}
		return nil
	})
	// And the record stands still: the mirror does not rewrite a record
	// that keeps a suspend, which each rewrite would enqueue again. The
	// positive control: a wake taken and answered in the same window.
	settled, _ := f.boxes.Get("kai")
	f.command(events.NewWake("kai", settled.Revision))
	f.drained(t)
	if v := metric(lc, running); v != runningBefore+2 {
		t.Fatalf("%s went from %v to %v, want two more", running, runningBefore, v)
	}
	if n := len(of(f.auditEvents(events.AuditWake), "kai")); n != 1 {
		t.Fatalf("a wake of a running sandbox was audited: %d wake audits of kai", n)
	}
	if now, _ := f.boxes.Get("kai"); now.Revision != settled.Revision {
		t.Fatalf("kai's record rewritten with nothing changed: revision %d, then %d", settled.Revision, now.Revision)
	}
}
