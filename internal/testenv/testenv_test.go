package testenv_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/gobuild"
	"github.com/aaas-project/aaas/internal/testenv"
)

// recorder is a test that keeps its failures and cleanups to itself.
type recorder struct {
	testing.TB
	errors   []string
	cleanups []func()
}

func (r *recorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
func (r *recorder) Cleanup(f func())    { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Failed() bool        { return len(r.errors) > 0 }
func (r *recorder) Logf(string, ...any) {}

// A data race in a process a test started fails that test, with the race
// detector's report, even though the process itself carried on.
func TestDataRaceInAProcessFailsTheTest(t *testing.T) {
	dir := t.TempDir()
	if err := gobuild.Race(dir, "github.com/aaas-project/aaas/internal/testenv/testdata/racer"); err != nil {
		t.Fatal(err)
	}
	pkg := &testenv.Package{Bins: map[string]string{"racer": filepath.Join(dir, "racer")}}
	rec := &recorder{TB: t}
	p := pkg.Start(rec, "racer", nil)
	for deadline := time.Now().Add(time.Minute); !p.Exited(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("racer did not exit")
		}
	}
	for i := len(rec.cleanups) - 1; i >= 0; i-- {
		rec.cleanups[i]()
	}
	if !strings.Contains(p.Logs(), "raced 2") || p.ExitCode() != 66 {
		t.Errorf("racer exited %d, want 66 after it carried on:\n%s", p.ExitCode(), p.Logs())
	}
	failure := strings.Join(rec.errors, "\n")
	if !strings.Contains(failure, "racer: the race detector found a data race") || !strings.Contains(failure, "racer/main.go:") {
		t.Fatalf("the test did not fail with the race report; it reported %q", failure)
	}
}
