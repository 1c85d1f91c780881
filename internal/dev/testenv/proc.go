package testenv

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// Proc is an aaas process started from its (race-enabled) binary, with its
// output kept for assertions (for example that no secret was ever logged).
type Proc struct {
	Name string
	// MetricsAddr serves /metrics and /readyz.
	MetricsAddr string
	Env         map[string]string
	bin         string
	p           *child.Process
	out         *testutil.Buffer // every run's output
}

// FreeAddr returns a free 127.0.0.1:port.
func FreeAddr(t testing.TB) string {
	t.Helper()
	port, err := embednats.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

// Start runs the named binary with env (plus METRICS_ADDR, LOG_LEVEL and
// GORACE defaults) and stops it when the test ends. The test fails if the
// process reported a data race; a NATS subject it used without a grant
// fails the test through the server that refused it (WatchNATS).
func (p *Package) Start(t testing.TB, name string, env map[string]string) *Proc {
	t.Helper()
	bin, ok := p.Bins[name]
	if !ok {
		t.Fatalf("no binary %q", name)
	}
	full := map[string]string{"METRICS_ADDR": FreeAddr(t), "LOG_LEVEL": "debug", "PATH": os.Getenv("PATH"), "GORACE": gobuild.RaceEnv}
	for k, v := range env {
		full[k] = v
	}
	pr := &Proc{Name: name, MetricsAddr: full["METRICS_ADDR"], Env: full, bin: bin, out: &testutil.Buffer{}}
	pr.start(t)
	t.Cleanup(func() {
		pr.Stop()
		logs := pr.Logs()
		if r := races(logs); r != "" {
			t.Errorf("%s: the race detector found a data race:\n%s", name, r)
		}
		if t.Failed() || os.Getenv("TESTENV_LOGS") != "" {
			t.Logf("--- %s output ---\n%s", name, tailString(logs, 60))
			// The tail of a busy process is mostly debug lines: its
			// warnings and errors, wherever they are, say more.
			if w := warnings(logs, 100); w != "" {
				t.Logf("--- %s warnings and errors ---\n%s", name, w)
			}
		}
	})
	return pr
}

func (pr *Proc) start(t testing.TB) {
	t.Helper()
	p, err := child.Start(child.Options{Name: pr.Name, Path: pr.bin, Env: child.Environ(pr.Env), Output: pr.out})
	if err != nil {
		t.Fatal(err)
	}
	pr.p = p
}

// Restart starts the process again with the same environment, after Stop
// or Kill.
func (pr *Proc) Restart(t testing.TB) {
	t.Helper()
	pr.start(t)
}

// IsReady reports whether /readyz answers 200 right now.
func (pr *Proc) IsReady() bool {
	resp, err := http.Get("http://" + pr.MetricsAddr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// WaitReady waits until /readyz answers 200.
func (pr *Proc) WaitReady(t testing.TB, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !pr.IsReady() {
		if pr.Exited() {
			t.Fatalf("%s exited before it was ready:\n%s", pr.Name, tailString(pr.Logs(), 40))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready after %s:\n%s", pr.Name, timeout, tailString(pr.Logs(), 40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Wait waits up to timeout for a one-shot process (setup) and fails the
// test unless it exited with status 0.
func (pr *Proc) Wait(t testing.TB, timeout time.Duration) {
	t.Helper()
	if err := pr.p.Wait(context.Background(), timeout); err != nil {
		t.Fatalf("%v:\n%s", err, pr.Logs())
	}
}

// Kill ends the process with SIGKILL: no shutdown code runs.
func (pr *Proc) Kill() { pr.p.Kill() }

// Stop sends SIGTERM and waits up to 20s before killing.
func (pr *Proc) Stop() { pr.p.Stop(20 * time.Second) }

// PID is the process id.
func (pr *Proc) PID() int { return pr.p.PID() }

// Exited reports whether the process has ended.
func (pr *Proc) Exited() bool { return pr.p.Exited() }

// ExitCode is the exit status once Exited.
func (pr *Proc) ExitCode() int { return pr.p.ExitCode() }

// Logs is everything the process wrote so far, over all its runs.
func (pr *Proc) Logs() string { return pr.out.String() }

// Metric returns the text of /metrics lines starting with name.
func (pr *Proc) Metric(name string) (string, error) {
	resp, err := http.Get("http://" + pr.MetricsAddr + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(resp.Body)
	var lines []string
	for _, l := range strings.Split(buf.String(), "\n") {
		if strings.HasPrefix(l, name) {
			lines = append(lines, l)
		}
	}
	if len(lines) == 0 {
		return "", fmt.Errorf("no metric %s", name)
	}
	return strings.Join(lines, "\n"), nil
}

func tailString(s string, n int) string {
	return string(child.Tail([]byte(s), n))
}

// warnings are the first n log lines at level WARN or ERROR.
func warnings(logs string, n int) string {
	var out []string
	for _, l := range strings.Split(logs, "\n") {
		if len(out) < n && (strings.Contains(l, `"level":"WARN"`) || strings.Contains(l, `"level":"ERROR"`)) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// raceWarning starts each report of the race detector, which ends with a
// line of '='.
const raceWarning = "WARNING: DATA RACE"

// races are the race detector's reports in logs.
func races(logs string) string {
	if !strings.Contains(logs, raceWarning) {
		return ""
	}
	var out []string
	in := false
	for _, l := range strings.Split(logs, "\n") {
		switch {
		case strings.Contains(l, raceWarning):
			in = true
		case in && strings.HasPrefix(l, "=================="):
			in = false
			out = append(out, l)
		}
		if in {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
