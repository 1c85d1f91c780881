package devstack_test

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/devstack"
	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/testutil"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

func TestRunStartsNATSAndStopsCleanly(t *testing.T) {
	port, err := embednats.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	if _, err := devclustertest.BuildBinary(bin, "github.com/aaas-project/aaas/cmd/dshsim"); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(t.TempDir(), "state")
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- devstack.Run(ctx, devstack.Options{StateDir: state, NATSPort: port, BinDir: bin, Out: out, Log: slog.New(slog.DiscardHandler)})
	}()
	addr := "127.0.0.1:" + strconv.Itoa(port)
	testutil.Eventually(t, 3*time.Minute, func() error {
		if !strings.Contains(out.String(), "Press Ctrl-C") {
			return net.UnknownNetworkError("not started: " + out.String())
		}
		return nil
	})
	for _, want := range []string{"AAAS_CMD", "AAAS_ACTIVITY", "AAAS_AUDIT", "nats://" + addr, "--kubeconfig " + filepath.Join(state, "devcluster", "admin.kubeconfig")} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("banner lacks %q:\n%s", want, out.String())
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("did not stop")
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Fatal("NATS still listening after stop")
	}
	if _, err := os.Stat(filepath.Join(state, "devcluster", "etcd")); err == nil {
		// The state dir is kept for inspection, but nothing may run from it.
		if out, _ := exec.Command("pgrep", "-f", filepath.Join(state, "devcluster")).Output(); len(out) > 0 {
			t.Fatalf("processes of the stack survived: %s", out)
		}
	}
}
