package deploy_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/manifests"
)

// TestChartMakesAWarmPoolAndTemplatePerProfile: sandbox.profiles make a
// warm pool and a SandboxTemplate per profile (each with the image,
// resources and pool size given, else the chart's), and PROFILES names
// exactly those pools, with the groups; the processes read it (and
// WARM_POOL beside it is gone, which they would refuse). Without
// profiles, the one pool of sandbox.warmPool and WARM_POOL, as before.
func TestChartMakesAWarmPoolAndTemplatePerProfile(t *testing.T) {
	objs := renderChart(t, "--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=x", "--set", "gatewaySSO.allow={*}",
		"--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[0].description=2 CPUs",
		"--set", "sandbox.profiles[1].name=gpu", "--set", "sandbox.profiles[1].groups={acme:ml}", "--set", "sandbox.profiles[1].replicas=0", "--set", "sandbox.profiles[1].maxRunning=4", "--set", "sandbox.profiles[1].idleTimeout=5m", "--set", "sandbox.profiles[1].maxRuntime=1h30m",
		"--set", "sandbox.profiles[1].image.repository=dsh-gpu", "--set", "sandbox.profiles[1].image.tag=2.0.0",
		"--set", "sandbox.profiles[1].resources.limits.nvidia\\.com/gpu=1")
	data := get(t, objs, "ConfigMap", "aaas-config").Object["data"].(map[string]any)
	if _, ok := data["WARM_POOL"]; ok {
		t.Fatalf("WARM_POOL beside PROFILES: %v", data)
	}
	l, err := config.LoadLifecycle(config.FromMap(map[string]string{
		"PROFILES": data["PROFILES"].(string), "HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true",
	}))
	if err != nil {
		t.Fatalf("PROFILES %s: %v", data["PROFILES"], err)
	}
	if l.Profiles.Names() != "small, gpu" || l.Profiles[0].Description != "2 CPUs" || strings.Join(l.Profiles[1].Groups, ",") != "acme:ml" || l.Profiles[1].MaxRunning != 4 || l.Profiles[1].IdleTimeout != config.Duration(5*time.Minute) || l.Profiles[1].MaxRuntime != config.Duration(90*time.Minute) || l.Profiles[0].MaxRunning != 0 {
		t.Fatalf("profiles %+v", l.Profiles)
	}
	for i, want := range []struct{ image, replicas, gpus string }{{"dsh-web:1.0.0", "2", ""}, {"dsh-gpu:2.0.0", "0", "1"}} {
		p := l.Profiles[i]
		pool := get(t, objs, "SandboxWarmPool", p.WarmPool)
		template, _, _ := unstructured.NestedString(pool.Object, "spec", "sandboxTemplateRef", "name")
		replicas, _, _ := unstructured.NestedInt64(pool.Object, "spec", "replicas")
		containers, _, _ := unstructured.NestedSlice(get(t, objs, "SandboxTemplate", template).Object, "spec", "podTemplate", "spec", "containers")
		dsh := containers[0].(map[string]any)
		var gpus string
		if v, ok, _ := unstructured.NestedFieldNoCopy(dsh, "resources", "limits", "nvidia.com/gpu"); ok {
			gpus = fmt.Sprint(v)
		}
		if dsh["image"] != want.image || strconv.FormatInt(replicas, 10) != want.replicas || gpus != want.gpus {
			t.Errorf("profile %s: template %s, image %v, %d spares, gpus %q; want %+v", p.Name, template, dsh["image"], replicas, gpus, want)
		}
	}
	if n := len(manifests.Pick(objs, "SandboxWarmPool")); n != 2 {
		t.Fatalf("%d warm pools for two profiles", n)
	}

	// Profiles turned on in an install that had none: the first keeps the
	// warm pool and template its sandboxes and spares were made of.
	objs = renderChart(t, "--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[0].warmPool=dsh-pool", "--set", "sandbox.profiles[0].template=dsh-web",
		"--set", "sandbox.profiles[1].name=large")
	data = get(t, objs, "ConfigMap", "aaas-config").Object["data"].(map[string]any)
	if !strings.Contains(data["PROFILES"].(string), `{"name":"small","warm_pool":"dsh-pool"}`) {
		t.Fatalf("PROFILES %s", data["PROFILES"])
	}
	for pool, template := range map[string]string{"dsh-pool": "dsh-web", "dsh-large": "dsh-web-large"} {
		if ref, _, _ := unstructured.NestedString(get(t, objs, "SandboxWarmPool", pool).Object, "spec", "sandboxTemplateRef", "name"); ref != template {
			t.Errorf("warm pool %s is of template %q, want %s", pool, ref, template)
		}
		get(t, objs, "SandboxTemplate", template)
	}
	if n := len(manifests.Pick(objs, "SandboxWarmPool")); n != 2 {
		t.Fatalf("%d warm pools for two profiles", n)
	}

	objs = renderChart(t)
	data = get(t, objs, "ConfigMap", "aaas-config").Object["data"].(map[string]any)
	if _, ok := data["PROFILES"]; ok || data["WARM_POOL"] != "dsh-pool" || len(manifests.Pick(objs, "SandboxWarmPool")) != 1 {
		t.Fatalf("without profiles: %v", data)
	}
	get(t, objs, "SandboxTemplate", "dsh-web")
}
