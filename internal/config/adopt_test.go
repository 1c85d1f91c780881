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
			"KUBECONFIG": "/tmp/kc", "NAMESPACE": "tenants", "MANAGED_BY_LABEL": "example.org/owner=aaas",
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
			Kubeconfig: l.Kubeconfig, Namespace: l.Namespace, ManagedKey: l.ManagedKey, ManagedValue: l.ManagedValue,
			KubeQPS: l.KubeQPS, KubeBurst: l.KubeBurst, KubeCallTimeout: l.KubeCallTimeout,
		}
		if a != want {
			t.Errorf("%s: adopt %+v, worker %+v", name, a, want)
		}
	}
}

func TestAdoptNamesBadVariables(t *testing.T) {
	_, err := config.LoadAdopt(config.FromMap(map[string]string{"NAMESPACE": "Not_A_Namespace", "MANAGED_BY_LABEL": "no-value"}))
	if err == nil || !strings.Contains(err.Error(), "NAMESPACE:") || !strings.Contains(err.Error(), "MANAGED_BY_LABEL:") {
		t.Fatalf("err = %v", err)
	}
}
