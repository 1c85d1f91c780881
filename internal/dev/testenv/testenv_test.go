package testenv_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/natsauth"
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
	if err := gobuild.Race(dir, "github.com/aaas-project/aaas/internal/dev/testenv/testdata/racer"); err != nil {
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

// run starts name from pkg as rec's process, waits for it to exit, and
// ends rec (its cleanups, in reverse).
func run(t *testing.T, pkg *testenv.Package, rec *recorder, name string, env map[string]string) *testenv.Proc {
	t.Helper()
	p := pkg.Start(rec, name, env)
	for deadline := time.Now().Add(time.Minute); !p.Exited(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not exit", name)
		}
	}
	for i := len(rec.cleanups) - 1; i >= 0; i-- {
		rec.cleanups[i]()
	}
	return p
}

// A subject a process uses without a grant fails the test that started
// it, as the NATS server that refused it reports (not the process: it
// carries on and exits 0), naming the connection; the same process
// publishing where its identity may fails nothing.
func TestNATSPermissionViolationInAProcessFailsTheTest(t *testing.T) {
	dir := t.TempDir()
	if err := gobuild.Race(dir, "github.com/aaas-project/aaas/internal/dev/testenv/testdata/trespasser"); err != nil {
		t.Fatal(err)
	}
	pkg := &testenv.Package{Bins: map[string]string{"trespasser": filepath.Join(dir, "trespasser")}}
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		subject string
		refused bool
	}{
		// What security review S4 closed: a session minted for an admin.
		{"$KV.sessions.ops.4f87c367e7b37ef377a6415813375cf12f281253023b18a00b17bdcb54e2a5f5", true},
		{events.CommandSubject(events.VerbSuspend, "ann"), false},
	} {
		s := natstest.StartWith(t, embednats.Options{Users: ids.Users()})
		rec := &recorder{TB: t}
		testenv.WatchNATS(rec, s)
		p := run(t, pkg, rec, "trespasser", map[string]string{
			"NATS_URL": s.URL(), "NATS_NKEY": ids.SeedFile(natsauth.Sweeper), "INSTANCE_ID": "trespasser", "TRESPASS_SUBJECT": tc.subject,
		})
		if p.ExitCode() != 0 || !strings.Contains(p.Logs(), "published to "+tc.subject) {
			t.Fatalf("trespasser exited %d, want 0 after it carried on:\n%s", p.ExitCode(), p.Logs())
		}
		failure := strings.Join(rec.errors, "\n")
		switch {
		case !tc.refused && failure != "":
			t.Fatalf("publishing to %s, which the sweeper may, failed the test: %s", tc.subject, failure)
		case tc.refused && (!strings.Contains(failure, "Publish Violation") || !strings.Contains(failure, fmt.Sprintf("%q", tc.subject)) || !strings.Contains(failure, "sweeper/trespasser")):
			t.Fatalf("publishing to %s did not fail the test with the server's report naming the process; it reported %q", tc.subject, failure)
		case tc.refused:
			t.Logf("failed as it should: %s", failure)
		}
	}
}

// The same through a cluster of nats-server processes (the fault tests'
// NATS), whose own logs are the witness.
func TestNATSPermissionViolationOnAClusterFailsTheTest(t *testing.T) {
	dir := t.TempDir()
	if err := gobuild.Race(dir, "github.com/aaas-project/aaas/internal/dev/testenv/testdata/trespasser"); err != nil {
		t.Fatal(err)
	}
	pkg := &testenv.Package{Bins: map[string]string{"trespasser": filepath.Join(dir, "trespasser")}}
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{TB: t}
	c := testenv.StartNATSCluster(rec, 3, ids)
	subject := events.CommandSubject(events.VerbRecreate, "ann") // the sweeper suspends and deletes dormant accounts, never recreates
	p := run(t, pkg, rec, "trespasser", map[string]string{
		"NATS_URL": c.Nodes[1].URL(), "NATS_NKEY": ids.SeedFile(natsauth.Sweeper), "INSTANCE_ID": "trespasser", "TRESPASS_SUBJECT": subject,
	})
	if p.ExitCode() != 0 {
		t.Fatalf("trespasser exited %d:\n%s", p.ExitCode(), p.Logs())
	}
	failure := strings.Join(rec.errors, "\n")
	if !strings.Contains(failure, "NATS node nats-1 refused") || !strings.Contains(failure, fmt.Sprintf("%q", subject)) || !strings.Contains(failure, "sweeper/trespasser") {
		t.Fatalf("the test did not fail with node nats-1's report naming the process; it reported %q", failure)
	}
	t.Logf("failed as it should: %s", failure)
}
