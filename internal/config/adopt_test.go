package config_test

import (
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

// TestAdoptReadsTheWorkersKubernetesSettings: `lifecycle adopt` must label
// claims exactly as the worker beside it selects them, so both loaders
// agree on every variable they share, defaults included; and adopt needs
// neither a NATS identity nor handshake keys.
func TestAdoptReadsTheWorkersKubernetesSettings(t *testing.T) {
	worker := map[string]string{"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true"}
	for name, env := range map[string]map[string]string{
		"defaults": {},
		"set": {
			"KUBECONFIG": "/tmp/kc", "SANDBOX_NAMESPACE": "tenants", "CONTROL_PLANE_NAMESPACE": "gateway", "MANAGED_BY_LABEL": "example.org/owner=aaas",
			"KUBE_API_QPS": "7", "KUBE_API_BURST": "9", "KUBE_API_TIMEOUT": "12s",
		},
	} {
		a, err := config.LoadAdopt(config.FromMap(env))
		if err != nil {
			t.Fatalf("%s: adopt: %v", name, err)
		}
		full := map[string]string{}
		for k, v := range worker {
			full[k] = v
		}
		for k, v := range env {
			full[k] = v
		}
		l, err := config.LoadLifecycle(config.FromMap(full))
		if err != nil {
			t.Fatalf("%s: lifecycle: %v", name, err)
		}
		want := config.Adopt{
			Kubeconfig: l.Kubeconfig, SandboxNamespace: l.SandboxNamespace, ControlPlaneNamespace: l.ControlPlaneNamespace, ManagedKey: l.ManagedKey, ManagedValue: l.ManagedValue,
			KubeQPS: l.KubeQPS, KubeBurst: l.KubeBurst, KubeCallTimeout: l.KubeCallTimeout,
		}
		if a != want {
			t.Errorf("%s: adopt %+v, worker %+v", name, a, want)
		}
	}
}

func TestAdoptNamesBadVariables(t *testing.T) {
	_, err := config.LoadAdopt(config.FromMap(map[string]string{"SANDBOX_NAMESPACE": "Not_A_Namespace", "CONTROL_PLANE_NAMESPACE": "a.b", "MANAGED_BY_LABEL": "no-value"}))
	if err == nil || !strings.Contains(err.Error(), "SANDBOX_NAMESPACE:") || !strings.Contains(err.Error(), "CONTROL_PLANE_NAMESPACE:") || !strings.Contains(err.Error(), "MANAGED_BY_LABEL:") {
		t.Fatalf("err = %v", err)
	}
}

// TestTenantsGetANamespaceOfTheirOwn: lifecycle and adopt refuse to put
// the sandboxes in the control plane's namespace (they would share its
// quota and Secrets), and refuse the old NAMESPACE by its new name, so an
// operator's old setting is not silently ignored.
func TestTenantsGetANamespaceOfTheirOwn(t *testing.T) {
	_, err := config.LoadAdopt(config.FromMap(map[string]string{"SANDBOX_NAMESPACE": "aaas"}))
	if err == nil || !strings.Contains(err.Error(), "SANDBOX_NAMESPACE:") || !strings.Contains(err.Error(), "CONTROL_PLANE_NAMESPACE") {
		t.Fatalf("sandboxes in the control plane's namespace: err = %v", err)
	}
	_, err = config.LoadAdopt(config.FromMap(map[string]string{"NAMESPACE": "dsh-demo"}))
	if err == nil || !strings.Contains(err.Error(), "NAMESPACE: renamed SANDBOX_NAMESPACE") {
		t.Fatalf("the old NAMESPACE: err = %v", err)
	}
	a, err := config.LoadAdopt(config.FromMap(map[string]string{"SANDBOX_NAMESPACE": "tenants", "CONTROL_PLANE_NAMESPACE": "gateway"}))
	if err != nil || a.SandboxNamespace != "tenants" || a.ControlPlaneNamespace != "gateway" {
		t.Fatalf("%+v %v", a, err)
	}
}
