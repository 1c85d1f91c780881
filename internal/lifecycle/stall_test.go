package lifecycle_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

func withEnv(name, value string) func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool) {
	return func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		c.Env = append(c.Env, corev1.EnvVar{Name: name, Value: value})
	}
}

// The tenant writes its pod's log: token lines printed after the real one
// cost a few refused tries, never the handshake.
func TestFakeTokenLinesDoNotBreakTheHandshake(t *testing.T) {
	f := setup(t, withEnv("DSHSIM_FAKE_TOKENS", "3"))
	lc := f.lifecycle("lc-a")
	f.signup("ann")
	cookie, failure := f.handshake("ann", "localhost", 0)
	if failure != "" {
		t.Fatalf("handshake failed: %s", failure)
	}
	if code, _ := f.dsh("ann", "GET", "/api/files", cookie, nil); code != 200 {
		t.Fatalf("DSH answered %d with the cookie", code)
	}
	if strings.Count(f.podLog("ann"), "?token=") < 4 {
		t.Fatal("the pod printed no fake token lines; the test proves nothing")
	}
	if v := metric(lc, `aaas_lifecycle_handshake_failures_total`); v != 0 {
		t.Fatalf("refused candidates were counted as failures: %v", v)
	}
}

// A pod that accepts the handshake and never answers is recorded as a
// failure within handshake.Timeout, and the only worker is free again.
func TestSilentDSHFailsTheHandshakeAndFreesTheWorker(t *testing.T) {
	f := setup(t, withEnv("DSHSIM_SILENT_HANDSHAKE", "1"))
	f.Env["COMMAND_WORKERS"] = "1"
	f.lifecycle("lc-a")
	f.signup("bea")
	start := time.Now()
	_, failure := f.handshake("bea", "localhost", 0)
	took := time.Since(start)
	if failure == "" || !strings.Contains(failure, "unreachable") {
		t.Fatalf("handshake with a silent pod: %q", failure)
	}
	if took > handshake.Timeout+5*time.Second {
		t.Fatalf("the silent pod held the worker %s", took)
	}
	t.Logf("silent pod: handshake failed after %s", took.Round(time.Millisecond))
	// The single worker takes the next command.
	f.signup("cid")
}

// A handshake for a pod this replica's cache does not show goes back to
// the queue instead of holding a worker while it waits (architecture
// review: it slept up to 3 s in the handler): with one worker, another
// user's signup is answered between its deliveries, and after its last
// wait it is recorded as a changed pod.
func TestAHandshakeForAnUnseenPodDoesNotHoldAWorker(t *testing.T) {
	f := setup(t, nil)
	f.Env["COMMAND_WORKERS"] = "1"
	lc := f.lifecycle("lc-a")
	f.signup("ann")
	const ghost = "00000000-0000-0000-0000-000000000001"
	if _, err := f.pub.Command(ctx(t), events.NewHandshake("ann", events.HandshakeArgs{PodUID: ghost, Host: "localhost", Proto: "http"})); err != nil {
		t.Fatal(err)
	}
	later := `aaas_lifecycle_command_duration_seconds_count{outcome="later",verb="handshake"}`
	testutil.Eventually(t, 30*time.Second, func() error {
		if metric(lc, later) == 0 {
			return errors.New("the handshake was not handed back")
		}
		return nil
	})
	if res := f.command(events.NewClaim("dan", "req-dan", tokenHash(), "")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("dan's signup: %+v", res)
	}
	answered, err := f.requests.Get(ctx(t), "req-dan")
	if err != nil {
		t.Fatal(err)
	}
	var failed kv.Entry[state.Handshake]
	testutil.Eventually(t, 30*time.Second, func() error {
		failed, err = f.handshakes.Get(ctx(t), state.HandshakeKey("ann", ghost, "localhost"))
		return err
	})
	if !strings.Contains(failed.Value.Error, "changed or stopped") {
		t.Fatalf("the handshake for a pod that never came ended with %q", failed.Value.Error)
	}
	if !answered.Value.At.Before(failed.Value.At) {
		t.Fatalf("dan was answered at %s, after the handshake gave up (%s): it held the worker", answered.Value.At, failed.Value.At)
	}
	if v := metric(lc, later); v != 3 {
		t.Fatalf("%s = %v, want 3 hand-backs before giving up", later, v)
	}
}

// One user's commands hold at most one worker: while a long command of
// ann's runs, her next ones go back to the queue (counted as busy), and
// another user's command is done at once.
func TestOneUsersCommandsHoldOneWorker(t *testing.T) {
	f := setup(t, withEnv("DSHSIM_SILENT_HANDSHAKE", "1"))
	f.Env["COMMAND_WORKERS"] = "2"
	lc := f.lifecycle("lc-a")
	f.signup("ann")
	box, _ := f.boxes.Get("ann")
	// Two long handshakes for ann (different hosts DSH trusts, so that the
	// silent pod holds each until the exchange times out), then wakes:
	// before, each parked a worker on her lock.
	hosts := []string{"localhost", "127.0.0.1"}
	for _, host := range hosts {
		if _, err := f.pub.Command(ctx(t), events.NewHandshake("ann", events.HandshakeArgs{PodUID: box.Value.PodUID, Host: host, Proto: "http"})); err != nil {
			t.Fatal(err)
		}
	}
	for i := uint64(1); i <= 4; i++ {
		if _, err := f.pub.Command(ctx(t), events.NewWake("ann", 1000+i)); err != nil {
			t.Fatal(err)
		}
	}
	hash := tokenHash()
	if res := f.command(events.NewClaim("dan", "req-dan", hash, "")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("dan's signup: %+v", res)
	}
	answered, err := f.requests.Get(ctx(t), "req-dan")
	if err != nil {
		t.Fatal(err)
	}
	// Dan was answered while ann's first long handshake still held its
	// worker: it ends (with a failure record) only when the silent pod's
	// exchange times out.
	var ended time.Time
	testutil.Eventually(t, time.Minute, func() error {
		for _, host := range hosts {
			e, err := f.handshakes.Get(ctx(t), state.HandshakeKey("ann", box.Value.PodUID, host))
			if err == nil && e.Value.Error != "" && (ended.IsZero() || e.Value.At.Before(ended)) {
				if !strings.Contains(e.Value.Error, "unreachable") && !strings.Contains(e.Value.Error, "too many handshakes") {
					t.Fatalf("ann's handshake for %s ended with %q, not held by the silent pod", host, e.Value.Error)
				}
				ended = e.Value.At
			}
		}
		if ended.IsZero() {
			return errors.New("no handshake of ann has ended yet")
		}
		return nil
	})
	if !answered.Value.At.Before(ended) {
		t.Fatalf("dan was answered at %s, after ann's first handshake ended (%s)", answered.Value.At, ended)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if v := metric(lc, `aaas_lifecycle_command_duration_seconds_count{outcome="busy",verb="wake"}`); v == 0 {
			return errors.New("no wake of ann was handed back as busy")
		}
		return nil
	})
}

// Security review S5: a pod that prints fake token lines and answers each
// exchange with 401 after 9 s (just inside the exchange's timeout) made one
// handshake hold a worker for minutes. Now the whole command, every
// candidate and the re-read of the log included, ends within
// HANDSHAKE_TIMEOUT, with a failure that says so.
func TestHostilePodsHandshakeEndsWithinHandshakeTimeout(t *testing.T) {
	const timeout = 15 * time.Second
	f := setup(t, hostilePods)
	f.Env["HANDSHAKE_TIMEOUT"] = timeout.String()
	lc := f.lifecycle("lc-a")
	f.signup("hal")
	_, failure := f.handshake("hal", "localhost", 0)
	if !strings.Contains(failure, "HANDSHAKE_TIMEOUT "+timeout.String()) {
		t.Fatalf("handshake with a hostile pod: %q", failure)
	}
	took := metric(lc, `aaas_lifecycle_command_duration_seconds_sum{outcome="failed",verb="handshake"}`)
	// At least one 9 s refusal was waited for (the pod did hold it), and the
	// command ended at the deadline: before, it took 9 s per candidate,
	// nine candidates, twice.
	if took < 9 || took > (timeout+3*time.Second).Seconds() {
		t.Fatalf("the hostile handshake took %.1fs, want 9s..%s", took, timeout+3*time.Second)
	}
	if v := metric(lc, `aaas_lifecycle_handshake_failures_total{reason="deadline"}`); v != 1 {
		t.Fatalf("%v failures for the deadline", v)
	}
	t.Logf("a pod with 8 fake token lines answering 401 after 9 s: the handshake command took %.1fs", took)
}

// hostilePods print 8 fake token lines after the real one and answer every
// handshake with 401 after 9 s.
func hostilePods(tmpl *extv1beta1.SandboxTemplate, pool *extv1beta1.SandboxWarmPool) {
	withEnv("DSHSIM_FAKE_TOKENS", "8")(tmpl, pool)
	withEnv("DSHSIM_REFUSE_HANDSHAKE_AFTER", "9s")(tmpl, pool)
}

// Security review S5: with twice COMMAND_WORKERS users whose pods hold
// every handshake as long as they can, another user's signup completes
// within WAKE_TIMEOUT (what an edge waits): handshakes hold at most
// HANDSHAKE_WORKERS, the rest go back to the queue. The hostile handshakes
// are still under way when it does.
func TestHostileHandshakesLeaveWorkersForSignups(t *testing.T) {
	const workers = 2
	f := setup(t, hostilePods)
	f.Env["COMMAND_WORKERS"] = fmt.Sprint(workers)
	f.lifecycle("lc-a")
	var hostile []string
	for i := range 2 * workers {
		u := fmt.Sprintf("hostile%d", i)
		f.signup(u)
		hostile = append(hostile, u)
	}
	for _, u := range hostile {
		if _, err := f.pub.Command(ctx(t), events.NewHandshake(u, events.HandshakeArgs{PodUID: f.Box(u).PodUID, Host: "localhost", Proto: "http"})); err != nil {
			t.Fatal(err)
		}
	}
	// WAKE_TIMEOUT as an edge reads it, by default.
	wake, err := config.LoadEdge(config.FromMap(map[string]string{"OPEN_SIGNUP": "1", "PUBLIC_HOSTS": "x.example", "NATS_ALLOW_ANONYMOUS": "1", "HANDSHAKE_KEYS": f.Key}))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	hash := tokenHash()
	if _, err := f.pub.Command(ctx(t), events.NewClaim("zed", "req-zed", hash, "")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.boxes.Wait(testenv.Context(t, wake.WakeTimeout), "zed", func(e kv.Entry[state.Sandbox], ok bool) bool {
		return ok && e.Value.Phase == state.PhaseReady
	}); err != nil {
		t.Fatalf("zed's signup did not complete within WAKE_TIMEOUT (%s) behind %d hostile handshakes", wake.WakeTimeout, len(hostile))
	}
	took := time.Since(start)
	// And zed was answered before any hostile handshake ended: it did not
	// wait for one to give its worker back.
	answered, err := f.requests.Get(ctx(t), "req-zed")
	if err != nil {
		t.Fatal(err)
	}
	var first time.Time
	testutil.Eventually(t, time.Minute, func() error {
		for _, u := range hostile {
			e, err := f.handshakes.Get(ctx(t), state.HandshakeKey(u, f.Box(u).PodUID, "localhost"))
			if err == nil && e.Value.Error != "" && (first.IsZero() || e.Value.At.Before(first)) {
				if !strings.Contains(e.Value.Error, "HANDSHAKE_TIMEOUT") && !strings.Contains(e.Value.Error, "too many handshakes") {
					t.Fatalf("%s's handshake ended with %q, not held by its pod", u, e.Value.Error)
				}
				first = e.Value.At
			}
		}
		if first.IsZero() {
			return errors.New("no hostile handshake has ended yet")
		}
		return nil
	})
	if !answered.Value.At.Before(first) {
		t.Fatalf("zed was answered at %s, after the first hostile handshake ended (%s): it waited for a worker", answered.Value.At.Format(time.StampMilli), first.Format(time.StampMilli))
	}
	t.Logf("zed's signup completed in %s behind %d hostile handshakes", took.Round(time.Millisecond), len(hostile))
}

// A command of a newer schema (a newer replica's, during a rolling
// upgrade) goes back to the queue: redelivered, never terminated.
func TestNewerSchemaIsHandedBackNotDropped(t *testing.T) {
	f := setup(t, nil)
	lc := f.lifecycle("lc-a")
	c := events.NewWake("eve", 7)
	c.V = events.CommandReadsUpTo + 1
	data, _ := json.Marshal(c)
	if _, err := f.JS.Publish(ctx(t), c.Subject(), data, jetstream.WithMsgID(c.ID)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if v := metric(lc, `aaas_lifecycle_command_duration_seconds_count{outcome="newer",verb=""}`); v == 0 {
			return errors.New("not handed back yet")
		}
		return nil
	})
	s, err := f.JS.Stream(ctx(t), events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("the newer command is gone from the queue: %d messages", info.State.Msgs)
	}
	if failed := f.auditEvents(events.AuditCommandFailed); len(failed) != 0 {
		t.Fatalf("the newer command was recorded as failed: %+v", failed)
	}
}

// metric is the value of the sample whose line starts with name (0 when
// there is none yet).
func metric(p *testenv.Proc, name string) float64 {
	line, err := p.Metric(name)
	if err != nil {
		return 0
	}
	f := strings.Fields(strings.Split(line, "\n")[0])
	v, _ := strconv.ParseFloat(f[len(f)-1], 64)
	return v
}

// podLog is the log of user's pod.
func (f *fixture) podLog(user string) string {
	f.t.Helper()
	box, _ := f.boxes.Get(user)
	b, err := pkg.Cluster.Client.CoreV1().Pods(f.NS.Name).GetLogs(box.Value.PodName, &corev1.PodLogOptions{}).DoRaw(ctx(f.t))
	if err != nil {
		f.t.Fatal(err)
	}
	return string(b)
}
