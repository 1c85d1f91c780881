package deploy_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/aaas-project/aaas/internal/dev/chartschema"
	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dev/manifests"
	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// renderChart renders charts/aaas as release aaas in the control plane's
// namespace with the given helm flags (--set …), failing the test on a
// refusal.
func renderChart(t *testing.T, args ...string) []*unstructured.Unstructured {
	t.Helper()
	objs, err := chart(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

func chart(t *testing.T, args ...string) ([]*unstructured.Unstructured, error) {
	t.Helper()
	helm := devcluster.HelmBinary()
	if _, err := os.Stat(helm); err != nil {
		t.Fatalf("%s not built: run `make tools`", helm)
	}
	return manifests.RenderChart(helm, filepath.Join(testenv.Root(), manifests.Chart), "aaas", controlNS, args...)
}

// chartVariants are the chart's values that install what each kustomize
// install of README composes: the same objects, the chart's own
// additions aside (chartOnly).
var chartVariants = []struct {
	name       string
	components []string
	values     []string
}{
	{"ingress", []string{"manifests/exposure/ingress"}, nil},
	{"gateway-sso", []string{"manifests/exposure/gateway-api-sso"}, []string{
		"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=example",
		"--set", "gatewaySSO.allow={group:YOUR-GITHUB-ORG:YOUR-GITHUB-TEAM}",
	}},
	{"ingress+hardening", []string{"manifests/exposure/ingress", "manifests/hardening"}, []string{
		"--set", "hardening.egress=true", "--set", "hardening.runtimeClass.create=true", "--set", "sandbox.runtimeClassName=gvisor",
	}},
	{"ingress+monitoring", []string{"manifests/exposure/ingress", "manifests/monitoring"}, []string{
		"--set", "monitoring.podMonitors=true", "--set", "monitoring.prometheusRule=true", "--set", "monitoring.natsExporter.enabled=true", "--set", "monitoring.dashboards=true",
	}},
}

// chartOnly says which of the chart's objects kustomize has no twin of:
// the helm test pods and ConfigMap dsh-web, which README's kustomize
// install creates with kubectl (the generated Secrets' Job, a hook of the
// chart's, is manifests/secrets there). And kustomizeOnly the reverse: the
// control plane's Namespace, which Helm leaves to `helm install
// --create-namespace` or the operator (README).
func chartOnly(o *unstructured.Unstructured) bool {
	return o.GetAnnotations()["helm.sh/hook"] == "test" || o.GetKind() == "ConfigMap" && o.GetName() == "dsh-web"
}

func kustomizeOnly(o *unstructured.Unstructured) bool {
	return o.GetKind() == "Namespace" && o.GetName() == controlNS
}

var natsConfigHash = regexp.MustCompile(`^nats-config-[a-z0-9]{10}$`)

// normalized is an object as both renderers must agree on it: Helm's
// bookkeeping labels and annotations and the checksums dropped (what they
// do is tested on their own), kustomize's hash suffix of the NATS
// ConfigMap dropped, numbers through JSON, and a ConfigMap value that is
// JSON (the broker's providers and prices) compared as what it encodes.
func normalized(t *testing.T, o *unstructured.Unstructured) map[string]any {
	t.Helper()
	b, err := o.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	var walk func(v any) any
	walk = func(v any) any {
		switch x := v.(type) {
		case map[string]any:
			for k, e := range x {
				switch {
				case k == "labels" || k == "annotations":
					if lm, ok := e.(map[string]any); ok {
						for lk := range lm {
							if lk == "helm.sh/chart" || lk == "helm.sh/resource-policy" || lk == "app.kubernetes.io/managed-by" || lk == "app.kubernetes.io/instance" ||
								strings.HasPrefix(lk, "checksum/") || strings.HasPrefix(lk, "helm.sh/hook") {
								delete(lm, lk)
							}
						}
						if len(lm) == 0 {
							delete(x, k)
							continue
						}
					}
					x[k] = walk(e)
				default:
					x[k] = walk(e)
				}
			}
			return x
		case []any:
			for i := range x {
				x[i] = walk(x[i])
			}
			return x
		case string:
			if natsConfigHash.MatchString(x) {
				return "nats-config"
			}
		}
		return v
	}
	m = walk(m).(map[string]any)
	if data, ok := m["data"].(map[string]any); ok && m["kind"] == "ConfigMap" {
		for k, v := range data {
			var parsed any
			if s, ok := v.(string); ok && strings.ContainsAny(s[:min(len(s), 1)], "[{") && json.Unmarshal([]byte(s), &parsed) == nil {
				data[k] = parsed
			}
		}
	}
	return m
}

// diffs lists where a and b differ, by path, with both values.
func diffs(path string, a, b any) []string {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if aok && bok {
		var out []string
		keys := map[string]bool{}
		for k := range am {
			keys[k] = true
		}
		for k := range bm {
			keys[k] = true
		}
		for _, k := range slices.Sorted(maps.Keys(keys)) {
			out = append(out, diffs(path+"."+k, am[k], bm[k])...)
		}
		return out
	}
	al, aok := a.([]any)
	bl, bok := b.([]any)
	if aok && bok && len(al) == len(bl) {
		var out []string
		for i := range al {
			out = append(out, diffs(fmt.Sprintf("%s[%d]", path, i), al[i], bl[i])...)
		}
		return out
	}
	if reflect.DeepEqual(a, b) {
		return nil
	}
	ab, _ := json.Marshal(a)
	bb, _ := json.Marshal(b)
	return []string{fmt.Sprintf("  %s: %s\n  %s  %s", path, ab, strings.Repeat(" ", len(path)), bb)}
}

func key(o *unstructured.Unstructured) string {
	return o.GetKind() + " " + o.GetNamespace() + "/" + natsConfigHash.ReplaceAllString(o.GetName(), "nats-config")
}

// TestChartInstallsWhatTheKustomizationDoes: kustomize stays as the
// install for those who compose their own, and the chart must install the
// same objects, field for field, for each of README's compositions. So the
// security properties the other tests check on the kustomize renders hold
// for the chart too, and neither can drift from the other.
func TestChartInstallsWhatTheKustomizationDoes(t *testing.T) {
	for _, v := range chartVariants {
		t.Run(v.name, func(t *testing.T) {
			want := map[string]*unstructured.Unstructured{}
			for _, o := range renderInstall(t, v.components...) {
				if !kustomizeOnly(o) {
					want[key(o)] = o
				}
			}
			got := map[string]*unstructured.Unstructured{}
			for _, o := range renderChart(t, v.values...) {
				if !chartOnly(o) {
					got[key(o)] = o
				}
			}
			var missing, extra []string
			for k := range want {
				if got[k] == nil {
					missing = append(missing, k)
				}
			}
			for k := range got {
				if want[k] == nil {
					extra = append(extra, k)
				}
			}
			sort.Strings(missing)
			sort.Strings(extra)
			if len(missing)+len(extra) > 0 {
				t.Fatalf("the chart lacks %v and adds %v", missing, extra)
			}
			for k, w := range want {
				wn, gn := normalized(t, w), normalized(t, got[k])
				if d := diffs("", wn, gn); len(d) > 0 {
					t.Errorf("%s differs (kustomize, then chart):\n%s", k, strings.Join(d, "\n"))
				}
			}
			t.Logf("%d objects equal", len(want))
		})
	}
}

// TestChartIsAcceptedByTheAPIServer: every variant, hooks and test pods
// included, is admitted by a real API server (server-side dry-run).
func TestChartIsAcceptedByTheAPIServer(t *testing.T) {
	devclustertest.Need(t, cluster)
	ctx := testenv.Context(t, 5*time.Minute)
	if err := cluster.InstallGatewayAPI(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cluster.InstallPrometheusOperatorCRDs(ctx); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{controlNS, sandboxNS} {
		if err := cluster.CreateNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}
	for _, v := range chartVariants {
		objs := renderChart(t, append(v.values, "--set", "tests.frontDoor=traefik.traefik.svc:443")...)
		if err := cluster.ApplyWith(ctx, "", devcluster.ApplyOptions{DryRun: true}, objs...); err != nil {
			t.Fatalf("%s refused by the API server: %v", v.name, err)
		}
		t.Logf("%s: %d objects accepted", v.name, len(objs))
	}
}

// TestChartRefusesBadValues: what the processes would refuse at start, or
// an install that contradicts itself, fails the render with a message
// naming the value, and renders nothing.
func TestChartRefusesBadValues(t *testing.T) {
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"both exposures", []string{"--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=x", "--set", "gatewaySSO.allow={*}"}, "choose one exposure"},
		{"SSO without a class", []string{"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.allow={*}"}, "gatewaySSO.gatewayClassName is required"},
		{"SSO admitting no one", []string{"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=x"}, "gatewaySSO.allow is required"},
		{"unknown setting", []string{"--set", "config.IDLE_TIMOUT=5m"}, "additional properties 'IDLE_TIMOUT' not allowed"},
		{"a setting the chart owns", []string{"--set", "config.PUBLIC_HOSTS=evil.test"}, "additional properties 'PUBLIC_HOSTS' not allowed"},
		{"a secret in the ConfigMap", []string{"--set", "config.HANDSHAKE_KEYS=abc"}, "additional properties 'HANDSHAKE_KEYS' not allowed"},
		{"not a duration", []string{"--set", "config.IDLE_TIMEOUT=forever"}, "/config/IDLE_TIMEOUT"},
		{"out of bounds", []string{"--set", "config.AUTH_RATE_LIMIT=0"}, "/config/AUTH_RATE_LIMIT"},
		{"not an enum value", []string{"--set", "config.LOG_LEVEL=loud"}, "/config/LOG_LEVEL"},
		{"not a boolean", []string{"--set-string", "config.COOKIE_SECURE=maybe"}, "/config/COOKIE_SECURE"},
		{"a typo in the structure", []string{"--set", "ingres.enabled=true"}, "additional properties 'ingres' not allowed"},
		{"no public host", []string{"--set", "hosts.public=null"}, "hosts"},
		{"tenants in the control plane's namespace", []string{"--set", "sandboxNamespace.name=" + controlNS}, "must differ from the release's namespace"},
		{"external NATS without a URL", []string{"--set", "nats.bundled=false"}, "nats.external.url is required"},
		{"a profile's groups without SSO", []string{"--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[1].name=gpu", "--set", "sandbox.profiles[1].groups={ml}"}, `"gpu" names groups, which need gatewaySSO.enabled`},
		{"a default profile with groups", []string{"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=x", "--set", "gatewaySSO.allow={*}", "--set", "sandbox.profiles[0].name=gpu", "--set", "sandbox.profiles[0].groups={ml}"}, "sandbox.profiles[0] (gpu) is the default"},
		{"a profile named twice", []string{"--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[1].name=small"}, `names "small" twice`},
		{"two profiles of one warm pool", []string{"--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[0].warmPool=dsh-large", "--set", "sandbox.profiles[1].name=large"}, "of warm pool dsh-large"},
		{"two profiles of one template", []string{"--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[0].template=dsh-web", "--set", "sandbox.profiles[1].name=large", "--set", "sandbox.profiles[1].template=dsh-web"}, "of template dsh-web"},
		{"a warm pool name Kubernetes refuses", []string{"--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[0].warmPool=Dsh_Pool"}, "/sandbox/profiles/0/warmPool"},
		{"a provider name that is no variable", []string{"--set", "broker.providers[0].name=deep-seek", "--set", "broker.providers[0].api=openai", "--set", "broker.providers[0].base_url=https://x", "--set", "broker.providers[0].models={m}"}, "/broker/providers/0/name"},
	} {
		t.Run(c.name, func(t *testing.T) {
			objs, err := chart(t, c.args...)
			if err == nil {
				t.Fatalf("rendered %d objects, want a refusal mentioning %q", len(objs), c.want)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("refused, but not for %q: %v", c.want, err)
			}
		})
	}
	// Positive control: the same values, well formed, render.
	renderChart(t, "--set", "config.IDLE_TIMEOUT=5m", "--set", "config.AUTH_RATE_LIMIT=1", "--set", "config.LOG_LEVEL=debug", "--set", "config.COOKIE_SECURE=true")
	renderChart(t, "--set", "sandbox.profiles[0].name=small", "--set", "sandbox.profiles[1].name=large")
}

// checksums returns each pod template's checksum annotations by workload.
func checksums(objs []*unstructured.Unstructured) map[string]string {
	out := map[string]string{}
	for _, o := range objs {
		ann, _, _ := unstructured.NestedStringMap(o.Object, "spec", "template", "metadata", "annotations")
		for k, v := range ann {
			if strings.HasPrefix(k, "checksum/") {
				out[o.GetName()+" "+k] = v
			}
		}
	}
	return out
}

// TestChartRollsWhatReadsAChangedConfig: a changed setting changes the
// checksum on every process that reads aaas-config (so `helm upgrade`
// restarts them), a change of something else changes none, and NATS rolls
// only for its own configuration.
func TestChartRollsWhatReadsAChangedConfig(t *testing.T) {
	before := checksums(renderChart(t))
	for _, w := range []string{"aaas-edge checksum/config", "aaas-lifecycle checksum/config", "aaas-sweeper checksum/config", "aaas-broker checksum/config", "nats checksum/nats-config"} {
		if before[w] == "" {
			t.Fatalf("no %s in %v", w, before)
		}
	}
	changed := checksums(renderChart(t, "--set", "config.IDLE_TIMEOUT=20m"))
	for k, v := range before {
		if roll := strings.HasSuffix(k, "checksum/config"); (changed[k] != v) != roll {
			t.Errorf("%s: changed %v after a config change, want %v", k, changed[k] != v, roll)
		}
	}
	if same := checksums(renderChart(t, "--set", "edge.replicas=5")); !reflect.DeepEqual(same, before) {
		t.Errorf("a replica count changed checksums: %v, was %v", same, before)
	}
	hosts := checksums(renderChart(t, "--set", "hosts.public={gw.other.test}"))
	if hosts["aaas-edge checksum/config"] == before["aaas-edge checksum/config"] {
		t.Error("a changed public host (ConfigMap dsh-web, which the edge reads) rolls no edge")
	}
}

// TestChartTakesEachHostFromOneValue: the public hosts and the sandbox
// domain reach PUBLIC_HOSTS/DSH's trusted hosts, SANDBOX_DOMAIN, the
// Ingress, the Gateway, the HTTPRoutes and oauth2-proxy's redirect URL
// from hosts.* alone: no object keeps the example's names.
func TestChartTakesEachHostFromOneValue(t *testing.T) {
	hosts := []string{"--set", "hosts.public={gw.corp.test,alt.corp.test}", "--set", "hosts.sandboxDomain=boxes.corp.test"}
	sso := []string{"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=traefik", "--set", "gatewaySSO.allow={*}"}
	for _, args := range [][]string{hosts, append(append([]string{}, hosts...), sso...)} {
		objs := renderChart(t, args...)
		for _, o := range objs {
			b, _ := o.MarshalJSON()
			if strings.Contains(string(b), "example.com") {
				t.Errorf("%s still names example.com: %s", key(o), b)
			}
		}
		dsh := get(t, objs, "ConfigMap", "dsh-web")
		if got := dsh.Object["data"].(map[string]any); got["trusted-hosts"] != "gw.corp.test,alt.corp.test" || got["sandbox-domain"] != "boxes.corp.test" {
			t.Errorf("dsh-web: %v", got)
		}
		if ing := manifests.Pick(objs, "Ingress"); len(ing) == 1 {
			b, _ := json.Marshal(ing[0].Object["spec"])
			for _, h := range []string{`"gw.corp.test"`, `"alt.corp.test"`, `"*.boxes.corp.test"`} {
				if strings.Count(string(b), h) != 2 { // a rule and a TLS entry
					t.Errorf("Ingress names %s %d times, want a rule and a TLS host: %s", h, strings.Count(string(b), h), b)
				}
			}
		}
		if d := manifests.Pick(objs, "Deployment"); len(d) > 0 {
			for _, o := range d {
				if o.GetName() != "oauth2-proxy" {
					continue
				}
				b, _ := o.MarshalJSON()
				if !strings.Contains(string(b), "--redirect-url=https://gw.corp.test/oauth2/callback") {
					t.Errorf("oauth2-proxy's redirect URL is not the first public host's: %s", b)
				}
			}
		}
	}
}

// TestChartLabelSelectorsReplaceTheirDefaults: the labels an operator
// gives for their ingress controller's, Gateway's and Prometheus's pods
// and namespaces are the whole selector, not joined to the chart's
// default (Helm merges maps: Traefik's pods, which lack the Gateway
// label of the default, were shut out of the edge so), and the defaults
// hold when none are given.
func TestChartLabelSelectorsReplaceTheirDefaults(t *testing.T) {
	sso := []string{"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=traefik", "--set", "gatewaySSO.allow={*}"}
	// The selectors of every NetworkPolicy peer, as JSON, by policy.
	peers := func(objs []*unstructured.Unstructured) string {
		var b strings.Builder
		for _, o := range manifests.Pick(objs, "NetworkPolicy") {
			ingress, _, _ := unstructured.NestedSlice(o.Object, "spec", "ingress")
			for _, rule := range ingress {
				from, _ := rule.(map[string]any)["from"].([]any)
				for _, f := range from {
					j, _ := json.Marshal(f)
					fmt.Fprintf(&b, "%s %s\n", o.GetName(), j)
				}
			}
		}
		return b.String()
	}
	for _, tt := range []struct {
		name       string
		args       []string
		want, gone []string
	}{
		{"ingress defaults", nil,
			[]string{`{"kubernetes.io/metadata.name":"traefik"}`, `{"app.kubernetes.io/name":"traefik"}`, `{"kubernetes.io/metadata.name":"monitoring"}`}, nil},
		{"ingress, the operator's", []string{"--set-json", `ingress.controller.namespaceLabels={"team":"edge"}`, "--set-json", `ingress.controller.podLabels={"app":"haproxy"}`, "--set-json", `monitoring.namespaceLabels={"name":"prometheus"}`},
			[]string{`{"team":"edge"}`, `{"app":"haproxy"}`, `{"name":"prometheus"}`}, []string{`"traefik"`, `"monitoring"`}},
		{"gateway defaults", sso,
			[]string{`{"kubernetes.io/metadata.name":"gateway-system"}`, `{"gateway.networking.k8s.io/gateway-name":"aaas"}`}, nil},
		{"gateway, the operator's", append([]string{"--set-json", `gatewaySSO.gateway.podLabels={"app.kubernetes.io/name":"traefik"}`, "--set-json", `gatewaySSO.gateway.namespaceLabels={"kubernetes.io/metadata.name":"traefik"}`}, sso...),
			[]string{`{"app.kubernetes.io/name":"traefik"}`, `{"kubernetes.io/metadata.name":"traefik"}`}, []string{"gateway-name", "gateway-system"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := peers(renderChart(t, tt.args...))
			for _, w := range tt.want {
				if !strings.Contains(got, `"matchLabels":`+w) {
					t.Errorf("no peer selects exactly %s:\n%s", w, got)
				}
			}
			for _, g := range tt.gone {
				if strings.Contains(got, g) {
					t.Errorf("a peer still selects the default's %s:\n%s", g, got)
				}
			}
		})
	}
}

// TestChartGeneratesOnlyAbsentSecrets: without existing Secrets the
// pre-install Job generates all three, named as everything reads them;
// naming an existing Secret removes it from the Job and points every
// reader at it; with all three existing there is no Job and no right to
// create Secrets at all.
func TestChartGeneratesOnlyAbsentSecrets(t *testing.T) {
	jobEnv := func(objs []*unstructured.Unstructured) map[string]string {
		for _, o := range manifests.Pick(objs, "Job") {
			if o.GetName() == "aaas-secrets" {
				return env(t, o)
			}
		}
		return nil
	}
	all := jobEnv(renderChart(t))
	if all["GENERATE_APP_SECRET"] != "aaas-secrets" || all["GENERATE_NATS_SECRET"] != "aaas-nats" || all["GENERATE_NATS_TLS_SECRET"] != "aaas-nats-tls" {
		t.Fatalf("job generates %v", all)
	}
	objs := renderChart(t, "--set", "nats.existingSecret=my-nats")
	if e := jobEnv(objs); e["GENERATE_NATS_SECRET"] != "" || e["GENERATE_APP_SECRET"] != "aaas-secrets" {
		t.Fatalf("with nats.existingSecret the job generates %v", e)
	}
	b, _ := json.Marshal(objs)
	if strings.Contains(string(b), `"aaas-nats"`) || !strings.Contains(string(b), `"my-nats"`) {
		t.Error("with nats.existingSecret some reader still names aaas-nats")
	}
	none := renderChart(t, "--set", "nats.existingSecret=n", "--set", "nats.tls.existingSecret=t", "--set", "secrets.existingSecret=a")
	for _, o := range none {
		if o.GetAnnotations()["helm.sh/hook"] == "pre-install,pre-upgrade" {
			t.Errorf("with every Secret existing the chart still renders hook %s", key(o))
		}
	}
	// The Job's Role reads only the Secrets it makes.
	for _, o := range renderChart(t) {
		if o.GetKind() != "Role" || o.GetName() != "aaas-secrets-job" {
			continue
		}
		b, _ := json.Marshal(o.Object["rules"])
		if !strings.Contains(string(b), `"resourceNames":["aaas-secrets","aaas-nats","aaas-nats-tls"]`) {
			t.Errorf("the secrets Job's Role: %s", b)
		}
	}
}

// TestChartSchemaIsGenerated: values.schema.json is what hack/chartschema
// writes from internal/config, and every value in values.yaml's config
// is one of its properties (the schema would refuse the chart's own
// defaults otherwise, which helm template above would show too).
func TestChartSchemaIsGenerated(t *testing.T) {
	want, err := chartschema.Generate()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(testenv.Root(), chartschema.Path))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatalf("%s is stale: go run ./hack/chartschema", chartschema.Path)
	}
	var schema struct {
		Properties struct {
			Config struct{ Properties map[string]any }
		}
	}
	if err := json.Unmarshal(got, &schema); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"IDLE_TIMEOUT", "MAX_USERS", "ADMIN_USERS", "LOG_LEVEL"} {
		if schema.Properties.Config.Properties[w] == nil {
			t.Errorf("config.%s missing from the schema", w)
		}
	}
	names := slices.Sorted(func(yield func(string) bool) {
		for k := range schema.Properties.Config.Properties {
			if !yield(k) {
				return
			}
		}
	})
	t.Logf("config accepts %d settings: %s", len(names), strings.Join(names, " "))
}

// TestChartNotesSayWhatToDoNext: after an install, NOTES.txt names the
// URL to open from hosts.public, how to read the invite code (not with
// SSO, whose users sign in through the provider), how to make the first
// administrator, and the verify step; with SSO it asks for the preflight
// before opening.
func TestChartNotesSayWhatToDoNext(t *testing.T) {
	notes := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(devcluster.HelmBinary(), append([]string{"install", "aaas", filepath.Join(testenv.Root(), manifests.Chart), "-n", controlNS, "--dry-run=client", "--set", "hosts.public={gw.corp.test}"}, args...)...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("helm install --dry-run %v: %v", args, err)
		}
		_, n, ok := strings.Cut(string(out), "\nNOTES:\n")
		if !ok {
			t.Fatalf("no NOTES in %s", out)
		}
		return n
	}
	for name, c := range map[string]struct {
		args          []string
		want, notWant []string
	}{
		"ingress": {nil, []string{"https://gw.corp.test/", "get secret aaas-secrets -o jsonpath='{.data.invite-code}'", "config.ADMIN_USERS", "helm test aaas -n " + controlNS, "tests.frontDoor"}, nil},
		"gateway-sso": {
			[]string{"--set", "ingress.enabled=false", "--set", "gatewaySSO.enabled=true", "--set", "gatewaySSO.gatewayClassName=traefik", "--set", "gatewaySSO.allow={*}"},
			[]string{"https://gw.corp.test/", "run the preflight: helm test aaas", "config.ADMIN_GROUPS", "sign in through your provider"},
			[]string{"invite-code"},
		},
		"none": {[]string{"--set", "ingress.enabled=false"}, []string{"port-forward svc/aaas-edge", "invite-code"}, []string{"tests.frontDoor"}},
	} {
		n := notes(c.args...)
		for _, w := range c.want {
			if !strings.Contains(n, w) {
				t.Errorf("%s: NOTES lack %q:\n%s", name, w, n)
			}
		}
		for _, w := range c.notWant {
			if strings.Contains(n, w) {
				t.Errorf("%s: NOTES mention %q:\n%s", name, w, n)
			}
		}
	}
}

// TestChartLetsLifecycleReachTheWebhook: with the hardening egress
// policies, lifecycle's reaches what hardening.notifyEgress names (the
// notices' webhook) and, without it, nothing beyond NATS, the sandboxes,
// the API server and DNS.
func TestChartLetsLifecycleReachTheWebhook(t *testing.T) {
	egress := func(args ...string) []any {
		t.Helper()
		objs := renderChart(t, append([]string{"--set", "hardening.egress=true"}, args...)...)
		return get(t, objs, "NetworkPolicy", "aaas-lifecycle-egress").Object["spec"].(map[string]any)["egress"].([]any)
	}
	base := egress()
	with := egress("--set-json", `hardening.notifyEgress=[{"to":[{"ipBlock":{"cidr":"203.0.113.10/32"}}],"ports":[{"protocol":"TCP","port":443}]}]`)
	if len(with) != len(base)+1 {
		t.Fatalf("lifecycle's egress: %d rules, %d with notifyEgress", len(base), len(with))
	}
	if b, _ := json.Marshal(with[len(with)-1]); string(b) != `{"ports":[{"port":443,"protocol":"TCP"}],"to":[{"ipBlock":{"cidr":"203.0.113.10/32"}}]}` {
		t.Fatalf("the webhook's rule: %s", b)
	}
	if b, _ := json.Marshal(base); strings.Contains(string(b), "203.0.113.10") {
		t.Fatalf("without notifyEgress: %s", b)
	}
}
