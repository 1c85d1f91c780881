package install_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

// TestSSOPreflight switches the install to the gateway-api-sso exposure
// as an operator would (helm upgrade: ingress.enabled=false,
// gatewaySSO.enabled=true; oauth2-proxy scaled to zero, as this test needs
// none running) and runs both preflights: scripts/preflight-sso.sh, and
// the chart's own, `helm test`. Both pass with the SSO policies applied,
// their probes blocked from the tenants' namespace and the control
// plane's (the script also from a namespace of its own); both fail when
// the edge's policy admits everyone (what a CNI that enforces nothing
// amounts to), the script also when the policy is deleted; and the script
// says it could not test, with its own exit status, when its probe pod is
// refused (a full quota) or its image cannot be pulled. helm rollback
// restores the ingress exposure afterwards, policies included.
func TestSSOPreflight(t *testing.T) {
	ctx := testenv.Context(t, 15*time.Minute)
	if err := cluster.InstallGatewayAPI(ctx); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	helmRun := func(args ...string) {
		t.Helper()
		if out, err := helmUpgrade(ctx, dir, args...); err != nil {
			t.Fatalf("helm upgrade %v: %v\n%s", args, err, out)
		}
		if err := cluster.WaitRollout(ctx, controlNS, 5*time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	// The release to roll back to afterwards.
	status, err := shell(ctx, dir, "helm status aaas -n "+controlNS+" -o json")
	var release struct{ Version int }
	if err != nil || json.Unmarshal(status, &release) != nil || release.Version == 0 {
		t.Fatalf("helm status: %v %s", err, status)
	}
	// README: the exposures are alternatives, never a stack; the chart
	// removes the Ingress and its policy as it adds the Gateway's.
	helmRun("--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=example",
		"--set", "gatewaySSO.allow={*}", "--set", "gatewaySSO.oauth2Proxy.replicas=0",
		// No front door here: the Gateway has no implementation in this
		// test, so helm test runs only the preflight.
		"--set", "tests.frontDoor=")
	t.Cleanup(func() {
		ctx := context.Background()
		for _, line := range []string{
			fmt.Sprintf("helm rollback aaas %d -n %s", release.Version, controlNS),
			"kubectl -n " + controlNS + " rollout status deploy/aaas-edge --timeout=5m",
		} {
			if out, err := shell(ctx, dir, line); err != nil {
				t.Errorf("restoring the ingress exposure: %s: %v\n%s", line, err, out)
			}
		}
		if _, err := cluster.Client.NetworkingV1().NetworkPolicies(controlNS).Get(ctx, "aaas-edge-ingress", metav1.GetOptions{}); err != nil {
			t.Errorf("after the rollback: %v", err)
		}
		// Restored means every answer through the front door comes from
		// a rolled-back edge: rollout status returns while the SSO
		// edges still drain behind Traefik, and the next test's signup
		// met one ("accounts are created by signing in through SSO").
		// The landing page tells them apart without changing anything.
		c := client(t, ingress(t))
		testutil.Eventually(t, 3*time.Minute, func() error {
			for i := range 12 {
				if r := c.Do(http.MethodGet, "/", nil); r.StatusCode != http.StatusOK || !strings.Contains(string(r.Body), `id="signup-card"`) {
					return fmt.Errorf("answer %d through the front door after the rollback: %d, not the signup page", i+1, r.StatusCode)
				}
			}
			return nil
		})
	})
	if _, err := cluster.Client.NetworkingV1().Ingresses(controlNS).Get(ctx, "aaas", metav1.GetOptions{}); err == nil {
		t.Fatal("the Ingress is still there under the SSO exposure")
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
