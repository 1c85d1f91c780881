package install_test

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// ssoPreflight runs both preflights against the gateway-sso exposure
// (TestGatewaySSO): scripts/preflight-sso.sh, and the chart's own, `helm
// test`. Both pass with the SSO policies applied, their probes blocked
// from the tenants' namespace and the control plane's (the script also
// from a namespace of its own); both fail when the edge's policy admits
// everyone (what a CNI that enforces nothing amounts to), the script also
// when the policy is deleted; and the script says it could not test, with
// its own exit status, when its probe pod is refused (a full quota) or its
// image cannot be pulled.
func ssoPreflight(t *testing.T, ctx context.Context) {
	dir := installDir
	helmRun := func(args ...string) {
		t.Helper()
		if out, err := helmUpgrade(ctx, dir, args...); err != nil {
			t.Fatalf("helm upgrade %v: %v\n%s", args, err, out)
		}
		if err := cluster.WaitRollout(ctx, controlNS, 5*time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	helmTest := func() (int, string) {
		t.Helper()
		out, err := helmTest(ctx, dir)
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0, out
		case errors.As(err, &ee):
			return ee.ExitCode(), out
		}
		t.Fatal(err)
		return 0, ""
	}

	preflight := func(img string) (int, string) {
		t.Helper()
		out, err := shell(ctx, testenv.Root(), "scripts/preflight-sso.sh", "PREFLIGHT_IMAGE="+img, "PREFLIGHT_TIMEOUT=90")
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0, string(out)
		case errors.As(err, &ee):
			return ee.ExitCode(), string(out)
		}
		t.Fatal(err)
		return 0, ""
	}
	code, out := preflight(curlRef)
	if code != 0 || strings.Count(out, "cannot reach the edge (blocked") != 3 {
		t.Fatalf("preflight with the SSO policies applied: exit %d\n%s", code, out)
	}
	t.Logf("with the SSO policies: passed\n%s", out)
	code, out = helmTest()
	if code != 0 || strings.Count(out, "is unreachable from this pod") != 2 {
		t.Fatalf("helm test with the SSO policies applied: exit %d\n%s", code, out)
	}
	t.Logf("helm test with the SSO policies: passed\n%s", out)

	// A policy of the right name that admits everyone.
	policies := cluster.Client.NetworkingV1().NetworkPolicies(controlNS)
	np, err := policies.Get(ctx, "aaas-edge-from-oauth2-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := policies.Patch(ctx, np.Name, types.JSONPatchType, []byte(`[{"op":"replace","path":"/spec/ingress","value":[{}]}]`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	code, out = preflight(curlRef)
	if code != 1 || !strings.Contains(out, "reached the edge") {
		t.Fatalf("preflight with the edge open to every pod: exit %d, want 1\n%s", code, out)
	}
	t.Logf("with the edge's policy admitting everyone: failed as it should\n%s", out)
	code, out = helmTest()
	if code == 0 || !strings.Contains(out, "the edge answered a pod its NetworkPolicy should stop") {
		t.Fatalf("helm test with the edge open to every pod: exit %d, want a failure\n%s", code, out)
	}
	t.Logf("helm test with the edge's policy admitting everyone: failed as it should\n%s", out)

	if err := policies.Delete(ctx, np.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	code, out = preflight(curlRef)
	if code != 1 || !strings.Contains(out, "aaas-edge-from-oauth2-proxy is missing") {
		t.Fatalf("preflight with the edge's policy deleted: exit %d, want 1\n%s", code, out)
	}
	t.Logf("with the edge's policy deleted: failed as it should\n%s", out)
	// Back to the chart's policies (an upgrade re-applies what was deleted).
	helmRun()

	code, out = preflight(registry + "/no-such-image:1")
	if code != 2 || !strings.Contains(out, "COULD NOT TEST") {
		t.Fatalf("preflight with an image that cannot be pulled: exit %d, want 2\n%s", code, out)
	}
	t.Logf("with an image that cannot be pulled: could not test\n%s", out)

	quotas := cluster.Client.CoreV1().ResourceQuotas(sandboxNS)
	q, err := quotas.Get(ctx, "aaas", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	orig := q.Spec.Hard[corev1.ResourcePods]
	// No room at all (pods being replaced come and go, so "as many as are
	// used" may have room a moment later).
	fill(t, ctx, sandboxNS, "aaas", 1<<20)
	code, out = preflight(curlRef)
	if _, err := quotas.Patch(ctx, "aaas", types.MergePatchType, []byte(`{"spec":{"hard":{"pods":"`+orig.String()+`"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if code != 2 || !strings.Contains(out, "refused") {
		t.Fatalf("preflight whose probe pod is refused: exit %d, want 2\n%s", code, out)
	}
	t.Logf("with the probe pod refused: could not test\n%s", out)
}
