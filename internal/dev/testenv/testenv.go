// Package testenv runs the real parts of the system for integration tests:
// one devcluster per test package (from TestMain), and per test a fresh
// embedded NATS server, a namespace with the production RBAC and sandbox
// manifests, and aaas processes started from their real binaries, built
// with the race detector: a data race in one fails the test.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/manifests"
)

// Package is what TestMain sets up once.
type Package struct {
	Cluster *devcluster.Cluster
	// Bins maps a command name (lifecycle, edge, sweeper, broker, setup) to its
	// race-enabled binary.
	Bins map[string]string
}

// RaceBinEnv names the directory of race-enabled aaas binaries that
// `make test` builds once for every test package. Unset, each package
// builds its own.
const RaceBinEnv = "AAAS_RACE_BIN"

// commands are the aaas processes the tests start.
var commands = []string{"lifecycle", "edge", "sweeper", "broker", "setup"}

// Main finds or builds the binaries, starts the cluster, runs the tests
// and cleans up. The tests run race-enabled binaries, so a data race in a
// process fails the test that started it (Start); benchmarks (-bench) run
// plain ones, as deployed, for timings that mean something. Use:
// func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }
//
// With -short (make unit) it builds and starts nothing: the tests that need
// no control plane run, the others skip (NewStack, NewNamespace, Start).
func Main(m *testing.M, pkg *Package) int {
	if flag.Parse(); testing.Short() {
		return m.Run()
	}
	bins, cleanup, err := binaries()
	defer cleanup()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	pkg.Bins = bins
	return devclustertest.Main(m, &pkg.Cluster)
}

// Private is the package with a control plane of one test's own, for a
// test that restarts or breaks it (on the cluster `make test` shares, that
// would disturb every other package's tests). Under -short it skips t,
// as NewStack does: Main built no binaries to run on it.
func (p *Package) Private(t testing.TB) *Package {
	t.Helper()
	devclustertest.Need(t, p.Cluster)
	return &Package{Cluster: devclustertest.Private(t), Bins: p.Bins}
}

// binaries maps each of commands to its binary: in RaceBinEnv if set,
// otherwise built into a directory of this package's (race-enabled unless
// the run benchmarks) that cleanup removes.
func binaries() (bins map[string]string, cleanup func(), err error) {
	cleanup = func() {}
	flag.Parse()
	bench := flag.Lookup("test.bench").Value.String() != ""
	dir := os.Getenv(RaceBinEnv)
	if dir == "" || bench {
		if dir, err = os.MkdirTemp("", "testenv-bin-"); err != nil {
			return nil, cleanup, err
		}
		cleanup = func() { os.RemoveAll(dir) }
		var pkgs []string
		for _, c := range commands {
			pkgs = append(pkgs, "github.com/aaas-project/aaas/cmd/"+c)
		}
		if bench {
			err = gobuild.Static(dir, pkgs...)
		} else {
			err = gobuild.Race(dir, pkgs...)
		}
		if err != nil {
			return nil, cleanup, err
		}
	}
	bins = map[string]string{}
	for _, c := range commands {
		bins[c] = filepath.Join(dir, c)
		if _, err := os.Stat(bins[c]); err != nil {
			return nil, cleanup, fmt.Errorf("%s=%s: %w (the Makefile's test target builds the race-enabled %s there)", RaceBinEnv, dir, err, strings.Join(commands, ", "))
		}
	}
	return bins, cleanup, nil
}

// Context is a test-scoped context.
func Context(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// HandshakeKey returns a fresh base64 AES-256 key.
func HandshakeKey() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}

// LifecycleRole renders the lifecycle worker's ServiceAccount (from
// manifests/base, the control plane's namespace) and the Role and
// RoleBinding it is granted (from manifests/sandbox, the tenants'
// namespace): the tests run lifecycle under exactly what operators deploy.
// The namespaces are cleared; callers place them.
func LifecycleRole() (*corev1.ServiceAccount, *rbacv1.Role, *rbacv1.RoleBinding, error) {
	sa, role, rb := &corev1.ServiceAccount{}, &rbacv1.Role{}, &rbacv1.RoleBinding{}
	for _, want := range []struct {
		dir, kind string
		into      any
	}{
		{"manifests/base", "ServiceAccount", sa},
		{"manifests/sandbox", "Role", role},
		{"manifests/sandbox", "RoleBinding", rb},
	} {
		objs, err := manifests.Render(want.dir)
		if err != nil {
			return nil, nil, nil, err
		}
		kind, into := want.kind, want.into
		found := manifests.Pick(objs, kind)
		if len(found) != 1 {
			return nil, nil, nil, fmt.Errorf("%s has %d %s objects, want 1", want.dir, len(found), kind)
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(found[0].Object, into); err != nil {
			return nil, nil, nil, fmt.Errorf("decode %s: %w", kind, err)
		}
	}
	sa.Namespace, role.Namespace, rb.Namespace = "", "", ""
	return sa, role, rb, nil
}

// Namespace is one test's namespace with the manifests' lifecycle RBAC and
// sandbox template and warm pool.
type Namespace struct {
	Name string
	// Kubeconfig authenticates as the lifecycle ServiceAccount.
	Kubeconfig string
	Role       *rbacv1.Role
}

// NewNamespace creates it; mutate may adjust the sandbox template and pool
// (short auth TTLs, dshsim switches, pool size).
func (p *Package) NewNamespace(t testing.TB, mutate func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool)) *Namespace {
	t.Helper()
	devclustertest.Need(t, p.Cluster)
	ctx := Context(t, 3*time.Minute)
	// Random, not timed: test processes of several packages share one cluster.
	name := "t" + strings.ToLower(rand.Text()[:10])
	if err := p.Cluster.CreateNamespace(ctx, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Cluster.DeleteNamespace(context.Background(), name) })
	sa, role, rb, err := LifecycleRole()
	if err != nil {
		t.Fatal(err)
	}
	c := p.Cluster.Client
	if _, err := c.CoreV1().ServiceAccounts(name).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if role, err = c.RbacV1().Roles(name).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for i := range rb.Subjects {
		rb.Subjects[i].Namespace = name
	}
	if _, err := c.RbacV1().RoleBindings(name).Create(ctx, rb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := p.Cluster.InstallSandboxes(ctx, name, mutate); err != nil {
		t.Fatal(err)
	}
	kubeconfig, _, err := p.Cluster.ServiceAccountKubeconfig(ctx, name, sa.Name)
	if err != nil {
		t.Fatal(err)
	}
	return &Namespace{Name: name, Kubeconfig: kubeconfig, Role: role}
}

// Logger is a test logger at debug level when TESTENV_DEBUG is set.
func Logger() *slog.Logger {
	if os.Getenv("TESTENV_DEBUG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// Root is the repository root (where go.mod is).
func Root() string {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		panic(fmt.Sprintf("go env GOMOD: %v", err))
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}
