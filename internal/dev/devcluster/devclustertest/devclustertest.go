// Package devclustertest gives test packages their control plane: one
// devcluster shared by every package of a `make test` run (Serve), or one
// per package from TestMain, or one per test for tests that break it; each
// test works in a namespace of its own.
package devclustertest

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
)

// SharedEnv names the directory of a cluster that Serve shares with every
// test process it runs (`make test` runs one for all integration packages,
// as RaceBinEnv shares the race-enabled binaries). Unset, each package
// starts its own.
const SharedEnv = "AAAS_DEVCLUSTER"

// Main runs the package's tests against a cluster in *c: the shared one
// when SharedEnv names it, otherwise one it starts and stops (as it always
// does when opts change the cluster's options). Use it as:
// func TestMain(m *testing.M) { os.Exit(devclustertest.Main(m, &cluster)) }
// With -short (make unit) it starts nothing and *c stays nil: the tests
// that need no control plane run, the others skip (Need, Namespace).
func Main(m *testing.M, c **devcluster.Cluster, opts ...func(*devcluster.Options)) int {
	if dir := os.Getenv(SharedEnv); dir != "" && len(opts) == 0 && !short() {
		cl, err := devcluster.Attach(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		*c = cl
		return m.Run()
	}
	return Own(m, c, opts...)
}

// Own is Main with a cluster of the package's own, shared or not: for the
// tests of devcluster itself, which start, inspect and stop it.
func Own(m *testing.M, c **devcluster.Cluster, opts ...func(*devcluster.Options)) int {
	if short() {
		return m.Run()
	}
	cl, stop, err := start(opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	*c = cl
	return m.Run()
}

// Private starts a cluster for one test and stops it when the test ends:
// for a test that restarts or breaks the control plane, which would
// disturb every other package on a shared one.
func Private(t testing.TB, opts ...func(*devcluster.Options)) *devcluster.Cluster {
	t.Helper()
	cl, stop, err := start(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return cl
}

// Serve starts a simulated-node cluster, shares it (SharedEnv) with the
// command args and returns the command's exit code once it ends; the
// cluster is stopped either way. SIGINT and SIGTERM go to the command.
func Serve(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "devclustertest: no command to run")
		return 2
	}
	cl, stop, err := start()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := cl.Share(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), SharedEnv+"="+cl.Dir)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	err = cmd.Wait()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit) && exit.ExitCode() > 0:
		return exit.ExitCode()
	default:
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
}

// start builds dshsim and starts a simulated-node cluster.
func start(opts ...func(*devcluster.Options)) (*devcluster.Cluster, func(), error) {
	tmp, err := os.MkdirTemp("", "devclustertest-")
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*devcluster.Cluster, func(), error) {
		os.RemoveAll(tmp)
		return nil, nil, err
	}
	dshsim, err := gobuild.Binary(tmp, "github.com/aaas-project/aaas/internal/dev/cmd/dshsim")
	if err != nil {
		return fail(err)
	}
	o := devcluster.Options{DSHSim: dshsim}
	if os.Getenv("DEVCLUSTER_DEBUG") != "" {
		o.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	for _, f := range opts {
		f(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	begin := time.Now()
	cl, err := devcluster.Start(ctx, o)
	if err != nil {
		return fail(fmt.Errorf("devcluster: %w", err))
	}
	fmt.Fprintf(os.Stderr, "devcluster started in %s\n", time.Since(begin).Round(time.Millisecond))
	return cl, func() { cl.Stop(); os.RemoveAll(tmp) }, nil
}

// short reports -short (make unit): no control plane is started.
func short() bool {
	flag.Parse()
	return testing.Short()
}

// Need skips t when its package runs without a control plane (-short):
// c is the cluster Main started.
func Need(t testing.TB, c *devcluster.Cluster) {
	t.Helper()
	if c == nil {
		t.Skip("needs a control plane: make test runs it, -short (make unit) does not")
	}
}

// Namespace creates a fresh namespace for one test and deletes it after.
func Namespace(t *testing.T, c *devcluster.Cluster) string {
	t.Helper()
	Need(t, c)
	name := fmt.Sprintf("t-%s-%s", strings.ToLower(rand.Text()[:6]), sanitize(t.Name()))
	if err := c.CreateNamespace(context.Background(), name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.DeleteNamespace(context.Background(), name) })
	return name
}

func sanitize(s string) string {
	b := []byte{}
	for i := 0; i < len(s) && len(b) < 30; i++ {
		ch := s[i]
		switch {
		case ch >= 'a' && ch <= 'z', ch >= '0' && ch <= '9':
			b = append(b, ch)
		case ch >= 'A' && ch <= 'Z':
			b = append(b, ch+32)
		default:
			b = append(b, '-')
		}
	}
	for len(b) > 0 && b[len(b)-1] == '-' {
		b = b[:len(b)-1]
	}
	return string(b)
}
