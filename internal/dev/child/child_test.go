package child

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Stop ends what the process started too, and the log keeps its output.
func TestStopEndsTheProcessGroup(t *testing.T) {
	log := filepath.Join(t.TempDir(), "sh.log")
	// The shell ignores SIGTERM; its background sleep does not outlive it.
	p, err := Start(Options{Name: "sh", Path: "sh", Args: []string{"-c", `trap "" TERM; sleep 60 & echo $!; wait`}, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	var sleeper int
	for deadline := time.Now().Add(10 * time.Second); sleeper == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no pid from sh")
		}
		sleeper, _ = strconv.Atoi(strings.TrimSpace(p.LogTail(1)))
	}
	p.Stop(100 * time.Millisecond)
	if !p.Exited() || p.ExitCode() != -1 {
		t.Fatalf("sh exited %v with %d, want killed", p.Exited(), p.ExitCode())
	}
	for deadline := time.Now().Add(5 * time.Second); alive(sleeper); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("sleep %d outlived its group", sleeper)
		}
	}
}

// alive reports whether pid runs (a zombie waiting for init does not).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, after, _ := strings.Cut(string(b), ") ")
	return !strings.HasPrefix(after, "Z")
}

// Wait fails a one-shot process that exits with an error and names it.
func TestWaitReportsTheExitStatus(t *testing.T) {
	var out bytes.Buffer
	p, err := Start(Options{Name: "false", Path: "sh", Args: []string{"-c", "echo no; exit 3"}, Env: Environ(map[string]string{"PATH": os.Getenv("PATH")}), Output: &out})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Wait(t.Context(), time.Minute); err == nil || err.Error() != "false exited with status 3" || out.String() != "no\n" {
		t.Fatalf("Wait = %v, output %q", err, out.String())
	}
}

func TestTail(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{{"a\nb\nc\n", 2, "b\nc\n"}, {"a\nb\nc", 2, "b\nc"}, {"a\n", 5, "a\n"}, {"a\nb\n", 0, ""}} {
		if got := string(Tail([]byte(c.in), c.n)); got != c.want {
			t.Errorf("Tail(%q, %d) = %q, want %q", c.in, c.n, got, c.want)
		}
	}
}
