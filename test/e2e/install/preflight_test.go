package install_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/aaas-project/aaas/internal/testenv"
)

// TestSSOPreflight switches the install to the gateway-api-sso exposure
// (README's kustomization with that component instead of the ingress one,
// applied with kubectl; oauth2-proxy scaled to zero, as this node has no
// image of it and the preflight needs none running) and runs
// scripts/preflight-sso.sh as an operator would. It passes with the SSO
// policies applied, its probe blocked from the tenants' namespace, the
// control plane's and a namespace of its own; it fails when the edge's
// policy admits everyone (what a CNI that enforces nothing amounts to) and
// when the policy is deleted; and it says it could not test, with its own
// exit status, when the probe pod is refused (a full quota) or its image
// cannot be pulled. The ingress exposure is restored afterwards.
func TestSSOPreflight(t *testing.T) {
	ctx := testenv.Context(t, 15*time.Minute)
	if err := cluster.InstallGatewayAPI(ctx); err != nil {
		t.Fatal(err)
	}
	k, _, err := readme()
	if err != nil {
		t.Fatal(err)
	}
	const ingress, sso = "manifests/exposure/ingress?", "manifests/exposure/gateway-api-sso?"
	if !strings.Contains(k, ingress) {
		t.Fatalf("README's kustomization does not use %s", ingress)
	}
	// The component's host names are placeholders an operator replaces
	// (README), as the ingress's are by the kustomization's patch.
	ssoKustomization := strings.Replace(k, ingress, sso, 1) + `  - target: {kind: Deployment, name: oauth2-proxy}
    patch: |-
      - op: replace
        path: /spec/replicas
        value: 0
  - target: {kind: Gateway, name: aaas}
    patch: |-
      - op: replace
        path: /spec/listeners/0/hostname
        value: ` + domain + `
      - op: replace
        path: /spec/listeners/1/hostname
        value: "*.` + sandboxDomain + `"
  - target: {kind: HTTPRoute, name: aaas}
    patch: |-
      - op: replace
        path: /spec/hostnames
        value: [` + domain + `]
  - target: {kind: HTTPRoute, name: aaas-sandboxes}
    patch: |-
      - op: replace
        path: /spec/hostnames
        value: ["*.` + sandboxDomain + `"]
`
	base := filepath.Join(os.TempDir(), "preflight-"+randomHex(3))
	t.Cleanup(func() { os.RemoveAll(base) })
	dirs := map[string]string{}
	for name, text := range map[string]string{"ingress": k, "sso": ssoKustomization} {
		dirs[name] = filepath.Join(base, name)
		if err := os.MkdirAll(dirs[name], 0o700); err != nil {
			t.Fatal(err)
		}
		if err := writeKustomization(dirs[name], text); err != nil {
			t.Fatal(err)
		}
	}
	kubectlRun := func(dir, line string) {
		t.Helper()
		if out, err := shell(ctx, dir, line); err != nil {
			t.Fatalf("%s: %v\n%s", line, err, out)
		}
	}
	// README: the exposures are alternatives, never a stack.
	kubectlRun(dirs["sso"], "kubectl -n "+controlNS+" delete ingress aaas && kubectl -n "+controlNS+" delete networkpolicy aaas-edge-ingress")
	kubectlRun(dirs["sso"], "kubectl apply -k .")
	t.Cleanup(func() {
		ctx := context.Background()
		for _, line := range []string{
			"kubectl -n " + controlNS + " delete deploy/oauth2-proxy svc/oauth2-proxy networkpolicy/aaas-edge-from-oauth2-proxy networkpolicy/oauth2-proxy-from-gateway gateway/aaas httproute/aaas httproute/aaas-sandboxes --ignore-not-found",
			"kubectl apply -k .",
			"kubectl -n " + controlNS + " rollout status deploy/aaas-edge --timeout=5m",
		} {
			if out, err := shell(ctx, dirs["ingress"], line); err != nil {
				t.Errorf("restoring the ingress exposure: %s: %v\n%s", line, err, out)
			}
		}
	})
	kubectlRun(dirs["sso"], "kubectl -n "+controlNS+" rollout status deploy/aaas-edge --timeout=5m")

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

	if err := policies.Delete(ctx, np.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	code, out = preflight(curlRef)
	if code != 1 || !strings.Contains(out, "aaas-edge-from-oauth2-proxy is missing") {
		t.Fatalf("preflight with the edge's policy deleted: exit %d, want 1\n%s", code, out)
	}
	t.Logf("with the edge's policy deleted: failed as it should\n%s", out)
	kubectlRun(dirs["sso"], "kubectl apply -k .")

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
