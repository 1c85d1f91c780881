package lifecycle_test

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
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

// One user's commands hold at most one worker: while a long command of
// ann's runs, her next ones go back to the queue (counted as busy), and
// another user's command is done at once.
func TestOneUsersCommandsHoldOneWorker(t *testing.T) {
	f := setup(t, withEnv("DSHSIM_SILENT_HANDSHAKE", "1"))
	f.Env["COMMAND_WORKERS"] = "2"
	lc := f.lifecycle("lc-a")
	f.signup("ann")
	box, _ := f.boxes.Get("ann")
	// Two long handshakes for ann (different hosts), then wakes: before,
	// each parked a worker on her lock.
	for _, host := range []string{"a.example", "b.example"} {
		if _, err := f.pub.Command(ctx(t), events.NewHandshake("ann", events.HandshakeArgs{PodUID: box.Value.PodUID, Host: host, Proto: "http"})); err != nil {
			t.Fatal(err)
		}
	}
	for i := uint64(1); i <= 4; i++ {
		if _, err := f.pub.Command(ctx(t), events.NewWake("ann", 1000+i)); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	f.signup("dan")
	if took := time.Since(start); took > handshake.Timeout/2 {
		t.Fatalf("dan's signup took %s behind ann's commands", took)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if v := metric(lc, `aaas_lifecycle_command_duration_seconds_count{outcome="busy",verb="wake"}`); v == 0 {
			return errors.New("no wake of ann was handed back as busy")
		}
		return nil
	})
}

// A command of a newer schema (a newer replica's, during a rolling
// upgrade) goes back to the queue: redelivered, never terminated.
func TestNewerSchemaIsHandedBackNotDropped(t *testing.T) {
	f := setup(t, nil)
	lc := f.lifecycle("lc-a")
	c := events.NewWake("eve", 7)
	c.V = events.SchemaVersion + 1
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
	if strings.Contains(f.AuditLog(), "exhausted") {
		t.Fatal("the newer command was recorded as exhausted")
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
