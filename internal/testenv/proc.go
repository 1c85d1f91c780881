package testenv

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Proc is an aaas process started from its binary, with its output kept
// for assertions (for example that no secret was ever logged).
type Proc struct {
	Name string
	// MetricsAddr serves /metrics and /readyz.
	MetricsAddr string
	Env         map[string]string
	cmd         *exec.Cmd
	out         *syncBuffer
	done        chan struct{}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// FreeAddr returns a free 127.0.0.1:port.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Start runs the named binary with env (plus METRICS_ADDR and LOG_LEVEL
// defaults) and stops it when the test ends.
func (p *Package) Start(t testing.TB, name string, env map[string]string) *Proc {
	t.Helper()
	bin, ok := p.Bins[name]
	if !ok {
		t.Fatalf("no binary %q", name)
	}
	full := map[string]string{"METRICS_ADDR": FreeAddr(t), "LOG_LEVEL": "debug", "PATH": os.Getenv("PATH")}
	for k, v := range env {
		full[k] = v
	}
	pr := &Proc{Name: name, MetricsAddr: full["METRICS_ADDR"], Env: full, out: &syncBuffer{}, done: make(chan struct{})}
	pr.start(t, bin)
	t.Cleanup(func() {
		pr.Stop()
		// Every flow runs under the production NATS permissions: a subject a
		// process uses without a grant in internal/natsauth fails the test.
		if v := violations(pr.Logs()); v != "" {
			t.Errorf("%s used NATS subjects its identity is not granted (internal/natsauth):\n%s", name, v)
		}
		if t.Failed() || os.Getenv("TESTENV_LOGS") != "" {
			t.Logf("--- %s output ---\n%s", name, tailString(pr.Logs(), 60))
		}
	})
	return pr
}

func (pr *Proc) start(t testing.TB, bin string) {
	t.Helper()
	var env []string
	for k, v := range pr.Env {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	pr.cmd = exec.Command(bin)
	pr.cmd.Env = env
	pr.cmd.Stdout, pr.cmd.Stderr = pr.out, pr.out
	pr.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := pr.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", pr.Name, err)
	}
	pr.done = make(chan struct{})
	go func() { _ = pr.cmd.Wait(); close(pr.done) }()
}

// Restart starts the process again with the same environment, after Stop
// or Kill.
func (pr *Proc) Restart(t testing.TB) {
	t.Helper()
	pr.start(t, pr.cmd.Path)
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
		select {
		case <-pr.done:
			t.Fatalf("%s exited before it was ready:\n%s", pr.Name, tailString(pr.Logs(), 40))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready after %s:\n%s", pr.Name, timeout, tailString(pr.Logs(), 40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Kill ends the process with SIGKILL: no shutdown code runs.
func (pr *Proc) Kill() {
	if pr.Exited() {
		return
	}
	_ = pr.cmd.Process.Kill()
	<-pr.done
}

// Stop sends SIGTERM and waits up to 20s before killing.
func (pr *Proc) Stop() {
	if pr.Exited() {
		return
	}
	_ = pr.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-pr.done:
	case <-time.After(20 * time.Second):
		pr.Kill()
	}
}

// PID is the process id.
func (pr *Proc) PID() int { return pr.cmd.Process.Pid }

// Exited reports whether the process has ended.
func (pr *Proc) Exited() bool {
	select {
	case <-pr.done:
		return true
	default:
		return false
	}
}

// ExitCode is the exit status once Exited.
func (pr *Proc) ExitCode() int { return pr.cmd.ProcessState.ExitCode() }

// Logs is everything the process wrote so far.
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
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// violations are the log lines of NATS permission violations.
func violations(logs string) string {
	var out []string
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(strings.ToLower(l), "permissions violation") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
