package testenv

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
)

// Release is the package running another commit of this repository (the
// previous release, for the upgrade tests) on p's cluster: its commands
// are exported from git and built race-enabled, as Main builds this
// commit's, reporting version in aaas_build_info. Stack.Use and
// Proc.Replace move a stack between the two.
func (p *Package) Release(t testing.TB, commit, version string) *Package {
	t.Helper()
	devclustertest.Need(t, p.Cluster)
	src, dir := t.TempDir(), t.TempDir()
	// git archive, not a worktree: nothing of it stays in the checkout.
	archive, err := exec.Command("git", "-C", Root(), "archive", "--format=tar", commit).Output()
	if err != nil {
		t.Fatalf("git archive %s (%s): %v", version, commit, err)
	}
	untar := exec.Command("tar", "-x", "-C", src)
	untar.Stdin = bytes.NewReader(archive)
	if out, err := untar.CombinedOutput(); err != nil {
		t.Fatalf("unpacking %s: %v\n%s", version, err, out)
	}
	var pkgs []string
	for _, c := range commands {
		if _, err := os.Stat(filepath.Join(src, "cmd", c)); err == nil {
			pkgs = append(pkgs, "./cmd/"+c)
		}
	}
	ldflags := "-X github.com/aaas-project/aaas/internal/telemetry.Version=" + version
	if err := gobuild.RaceFrom(src, dir, []string{"-ldflags", ldflags}, pkgs...); err != nil {
		t.Fatalf("building %s: %v", version, err)
	}
	bins := map[string]string{}
	for _, pkg := range pkgs {
		name := filepath.Base(pkg)
		bins[name] = filepath.Join(dir, name)
	}
	return &Package{Cluster: p.Cluster, Bins: bins}
}

// Replace stops the process (SIGTERM, as a rolling update does) and
// starts with's binary of the same command in its place, with the same
// environment (address, identity, instance id), and waits until it is
// ready.
func (pr *Proc) Replace(t testing.TB, with *Package) {
	t.Helper()
	bin, ok := with.Bins[pr.Name]
	if !ok {
		t.Fatalf("no binary %q in the release", pr.Name)
	}
	pr.Stop()
	pr.bin = bin
	pr.start(t)
	pr.WaitReady(t, time.Minute)
}

// Use makes p's binaries the ones the stack starts from now on (Setup,
// Lifecycle, Edge, …): the processes already running keep theirs until
// Replace.
func (s *Stack) Use(p *Package) { s.pkg = p }
