package accounts_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/sandbox"
)

// seedMarker is how the seed (Python) gateway marked its claims: as an
// annotation, where this gateway uses a label.
const seedMarker = "aaas.example.com/managed-by"

// TestAdoptSeedGatewayClaims migrates users of the seed gateway. Their
// claims (dsh-<user>, marker and token hash as annotations, no labels) are
// invisible to this gateway until `lifecycle adopt --apply`, run as the
// lifecycle ServiceAccount from the real binary, labels them; then the
// user signs in through the edge with the old bearer token and finds the
// workspace as it was. A dry run changes nothing, and claims adopt must
// not take (no token hash, not the seed's, not a user's) stay untouched.
func TestAdoptSeedGatewayClaims(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", nil)
	_, ext, err := pkg.Cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	claims := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name)
	ctx := testenv.Context(t, 5*time.Minute)

	token := ident.NewToken("ursula") // what the seed handed ursula at signup
	hash := ident.HashHex(token)
	seed := func(name string, annotations map[string]string) *extv1beta1.SandboxClaim {
		t.Helper()
		c, err := claims.Create(ctx, &extv1beta1.SandboxClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations},
			Spec:       extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	seed("dsh-ursula", map[string]string{seedMarker: "dsh-gateway", sandbox.TokenHashAnnotation: hash})
	untouched := map[string]*extv1beta1.SandboxClaim{
		// The seed's, but nobody could ever sign in to it.
		"dsh-vera": seed("dsh-vera", map[string]string{seedMarker: "dsh-gateway"}),
		// Applied by hand, without the marker: adopted only when named.
		"dsh-walt": seed("dsh-walt", map[string]string{sandbox.TokenHashAnnotation: ident.HashHex(ident.NewToken("walt"))}),
		// Marked, but not a user's claim.
		"scratch": seed("scratch", map[string]string{seedMarker: "dsh-gateway", sandbox.TokenHashAnnotation: hash}),
	}

	// ursula worked in the seed's sandbox: a file in her workspace.
	notes := []byte("written under the seed gateway\n")
	if pkg.Cluster.Node != nil {
		writeWorkspaceFile(t, w.NS.Name, "dsh-ursula", "notes.txt", notes)
	}

	browser := testenv.NewClient(t, edge.URL)
	expect(t, browser.Form("/login", "token", token), http.StatusUnauthorized, "login before adoption")

	// Bad flags: exit 2 with a message naming the problem, nothing changed.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--owner-annotation", "no-value"}, `--owner-annotation "no-value": want key=value`},
		{[]string{"--user", "dsh-ursula"}, `give the user, "ursula"`},
		{[]string{"--user", "Ursula"}, `--user "Ursula": user names are`},
		{[]string{"--token-annotation", "not a key"}, `--token-annotation "not a key" is not an annotation key`},
		{[]string{"--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"--apply", "ursula"}, `unexpected argument "ursula"`},
	} {
		if code, _, stderr := adoptCmd(t, w, tc.args...); code != 2 || !strings.Contains(stderr, tc.want) {
			t.Fatalf("adopt %v: exit %d, want 2 and %q:\n%s", tc.args, code, tc.want, stderr)
		}
	}

	// Dry run: the plan, and no change.
	code, out, stderr := adoptCmd(t, w)
	if code != 0 {
		t.Fatalf("dry run: exit %d\n%s%s", code, out, stderr)
	}
	wantLines(t, out,
		`dsh-ursula\s+ursula\s+adopt`,
		`dsh-vera\s+vera\s+skipped: no token hash in annotation aaas.example.com/token-sha256: the user could never sign in`,
		`dsh-walt\s+walt\s+skipped: no aaas.example.com/managed-by=dsh-gateway marker .*--user.*`,
		`scratch\s+-\s+skipped: not a user's claim .*`,
		`1 to adopt, 0 already managed, 3 skipped; nothing changed: run again with --apply to adopt`)
	if c := getClaim(t, w, "dsh-ursula"); len(c.Labels) != 0 {
		t.Fatalf("a dry run labelled the claim: %v", c.Labels)
	}
	if strings.Contains(out, hash[:12]) {
		t.Fatalf("adopt printed a token hash:\n%s", out)
	}

	code, out, stderr = adoptCmd(t, w, "--apply")
	if code != 0 {
		t.Fatalf("apply: exit %d\n%s%s", code, out, stderr)
	}
	wantLines(t, out, `dsh-ursula\s+ursula\s+adopted`, `1 adopted, 0 already managed, 3 skipped, 0 failed`)
	c := getClaim(t, w, "dsh-ursula")
	if c.Labels[seedMarker] != "dsh-gateway" || c.Labels[sandbox.UserLabel] != "ursula" || len(c.Labels) != 2 ||
		c.Annotations[sandbox.TokenHashAnnotation] != hash || c.Annotations[seedMarker] != "dsh-gateway" {
		t.Fatalf("adopted claim: labels %v, annotations %v", c.Labels, c.Annotations)
	}

	// The mirror takes the claim up; ursula signs in with her old token and
	// reaches her workspace through the edge.
	testutil.Eventually(t, time.Minute, func() error {
		if r := browser.Form("/login", "token", token); r.StatusCode != http.StatusOK {
			return fmt.Errorf("login: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
	expect(t, browser.Do("GET", "/u/ursula/", nil), http.StatusOK, "ursula's sandbox")
	if pkg.Cluster.Node != nil {
		r := browser.Do("GET", "/u/ursula/api/files/notes.txt", nil)
		expect(t, r, http.StatusOK, "the seed-era file")
		if !bytes.Equal(r.Body, notes) {
			t.Fatalf("notes.txt = %q, want %q", r.Body, notes)
		}
	}

	for _, before := range untouched {
		assertUntouched(t, w, before)
	}

	// Running it again changes nothing; naming walt adopts the hand-applied
	// claim, and still not the other two.
	code, out, stderr = adoptCmd(t, w, "--apply", "--user", "walt")
	if code != 0 {
		t.Fatalf("second apply: exit %d\n%s%s", code, out, stderr)
	}
	wantLines(t, out, `dsh-ursula\s+ursula\s+already managed`, `dsh-walt\s+walt\s+adopted`, `1 adopted, 1 already managed, 2 skipped, 0 failed`)
	for _, name := range []string{"dsh-vera", "scratch"} {
		assertUntouched(t, w, untouched[name])
	}
}

// assertUntouched fails unless the claim's labels and annotations are
// still as created, apart from the annotations the agent-sandbox
// controller keeps on every claim.
func assertUntouched(t *testing.T, w *testenv.Stack, created *extv1beta1.SandboxClaim) {
	t.Helper()
	ours := func(m map[string]string) map[string]string {
		out := maps.Clone(m)
		maps.DeleteFunc(out, func(k, _ string) bool { return strings.HasPrefix(k, "agents.x-k8s.io/") })
		return out
	}
	if c := getClaim(t, w, created.Name); !maps.Equal(c.Labels, created.Labels) || !maps.Equal(ours(c.Annotations), ours(created.Annotations)) {
		t.Errorf("%s changed: labels %v, annotations %v", created.Name, c.Labels, c.Annotations)
	}
}

// adoptCmd runs `lifecycle adopt args...` from the test's lifecycle binary
// with the lifecycle ServiceAccount's kubeconfig and only the variables
// adopt reads (no NATS, no handshake keys, as in a Job), and returns its
// exit status and output.
func adoptCmd(t *testing.T, w *testenv.Stack, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, pkg.Bins["lifecycle"], append([]string{"adopt"}, args...)...)
	cmd.Env = []string{"KUBECONFIG=" + w.NS.Kubeconfig, "SANDBOX_NAMESPACE=" + w.NS.Name, "PATH=" + os.Getenv("PATH"), "GORACE=" + gobuild.RaceEnv}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("lifecycle adopt %v: %v", args, err)
	}
	if strings.Contains(stderr.String(), "WARNING: DATA RACE") {
		t.Fatalf("lifecycle adopt %v: data race:\n%s", args, stderr.String())
	}
	return cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()
}

func wantLines(t *testing.T, out string, patterns ...string) {
	t.Helper()
	for _, p := range patterns {
		if !regexp.MustCompile(`(?m)^` + p + `$`).MatchString(out) {
			t.Errorf("adopt output has no line matching %q:\n%s", p, out)
		}
	}
}

func getClaim(t *testing.T, w *testenv.Stack, name string) *extv1beta1.SandboxClaim {
	t.Helper()
	_, ext, _ := pkg.Cluster.SandboxClients()
	c, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(testenv.Context(t, time.Minute), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// writeWorkspaceFile waits for the claim's sandbox pod and writes a file
// into the workspace on its volume, straight onto the simulated node's
// directory for the PVC (the seed's user would have written it through
// DSH; the claim is not ours yet, so the edge cannot reach it).
func writeWorkspaceFile(t *testing.T, namespace, claim, name string, data []byte) {
	t.Helper()
	sbc, ext, _ := pkg.Cluster.SandboxClients()
	testutil.Eventually(t, 2*time.Minute, func() error {
		ctx := testenv.Context(t, time.Minute)
		c, err := ext.ExtensionsV1beta1().SandboxClaims(namespace).Get(ctx, claim, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if c.Status.SandboxStatus.Name == "" {
			return errors.New("no sandbox yet")
		}
		sb, err := sbc.AgentsV1beta1().Sandboxes(namespace).Get(ctx, c.Status.SandboxStatus.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		podName := sb.Annotations[sandboxv1beta1.SandboxPodNameAnnotation]
		if podName == "" {
			podName = sb.Name
		}
		pod, err := pkg.Cluster.Client.CoreV1().Pods(namespace).Get(ctx, podName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !podReady(pod) {
			return errors.New("pod not ready")
		}
		for _, v := range pod.Spec.Volumes {
			if v.PersistentVolumeClaim == nil {
				continue
			}
			dir, err := pkg.Cluster.Node.PVCDir(namespace, v.PersistentVolumeClaim.ClaimName)
			if err != nil {
				return err
			}
			// The template mounts the volume's workspace/ at /workspace.
			ws := filepath.Join(dir, "workspace")
			if err := os.MkdirAll(ws, 0o755); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(ws, name), data, 0o644)
		}
		return errors.New("the pod has no volume claim")
	})
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
