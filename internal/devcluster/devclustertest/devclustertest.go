// Package devclustertest starts one devcluster per test package from
// TestMain, so every test in the package shares its control plane.
package devclustertest

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/devcluster"
	"github.com/aaas-project/aaas/internal/gobuild"
)

// Main builds dshsim, starts a cluster into *c, runs the package's tests
// and stops the cluster. Use it as: func TestMain(m *testing.M) { os.Exit(devclustertest.Main(m, &cluster)) }
func Main(m *testing.M, c **devcluster.Cluster, opts ...func(*devcluster.Options)) int {
	tmp, err := os.MkdirTemp("", "devclustertest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)
	dshsim, err := gobuild.Binary(tmp, "github.com/aaas-project/aaas/cmd/dshsim")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
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
	start := time.Now()
	cl, err := devcluster.Start(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "devcluster:", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "devcluster started in %s\n", time.Since(start).Round(time.Millisecond))
	*c = cl
	code := m.Run()
	cl.Stop()
	return code
}

// Namespace creates a fresh namespace for one test and deletes it after.
func Namespace(t *testing.T, c *devcluster.Cluster) string {
	t.Helper()
	name := fmt.Sprintf("t-%d-%s", time.Now().UnixNano()%1e6, sanitize(t.Name()))
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
