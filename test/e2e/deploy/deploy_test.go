// Package deploy tests what operators and developers deploy: every
// kustomize overlay against devcluster's API server (server-side dry-run),
// the security properties of the rendered objects, compose.yaml, the
// Dockerfile, and `make run` as a newcomer runs it.
package deploy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dev/dshsim"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/manifests"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natstls"
)

var cluster *devcluster.Cluster

func TestMain(m *testing.M) { os.Exit(devclustertest.Main(m, &cluster)) }

// root is the repository root.
func root(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// The namespaces the manifests install into.
const (
	controlNS = config.DefaultControlPlaneNamespace
	sandboxNS = config.DefaultSandboxNamespace
)

// install is an operator's kustomization of base and sandbox with the
// given components (as README shows it: no namespace of its own, base and
// sandbox bring theirs).
func install(components ...string) string {
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n" +
		"  - " + manifests.Source + "base\n  - " + manifests.Source + "sandbox\n  - " + manifests.Source + "secrets\ncomponents:\n"
	for _, c := range components {
		k += "  - " + manifests.Source + strings.TrimPrefix(c, "manifests/") + "\n"
	}
	return k
}

func renderInstall(t *testing.T, components ...string) []*unstructured.Unstructured {
	t.Helper()
	objs, err := manifests.RenderKustomization(install(components...))
	if err != nil {
		t.Fatalf("base + sandbox + %v: %v", components, err)
	}
	return objs
}

// TestEveryKustomizationAndComponentIsAcceptedByTheAPIServer renders every
// kustomization, and base + sandbox with each component and with the
// components that compose (an exposure and hardening), and has a real API
// server admit them (server-side dry-run).
func TestEveryKustomizationAndComponentIsAcceptedByTheAPIServer(t *testing.T) {
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
	dirs, err := manifests.Overlays()
	if err != nil {
		t.Fatal(err)
	}
	components, err := manifests.Components()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"manifests/base", "manifests/sandbox", "manifests/dev/kind"} {
		if !contains(dirs, w) {
			t.Fatalf("kustomization %s missing from %v", w, dirs)
		}
	}
	for _, w := range []string{"manifests/exposure/ingress", "manifests/exposure/gateway-api-sso", "manifests/hardening", "manifests/monitoring"} {
		if !contains(components, w) {
			t.Fatalf("component %s missing from %v", w, components)
		}
	}
	apply := func(what string, objs []*unstructured.Unstructured) {
		t.Helper()
		if err := cluster.ApplyWith(ctx, "", devcluster.ApplyOptions{DryRun: true}, objs...); err != nil {
			t.Fatalf("%s refused by the API server: %v", what, err)
		}
		t.Logf("%s: %d objects accepted", what, len(objs))
	}
	for _, dir := range dirs {
		objs, err := manifests.Render(dir)
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		apply(dir, objs)
	}
	for _, c := range components {
		apply("base + sandbox + "+c, renderInstall(t, c))
	}
	for _, exposure := range []string{"manifests/exposure/ingress", "manifests/exposure/gateway-api-sso"} {
		objs := renderInstall(t, exposure, "manifests/hardening")
		if n := len(manifests.Pick(objs, "Namespace")); n != 2 {
			t.Fatalf("%d Namespaces, want the control plane's and the tenants'", n)
		}
		tmpl := get(t, objs, "SandboxTemplate", "dsh-web")
		if rc, _, _ := unstructured.NestedString(tmpl.Object, "spec", "podTemplate", "spec", "runtimeClassName"); rc != "gvisor" {
			t.Fatalf("hardening with %s: the template runs in %q", exposure, rc)
		}
		apply("base + sandbox + "+exposure+" + hardening", objs)
	}
}

// TestEveryImageIsPinned: whatever an operator composes, every container
// image names a version tag or a digest, never :latest or no tag at all,
// so an install runs the release its operator chose.
func TestEveryImageIsPinned(t *testing.T) {
	dirs, err := manifests.Overlays()
	if err != nil {
		t.Fatal(err)
	}
	var all []*unstructured.Unstructured
	for _, dir := range dirs {
		objs, err := manifests.Render(dir)
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		all = append(all, objs...)
	}
	all = append(all, renderInstall(t, "manifests/exposure/gateway-api-sso", "manifests/hardening")...)
	seen := 0
	for _, o := range all {
		for _, img := range images(o.Object) {
			seen++
			name := img[strings.LastIndex(img, "/")+1:]
			tag, hasTag := "", strings.Contains(name, ":")
			if hasTag {
				tag = name[strings.LastIndex(name, ":")+1:]
			}
			if !strings.Contains(img, "@sha256:") && (!hasTag || tag == "latest") {
				t.Errorf("%s %s runs %q: no version tag or digest", o.GetKind(), o.GetName(), img)
			}
		}
	}
	if seen < 5 {
		t.Fatalf("only %d images found: the walk missed the containers", seen)
	}
}

// images are the values of every "image" field in obj.
func images(obj any) []string {
	var out []string
	switch v := obj.(type) {
	case map[string]any:
		for k, x := range v {
			if s, ok := x.(string); ok && k == "image" {
				out = append(out, s)
			} else {
				out = append(out, images(x)...)
			}
		}
	case []any:
		for _, x := range v {
			out = append(out, images(x)...)
		}
	}
	return out
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if x == y {
			return true
		}
	}
	return false
}

func get(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range manifests.Pick(objs, kind) {
		if o.GetName() == name {
			return o
		}
	}
	t.Fatalf("no %s %s", kind, name)
	return nil
}

func podSpec(t *testing.T, d *unstructured.Unstructured) map[string]any {
	spec, _, _ := unstructured.NestedMap(d.Object, "spec", "template", "spec")
	return spec
}

func env(t *testing.T, d *unstructured.Unstructured) map[string]string {
	containers, _, _ := unstructured.NestedSlice(d.Object, "spec", "template", "spec", "containers")
	out := map[string]string{}
	for _, e := range containers[0].(map[string]any)["env"].([]any) {
		m := e.(map[string]any)
		v, _ := m["value"].(string)
		out[m["name"].(string)] = v
	}
	return out
}

// TestBaseKeepsKubernetesRightsToLifecycle: lifecycle alone of the
// processes has a ServiceAccount, and its only rights are one Role in the
// tenants' namespace; nothing grants it a right in the control plane's
// namespace, where NATS's and the gateway's Secrets are, nor anyone a
// right cluster-wide. The one other Role is the generated Secrets' Job's
// (manifests/secrets): create Secrets and read back the three it makes,
// bound to its own ServiceAccount, which only that Job runs as.
func TestBaseKeepsKubernetesRightsToLifecycle(t *testing.T) {
	objs, err := manifests.Render("manifests/base")
	if err != nil {
		t.Fatal(err)
	}
	all := renderInstall(t, "manifests/exposure/gateway-api-sso", "manifests/hardening", "manifests/monitoring")
	for _, kind := range []string{"ClusterRole", "ClusterRoleBinding"} {
		if n := len(manifests.Pick(all, kind)); n != 0 {
			t.Fatalf("%d %s objects in an install", n, kind)
		}
	}
	var roles, bindings []*unstructured.Unstructured
	for _, o := range append(manifests.Pick(all, "Role"), manifests.Pick(all, "RoleBinding")...) {
		switch {
		case o.GetName() == secretsJob:
			secretsJobRights(t, all, o)
		case o.GetKind() == "Role":
			roles = append(roles, o)
		default:
			bindings = append(bindings, o)
		}
	}
	if len(roles) != 1 || len(bindings) != 1 {
		t.Fatalf("%d Roles and %d RoleBindings in an install, want lifecycle's only", len(roles), len(bindings))
	}
	if ns := roles[0].GetNamespace(); ns != sandboxNS || bindings[0].GetNamespace() != sandboxNS {
		t.Fatalf("lifecycle's Role is in %q and its binding in %q, want the tenants' namespace %q", ns, bindings[0].GetNamespace(), sandboxNS)
	}
	lc := get(t, all, "Deployment", "aaas-lifecycle")
	if sa := podSpec(t, lc)["serviceAccountName"]; sa != "aaas-lifecycle" || lc.GetNamespace() != controlNS {
		t.Fatalf("lifecycle runs as %v in %s", sa, lc.GetNamespace())
	}
	subjects, _, _ := unstructured.NestedSlice(bindings[0].Object, "subjects")
	if s := subjects[0].(map[string]any); len(subjects) != 1 || s["name"] != "aaas-lifecycle" || s["namespace"] != controlNS {
		t.Fatalf("RoleBinding subjects %v", subjects)
	}
	for _, name := range []string{"aaas-edge", "aaas-sweeper"} {
		spec := podSpec(t, get(t, objs, "Deployment", name))
		if spec["automountServiceAccountToken"] != false || spec["serviceAccountName"] != nil {
			t.Fatalf("%s may get Kubernetes credentials: %v", name, spec["automountServiceAccountToken"])
		}
	}
	replicas := map[string]int64{"aaas-edge": 3, "aaas-lifecycle": 2, "aaas-sweeper": 2}
	for name, want := range replicas {
		got, _, _ := unstructured.NestedInt64(get(t, objs, "Deployment", name).Object, "spec", "replicas")
		if got != want {
			t.Errorf("%s replicas %d, want %d", name, got, want)
		}
	}
	ss := get(t, objs, "StatefulSet", "nats")
	if r, _, _ := unstructured.NestedInt64(ss.Object, "spec", "replicas"); r != 3 {
		t.Fatalf("nats replicas %d", r)
	}
	containers, _, _ := unstructured.NestedSlice(ss.Object, "spec", "template", "spec", "containers")
	if img := containers[0].(map[string]any)["image"]; img != aaas.Version("NATS_IMAGE") {
		t.Fatalf("nats image %v, versions.env says %s", img, aaas.Version("NATS_IMAGE"))
	}
	if get(t, objs, "ConfigMap", "aaas-config").Object["data"].(map[string]any)["STREAM_REPLICAS"] != "3" {
		t.Fatal("streams are not replicated three ways")
	}
}

// secretsJob names the generated Secrets' Job's ServiceAccount, Role and
// RoleBinding.
const secretsJob = "aaas-secrets-job"

// secretsJobRights checks one of the Job's RBAC objects: in the control
// plane's namespace, the Role exactly create on Secrets and get on the
// three it makes, the binding to its ServiceAccount alone, which mounts
// no token but in the Job's pods.
func secretsJobRights(t *testing.T, all []*unstructured.Unstructured, o *unstructured.Unstructured) {
	t.Helper()
	if o.GetNamespace() != controlNS {
		t.Fatalf("%s %s is in %q", o.GetKind(), o.GetName(), o.GetNamespace())
	}
	if o.GetKind() == "Role" {
		want := []any{
			map[string]any{"apiGroups": []any{""}, "resources": []any{"secrets"}, "verbs": []any{"create"}},
			map[string]any{"apiGroups": []any{""}, "resources": []any{"secrets"}, "resourceNames": []any{"aaas-secrets", "aaas-nats", "aaas-nats-tls"}, "verbs": []any{"get"}},
			// Adding a newer release's identities to aaas-nats (installsecrets).
			map[string]any{"apiGroups": []any{""}, "resources": []any{"secrets"}, "resourceNames": []any{"aaas-nats"}, "verbs": []any{"patch"}},
		}
		if rules, _, _ := unstructured.NestedSlice(o.Object, "rules"); !reflect.DeepEqual(rules, want) {
			t.Fatalf("the Secrets Job's Role grants %v", rules)
		}
		return
	}
	subjects, _, _ := unstructured.NestedSlice(o.Object, "subjects")
	if s := subjects[0].(map[string]any); len(subjects) != 1 || s["kind"] != "ServiceAccount" || s["name"] != secretsJob || s["namespace"] != controlNS {
		t.Fatalf("the Secrets Job's RoleBinding subjects %v", subjects)
	}
	if sa := get(t, all, "ServiceAccount", secretsJob); sa.Object["automountServiceAccountToken"] != false {
		t.Fatalf("ServiceAccount %s mounts its token into every pod that names it", secretsJob)
	}
	for _, w := range all {
		if spec, ok, _ := unstructured.NestedMap(w.Object, "spec", "template", "spec"); ok && spec["serviceAccountName"] == secretsJob && (w.GetKind() != "Job" || w.GetName() != "aaas-secrets") {
			t.Fatalf("%s %s runs as %s", w.GetKind(), w.GetName(), secretsJob)
		}
	}
}

// TestTenantsHaveANamespaceOfTheirOwn: in every install the control plane
// (NATS, the edges, lifecycle, the sweeper, their Services, config and
// policies) is in one namespace and everything of the tenants (template,
// warm pool, quota, lifecycle's Role) in another, both enforcing
// `restricted`; what names the other namespace names the right one
// (lifecycle's SANDBOX_NAMESPACE, the template's ingress from the edge and
// lifecycle, hardening's egress to sandboxes); the namespaces are
// internal/config's defaults; and aaas-config caps the gateway within the
// tenants' quota.
func TestTenantsHaveANamespaceOfTheirOwn(t *testing.T) {
	objs := renderInstall(t, "manifests/exposure/ingress", "manifests/hardening")
	tenants := map[string]bool{"SandboxTemplate": true, "SandboxWarmPool": true, "ResourceQuota": true, "Role": true, "RoleBinding": true}
	for _, o := range objs {
		want := controlNS
		if tenants[o.GetKind()] && o.GetName() != secretsJob {
			want = sandboxNS
		}
		if o.GetKind() == "Namespace" || o.GetKind() == "RuntimeClass" {
			continue
		}
		if o.GetNamespace() != want {
			t.Errorf("%s %s is in namespace %q, want %q", o.GetKind(), o.GetName(), o.GetNamespace(), want)
		}
	}
	for _, ns := range []string{controlNS, sandboxNS} {
		if l := get(t, objs, "Namespace", ns).GetLabels(); l["pod-security.kubernetes.io/enforce"] != "restricted" {
			t.Errorf("namespace %s enforces %q", ns, l["pod-security.kubernetes.io/enforce"])
		}
	}
	cfg := get(t, objs, "ConfigMap", "aaas-config").Object["data"].(map[string]any)
	if cfg["SANDBOX_NAMESPACE"] != sandboxNS {
		t.Errorf("aaas-config SANDBOX_NAMESPACE %v, the sandboxes are in %s", cfg["SANDBOX_NAMESPACE"], sandboxNS)
	}
	if !strings.Contains(fmt.Sprint(get(t, objs, "Deployment", "aaas-lifecycle").Object), "name:CONTROL_PLANE_NAMESPACE valueFrom:map[fieldRef:map[fieldPath:metadata.namespace]]") {
		t.Error("lifecycle's CONTROL_PLANE_NAMESPACE is not its own namespace")
	}
	from, _, _ := unstructured.NestedSlice(get(t, objs, "SandboxTemplate", "dsh-web").Object, "spec", "networkPolicy", "ingress")
	if len(from) != 2 || !strings.Contains(fmt.Sprint(from[0]), "kubernetes.io/metadata.name:"+controlNS+"]") {
		t.Errorf("sandboxes admit %v, want DSH's port from the edge and lifecycle of namespace %s, and the previews' from its edge", from, controlNS)
	} else {
		previewsFromTheEdgeOnly(t, from[1].(map[string]any))
	}
	for _, name := range []string{"aaas-edge-egress", "aaas-lifecycle-egress"} {
		if p := fmt.Sprint(get(t, objs, "NetworkPolicy", name).Object["spec"]); !strings.Contains(p, "kubernetes.io/metadata.name:"+sandboxNS+"]") {
			t.Errorf("%s does not reach sandboxes in %s: %s", name, sandboxNS, p)
		}
	}
	quota, _, _ := unstructured.NestedStringMap(get(t, objs, "ResourceQuota", "aaas").Object, "spec", "hard")
	pool, _, _ := unstructured.NestedInt64(get(t, objs, "SandboxWarmPool", "dsh-pool").Object, "spec", "replicas")
	atoi := func(what string, v any) int64 {
		n, err := strconv.ParseInt(fmt.Sprint(v), 10, 64)
		if err != nil || n <= 0 {
			t.Fatalf("%s = %v: want a cap", what, v)
		}
		return n
	}
	users, running := atoi("MAX_USERS", cfg["MAX_USERS"]), atoi("MAX_RUNNING_SANDBOXES", cfg["MAX_RUNNING_SANDBOXES"])
	if pvcs := atoi("quota persistentvolumeclaims", quota["persistentvolumeclaims"]); users+pool > pvcs {
		t.Errorf("MAX_USERS %d and %d spares need more volume claims than the quota's %d", users, pool, pvcs)
	}
	if pods := atoi("quota pods", quota["pods"]); running+pool > pods {
		t.Errorf("MAX_RUNNING_SANDBOXES %d and %d spares need more pods than the quota's %d", running, pool, pods)
	}
}

// previewsFromTheEdgeOnly: the template's second ingress rule admits the
// pods of the edge (and nothing else) of the control plane's namespace on
// exactly the ports aaas-config documents for PREVIEW_PORTS.
func previewsFromTheEdgeOnly(t *testing.T, rule map[string]any) {
	t.Helper()
	peers, _, _ := unstructured.NestedSlice(rule, "from")
	want := map[string]any{
		"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": controlNS}},
		"podSelector":       map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": "aaas-edge"}},
	}
	if len(peers) != 1 || fmt.Sprint(peers[0]) != fmt.Sprint(want) {
		t.Errorf("the previews' ports admit %v, want the edge of %s only", peers, controlNS)
	}
	raw, err := aaas.Manifests.ReadFile("manifests/base/config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`PREVIEW_PORTS: "([0-9,]+)"`).FindSubmatch(raw)
	if m == nil {
		t.Fatal("aaas-config documents no PREVIEW_PORTS")
	}
	ports, _, _ := unstructured.NestedSlice(rule, "ports")
	var got []string
	for _, p := range ports {
		if p.(map[string]any)["protocol"] != "TCP" {
			t.Errorf("preview port %v is not TCP", p)
		}
		got = append(got, fmt.Sprint(p.(map[string]any)["port"]))
	}
	if strings.Join(got, ",") != string(m[1]) {
		t.Errorf("the template admits the edge on %v, PREVIEW_PORTS is %s: keep them equal", got, m[1])
	}
}

// TestSandboxEgressExcludesPrivateAddresses: the template's egress to
// public addresses leaves out the private and special IPv4 ranges, and on
// IPv6 the unique-local, link-local and loopback ranges and both NAT64
// prefixes (through a NAT64 gateway 64:ff9b::a00:1 is 10.0.0.1). The
// deployment tier probes the IPv4 ones, and the API server's endpoint
// that README's patch adds, from a sandbox on the real node.
func TestSandboxEgressExcludesPrivateAddresses(t *testing.T) {
	tmpl := get(t, renderInstall(t, "manifests/exposure/ingress"), "SandboxTemplate", "dsh-web")
	egress, _, _ := unstructured.NestedSlice(tmpl.Object, "spec", "networkPolicy", "egress")
	except := map[string][]string{}
	for _, rule := range egress {
		for _, peer := range rule.(map[string]any)["to"].([]any) {
			if b, ok := peer.(map[string]any)["ipBlock"].(map[string]any); ok {
				for _, e := range b["except"].([]any) {
					except[b["cidr"].(string)] = append(except[b["cidr"].(string)], e.(string))
				}
			}
		}
	}
	for cidr, want := range map[string][]string{
		"0.0.0.0/0": {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10", "127.0.0.0/8"},
		"::/0":      {"fc00::/7", "fe80::/10", "::1/128", "64:ff9b::/96", "64:ff9b:1::/48"},
	} {
		for _, w := range want {
			if !slices.Contains(except[cidr], w) {
				t.Errorf("sandbox egress to %s does not exclude %s: %v", cidr, w, except[cidr])
			}
		}
	}
}

// TestNATSRunsTLSOnly: the documented install's NATS takes clients and
// routes over TLS only (routes verifying both ends) from Secret
// aaas-nats-tls, and every process that connects to it verifies it with
// NATS_CA. (The deployment tier shows plaintext refused on a real node.)
func TestNATSRunsTLSOnly(t *testing.T) {
	objs := renderInstall(t, "manifests/exposure/ingress")
	var data map[string]any
	for _, cm := range manifests.Pick(objs, "ConfigMap") {
		if strings.HasPrefix(cm.GetName(), "nats-config-") { // the generator's hashed name
			data = cm.Object["data"].(map[string]any)
		}
	}
	for file, want := range map[string][]string{
		"tls.conf":         {"cert_file: /etc/nats-tls/tls.crt", "key_file: /etc/nats-tls/tls.key"},
		"cluster-tls.conf": {"cert_file: /etc/nats-tls/tls.crt", "ca_file: /etc/nats-tls/ca.crt", "verify: true"},
	} {
		for _, w := range want {
			if !strings.Contains(fmt.Sprint(data[file]), w) {
				t.Errorf("%s lacks %q:\n%v", file, w, data[file])
			}
		}
	}
	if !strings.Contains(fmt.Sprint(get(t, objs, "StatefulSet", "nats").Object), "secretName:"+natstls.SecretName) {
		t.Error("NATS does not mount its certificate")
	}
	for _, name := range []string{"aaas-edge", "aaas-lifecycle", "aaas-sweeper"} {
		d := get(t, objs, "Deployment", name)
		spec := podSpec(t, d)
		var all []any
		all = append(all, spec["containers"].([]any)...)
		if ic, ok := spec["initContainers"].([]any); ok {
			all = append(all, ic...)
		}
		for _, c := range all {
			c := c.(map[string]any)
			if !strings.Contains(fmt.Sprint(c["env"]), "name:NATS_CA value:/etc/aaas/nats-ca/ca.crt") {
				t.Errorf("%s container %s connects to NATS without NATS_CA", name, c["name"])
			}
		}
	}
}

func TestExposureVariantsAreDistinct(t *testing.T) {
	ingress := renderInstall(t, "manifests/exposure/ingress")
	sso := renderInstall(t, "manifests/exposure/gateway-api-sso")
	if _, ok := env(t, get(t, ingress, "Deployment", "aaas-edge"))["AUTH_PROXY_HEADER"]; ok {
		t.Fatal("the ingress variant trusts an identity header")
	}
	edgeEnv := env(t, get(t, sso, "Deployment", "aaas-edge"))
	if edgeEnv["AUTH_PROXY_HEADER"] != "X-Forwarded-User" || edgeEnv["AUTH_PROXY_ID_HEADER"] != "X-Forwarded-Email" {
		t.Fatal("the SSO variant does not take the identity, and the id it binds accounts to, from oauth2-proxy")
	}
	// Default deny: the edge admits a placeholder group, never everyone.
	if allow := edgeEnv["AUTH_PROXY_ALLOW"]; allow == "" || strings.Contains(allow, "*") {
		t.Fatalf("AUTH_PROXY_ALLOW %q: the SSO variant must name whom it admits", allow)
	}
	// oauth2-proxy restricts sign-in to an organisation and team and keeps
	// its session cookie off cross-site requests and plain HTTP.
	var args []string
	for _, a := range podSpec(t, get(t, sso, "Deployment", "oauth2-proxy"))["containers"].([]any)[0].(map[string]any)["args"].([]any) {
		args = append(args, a.(string))
	}
	for _, want := range []string{"--github-org=", "--github-team=", "--cookie-samesite=lax", "--cookie-secure=true", "--redirect-url=https://", "--cookie-name=__Host-"} {
		if !slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, want) }) {
			t.Errorf("oauth2-proxy lacks %s…: %v", want, args)
		}
	}
	// The edge serves only the public host names, which the operator sets
	// once in ConfigMap dsh-web (DSH reads them too).
	if !strings.Contains(fmt.Sprint(get(t, sso, "Deployment", "aaas-edge").Object), "trusted-hosts") {
		t.Error("PUBLIC_HOSTS does not come from ConfigMap dsh-web")
	}
	if len(manifests.Pick(sso, "Ingress")) != 0 {
		t.Fatal("the SSO variant has a second path to the edge")
	}
	get(t, sso, "NetworkPolicy", "aaas-edge-from-oauth2-proxy")
	get(t, ingress, "NetworkPolicy", "aaas-edge-ingress")
	route := get(t, sso, "HTTPRoute", "aaas")
	if !strings.Contains(fmt.Sprint(route.Object["spec"]), "oauth2-proxy") || strings.Contains(fmt.Sprint(route.Object["spec"]), "aaas-edge") {
		t.Fatal("the HTTPRoute must send everything to oauth2-proxy")
	}
	for _, objs := range [][]*unstructured.Unstructured{ingress, sso} {
		if typ, _, _ := unstructured.NestedString(get(t, objs, "Service", "aaas-edge").Object, "spec", "type"); typ != "ClusterIP" {
			t.Fatalf("edge Service type %s", typ)
		}
	}
}

// loadCompose loads compose.yaml as docker compose reads it, with the
// variables in env set and the others that move it (the ports, the kind
// node, the kubeconfig) at their defaults.
func loadCompose(t *testing.T, env map[string]string) *types.Project {
	t.Helper()
	dir := root(t)
	t.Setenv("HANDSHAKE_KEYS", testenv.HandshakeKey())
	for _, k := range []string{"EDGE_A_PORT", "EDGE_B_PORT", "KIND_NODE", "KIND_KUBECONFIG", "SIGNUP_INVITE_CODE"} {
		t.Setenv(k, env[k]) // empty: compose's default
	}
	opts, err := cli.NewProjectOptions([]string{filepath.Join(dir, "compose.yaml")}, cli.WithWorkingDirectory(dir), cli.WithOsEnv)
	if err != nil {
		t.Fatal(err)
	}
	p, err := opts.LoadProject(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// composeProcesses are compose's aaas services and the process kind
// (command, and so NATS identity) each runs.
var composeProcesses = map[string]natsauth.Role{
	"setup": natsauth.Setup, "edge-a": natsauth.Edge, "edge-b": natsauth.Edge,
	"lifecycle": natsauth.Lifecycle, "sweeper": natsauth.Sweeper, "broker": natsauth.Broker,
}

// envValue is the service's variable k, "" when unset.
func envValue(s types.ServiceConfig, k string) string {
	if v := s.Environment[k]; v != nil {
		return *v
	}
	return ""
}

// mountAt is the service's volume mounted at target.
func mountAt(s types.ServiceConfig, target string) *types.ServiceVolumeConfig {
	for i := range s.Volumes {
		if s.Volumes[i].Target == target {
			return &s.Volumes[i]
		}
	}
	return nil
}

// TestComposeFile: compose.yaml builds the image once, mounts nothing
// Docker would create on the host when it is missing, and runs every
// process kind of production with that kind's own NATS identity, none
// anonymously; the edges' ports are the variables kind-up publishes.
func TestComposeFile(t *testing.T) {
	dir := root(t)
	p := loadCompose(t, nil)
	for name := range composeProcesses {
		if _, ok := p.Services[name]; !ok {
			t.Errorf("no service %s", name)
		}
	}
	if s := p.Services["nats"]; s.Image != aaas.Version("NATS_IMAGE") {
		t.Fatalf("nats image %s, versions.env says %s", s.Image, aaas.Version("NATS_IMAGE"))
	}
	// One service builds aaas:dev and the others run it: compose builds
	// every service with build: in parallel, and the second to tag the
	// same image fails (notably with the containerd image store).
	var builders []string
	for name, s := range p.Services {
		if s.Build != nil {
			builders = append(builders, name)
		}
	}
	if len(builders) != 1 {
		t.Errorf("services with build: %v; one builds aaas:dev, the others name the image only", builders)
	}
	if b := p.Services["setup"].Build; b == nil || b.Context != dir || p.Services["setup"].Image != "aaas:dev" {
		t.Errorf("setup does not build aaas:dev from the Dockerfile: %+v", b)
	}
	covered := map[natsauth.Role]bool{}
	for name, s := range p.Services {
		if name == "nats" {
			continue
		}
		if s.Image != "aaas:dev" {
			t.Errorf("%s runs %s, not the image setup builds", name, s.Image)
		}
		if len(s.Entrypoint) != 1 {
			t.Errorf("%s runs %v", name, s.Entrypoint)
			continue
		}
		role := natsauth.Role(strings.TrimPrefix(s.Entrypoint[0], "/usr/local/bin/"))
		if want, ok := composeProcesses[name]; !ok || role != want {
			t.Errorf("%s runs %v, want %s's command", name, s.Entrypoint, want)
		}
		if envValue(s, "NATS_URL") != "nats://nats:4222" || envValue(s, "HANDSHAKE_KEYS") == "" {
			t.Errorf("%s environment %v", name, s.Environment)
		}
		// Its own identity, as production mounts it: the seed of its
		// kind and no other, and the CA that verifies NATS.
		if _, ok := s.Environment["NATS_ALLOW_ANONYMOUS"]; ok {
			t.Errorf("%s connects to NATS anonymously (NATS_ALLOW_ANONYMOUS)", name)
		}
		seed := "/etc/aaas/nats/" + string(role) + ".nk"
		if v := envValue(s, "NATS_NKEY"); v != seed {
			t.Errorf("%s: NATS_NKEY %q, want %s (the %s identity)", name, v, seed, role)
		}
		if v := envValue(s, "NATS_CA"); v != "/etc/aaas/nats-ca/ca.crt" {
			t.Errorf("%s does not verify NATS (NATS_CA %q)", name, v)
		}
		var seeds []string
		for _, v := range s.Volumes {
			if strings.HasSuffix(v.Source, ".nk") || strings.HasPrefix(v.Target, "/etc/aaas/nats/") {
				seeds = append(seeds, v.Source+":"+v.Target)
			}
		}
		if want := filepath.Join(dir, ".kind", "nats", string(role)+".nk") + ":" + seed; len(seeds) != 1 || seeds[0] != want {
			t.Errorf("%s mounts the seeds %v, want only %s", name, seeds, want)
		}
		if ca := mountAt(s, "/etc/aaas/nats-ca/ca.crt"); ca == nil || ca.Source != filepath.Join(dir, ".kind", "nats", "ca.crt") {
			t.Errorf("%s does not mount compose's NATS CA: %+v", name, ca)
		}
		covered[role] = true
	}
	for _, r := range natsauth.Roles {
		// The backup identity runs no service: an operator runs
		// `setup backup` with it when a copy is wanted.
		if !covered[r] && r != natsauth.Backup {
			t.Errorf("production's process kind %s has no service, and so no identity, in compose", r)
		}
	}
	// A bind mount whose source is missing must fail the start: with
	// create_host_path (short syntax's default) Docker creates an empty
	// directory there as root, as it did for .kind/kubeconfig when
	// compose-up ran before kind-up, and uid 65532 cannot read it.
	for name, s := range p.Services {
		for _, v := range s.Volumes {
			if v.Type == types.VolumeTypeBind && (v.Bind == nil || bool(v.Bind.CreateHostPath)) {
				t.Errorf("%s: bind mount of %s may create the host path", name, v.Source)
			}
			if v.Type == types.VolumeTypeBind && !v.ReadOnly {
				t.Errorf("%s: bind mount of %s is writable", name, v.Source)
			}
		}
	}
	lc := p.Services["lifecycle"]
	if kc := mountAt(lc, "/kube/config"); envValue(lc, "KUBECONFIG") != "/kube/config" || kc == nil || kc.Source != filepath.Join(dir, ".kind", "kubeconfig") {
		t.Errorf("lifecycle kubeconfig mount: %+v, KUBECONFIG %q", kc, envValue(lc, "KUBECONFIG"))
	}
	for name, s := range p.Services {
		if _, ok := s.Environment["KUBECONFIG"]; ok && name != "lifecycle" {
			t.Errorf("%s got Kubernetes credentials", name)
		}
	}
	// In the node's network: the edges and lifecycle reach pods and the
	// API server as in-cluster, the broker sees the sandboxes' addresses.
	for _, name := range []string{"edge-a", "edge-b", "lifecycle", "broker"} {
		if !strings.HasPrefix(p.Services[name].NetworkMode, "container:") {
			t.Errorf("%s does not share the kind node's network", name)
		}
	}
	// The edges' ports: kind-up's defaults, and wherever EDGE_A_PORT and
	// EDGE_B_PORT move them, the edges listen and take requests there.
	script, err := os.ReadFile(filepath.Join(dir, "hack", "kind-up.sh"))
	if err != nil {
		t.Fatal(err)
	}
	defaults := regexp.MustCompile(`: "\$\{EDGE_A_PORT:=(\d+)\}" "\$\{EDGE_B_PORT:=(\d+)\}"`).FindStringSubmatch(string(script))
	if defaults == nil {
		t.Fatal("hack/kind-up.sh does not default EDGE_A_PORT and EDGE_B_PORT")
	}
	for _, c := range []struct{ a, b string }{{"", ""}, {"9000", "9001"}} {
		want := map[string]string{"edge-a": defaults[1], "edge-b": defaults[2]}
		if c.a != "" {
			want = map[string]string{"edge-a": c.a, "edge-b": c.b}
		}
		p := loadCompose(t, map[string]string{"EDGE_A_PORT": c.a, "EDGE_B_PORT": c.b})
		for name, port := range want {
			s := p.Services[name]
			listen, hosts, domain := envValue(s, "LISTEN_ADDR"), envValue(s, "PUBLIC_HOSTS"), envValue(s, "SANDBOX_DOMAIN")
			if listen != ":"+port || hosts != "localhost:"+port+",127.0.0.1:"+port || domain != "localhost:"+port {
				t.Errorf("EDGE_A_PORT=%q EDGE_B_PORT=%q: %s listens on %s for %s, sandboxes at %s; want port %s",
					c.a, c.b, name, listen, hosts, domain, port)
			}
		}
	}
}

// TestComposeKindUp: hack/kind-up.sh loads images in the way that works
// under Docker's containerd image store (kind#3795) and creates the node
// from the pinned Kubernetes version. (No test runs it: kind's node image
// cannot be had here.)
func TestComposeKindUp(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root(t), "hack", "kind-up.sh"))
	if err != nil {
		t.Fatal(err)
	}
	var code []string // the commands, not the comments that say why
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			code = append(code, line)
		}
	}
	script := strings.Join(code, "\n")
	if strings.Contains(script, "kind load docker-image") || !strings.Contains(script, "kind load image-archive") {
		t.Error("kind-up.sh must load a docker save archive (kind load image-archive), not kind load docker-image")
	}
	if !strings.Contains(script, `image="kindest/node:${KUBERNETES_VERSION}"`) || !regexp.MustCompile(`kind create cluster .*--image "\$image"`).MatchString(script) {
		t.Error("kind-up.sh does not create the node from kindest/node:$KUBERNETES_VERSION")
	}
}

// redirect dials addr whatever address it is asked for: a client keeps
// compose's URL, and so verifies the certificate for the name "nats".
type redirect string

func (r redirect) Dial(network, _ string) (net.Conn, error) { return net.Dial(network, string(r)) }

// TestComposeNATS starts compose's NATS from its own configuration, laid
// out as the nats service mounts it over the credentials `natsauth
// -compose` writes (as make kind-up runs it, under a umask of 077). Each
// service's seed is a user of it with exactly its process kind's row of
// the permission table (internal/natsauth), and connects over TLS
// verified for "nats"; a client without an identity is refused. The
// users are production's, line for line.
func TestComposeNATS(t *testing.T) {
	dir := root(t)
	p := loadCompose(t, nil)
	tmp := t.TempDir()
	tool := filepath.Join(tmp, "natsauth")
	if out, err := exec.Command("go", "build", "-o", tool, filepath.Join(dir, "hack", "natsauth")).CombinedOutput(); err != nil {
		t.Fatalf("go build hack/natsauth: %v\n%s", err, out)
	}
	creds := filepath.Join(tmp, "kind", "nats")
	if out, err := exec.Command("sh", "-c", `umask 077 && exec "$0" -compose "$1"`, tool, creds).CombinedOutput(); err != nil {
		t.Fatalf("natsauth -compose: %v\n%s", err, out)
	}
	// uid 65532 reads each file by its own mode; the directory keeps them
	// from the host's other users.
	if fi, err := os.Stat(creds); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("%s: %v %v, want a 0700 directory", creds, fi.Mode(), err)
	}
	entries, err := os.ReadDir(creds)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if fi, err := e.Info(); err != nil || fi.Mode().Perm() != 0o644 {
			t.Errorf("%s: mode %v (%v), want 0644", e.Name(), fi.Mode(), err)
		}
	}
	if out, err := exec.Command(tool, "-compose", creds).CombinedOutput(); err == nil {
		t.Errorf("natsauth -compose replaced the credentials of a running compose: %s", out)
	}
	// host is where a bind mount's source is: .kind/nats is the set just made.
	host := func(src string) string {
		if rel, ok := strings.CutPrefix(src, filepath.Join(dir, ".kind", "nats")+string(filepath.Separator)); ok {
			return filepath.Join(creds, rel)
		}
		return src
	}

	// The nats container's files under croot; the paths its configuration
	// names move with them.
	ns := p.Services["nats"]
	croot := filepath.Join(tmp, "nats-container")
	var moves []string
	for _, v := range ns.Volumes {
		moves = append(moves, v.Target, filepath.Join(croot, v.Target))
	}
	move := strings.NewReplacer(moves...)
	for _, v := range ns.Volumes {
		dst := filepath.Join(croot, v.Target)
		if v.Type != types.VolumeTypeBind { // the store
			if err := os.MkdirAll(dst, 0o700); err != nil {
				t.Fatal(err)
			}
			continue
		}
		b, err := os.ReadFile(host(v.Source))
		if err != nil {
			t.Fatalf("nats mounts %s: %v", v.Source, err)
		}
		if strings.HasSuffix(v.Target, ".conf") {
			b = []byte(move.Replace(string(b)))
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if len(ns.Command) != 2 || ns.Command[0] != "--config" {
		t.Fatalf("nats runs %v, not one configuration file", ns.Command)
	}
	conf := filepath.Join(croot, ns.Command[1])

	users := regexp.MustCompile(`(?ms)^authorization \{\n.*?^\}`)
	prod, err := os.ReadFile(filepath.Join(dir, "manifests", "base", "nats", "nats.conf"))
	if err != nil {
		t.Fatal(err)
	}
	compose, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	if a, b := users.FindString(string(compose)), users.FindString(string(prod)); a == "" || a != b {
		t.Errorf("compose's NATS users are not production's:\n%s\nproduction:\n%s", a, b)
	}

	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		t.Fatalf("compose's NATS configuration: %v", err)
	}
	if len(opts.Users) != 0 || opts.NoAuthUser != "" || opts.Username != "" || opts.Authorization != "" {
		t.Errorf("compose's NATS has users without an nkey: %v %q", opts.Users, opts.NoAuthUser)
	}
	if opts.TLSConfig == nil {
		t.Error("compose's NATS takes plaintext clients")
	}
	nkeyUsers := map[string]*server.NkeyUser{}
	for _, u := range opts.Nkeys {
		nkeyUsers[u.Nkey] = u
	}
	// Each process kind's current and staged next identity.
	if len(nkeyUsers) != 2*len(natsauth.Roles) {
		t.Errorf("compose's NATS has %d users, production's process kinds are %v, each with two keys", len(nkeyUsers), natsauth.Roles)
	}
	opts.Host, opts.Port, opts.HTTPPort, opts.NoLog, opts.NoSigs = "127.0.0.1", -1, 0, true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(30 * time.Second) {
		t.Fatal("compose's NATS did not start")
	}
	dial := nats.SetCustomDialer(redirect(srv.Addr().String()))

	for _, name := range slices.Sorted(maps.Keys(composeProcesses)) {
		role, s := composeProcesses[name], p.Services[name]
		// file is the host file of the variable's path in the container.
		file := func(env string) string {
			if m := mountAt(s, envValue(s, env)); m != nil {
				return host(m.Source)
			}
			return ""
		}
		seed, ca := file("NATS_NKEY"), file("NATS_CA")
		if seed == "" || ca == "" {
			t.Errorf("%s has no seed or no CA mounted where NATS_NKEY and NATS_CA say (TestComposeFile tells more)", name)
			continue
		}
		b, err := os.ReadFile(seed)
		if err != nil {
			t.Fatal(err)
		}
		kp, err := nkeys.FromSeed(b)
		if err != nil {
			t.Fatalf("%s: %s: %v", name, seed, err)
		}
		pub, _ := kp.PublicKey()
		u := nkeyUsers[pub]
		if u == nil {
			t.Errorf("%s's identity is not a user of compose's NATS", name)
			continue
		}
		want := role.Permissions()
		if u.Permissions == nil || !slices.Equal(u.Permissions.Publish.Allow, want.Publish) || !slices.Equal(u.Permissions.Subscribe.Allow, want.Subscribe) {
			t.Errorf("%s's identity is not granted the %s row of the table: %+v", name, role, u.Permissions)
		}
		opt, err := nats.NkeyOptionFromSeed(seed)
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(envValue(s, "NATS_URL"), opt, nats.RootCAs(ca), dial, nats.CustomInboxPrefix(role.InboxPrefix()))
		if err != nil {
			t.Errorf("%s cannot connect to compose's NATS: %v", name, err)
			continue
		}
		nc.Close()
	}
	if nc, err := nats.Connect("nats://nats:4222", nats.RootCAs(filepath.Join(creds, "ca.crt")), dial); !errors.Is(err, nats.ErrAuthorization) {
		if nc != nil {
			nc.Close()
		}
		t.Errorf("compose's NATS, to a client without an identity: %v, want an authorization violation", err)
	}
}

// dockerStage is what a Dockerfile stage puts in its image.
type dockerStage struct {
	files      []string
	user       string
	entrypoint []string
	labels     map[string]string
}

// dockerStages reads the stages of a Dockerfile by name (the last one also
// as ""): the files each COPY --from=build adds, USER and ENTRYPOINT.
func dockerStages(t *testing.T, df string) map[string]*dockerStage {
	t.Helper()
	stages := map[string]*dockerStage{}
	var cur *dockerStage
	labels := regexp.MustCompile(`([\w.-]+)="([^"]*)"`)
	for _, line := range strings.Split(strings.ReplaceAll(df, "\\\n", " "), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) == 0:
		case f[0] == "FROM":
			cur = &dockerStage{}
			if len(f) == 4 && strings.EqualFold(f[2], "AS") {
				stages[f[3]] = cur
			}
			stages[""] = cur
		case f[0] == "COPY" && len(f) >= 4 && f[1] == "--from=build":
			dst := f[len(f)-1]
			for _, src := range f[2 : len(f)-1] {
				if strings.HasSuffix(dst, "/") {
					cur.files = append(cur.files, dst+filepath.Base(src))
				} else {
					cur.files = append(cur.files, dst)
				}
			}
		case f[0] == "USER":
			cur.user = f[1]
		case f[0] == "LABEL":
			cur.labels = map[string]string{}
			for _, m := range labels.FindAllStringSubmatch(line, -1) {
				cur.labels[m[1]] = m[2]
			}
		case f[0] == "ENTRYPOINT":
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "ENTRYPOINT ")), &cur.entrypoint); err != nil {
				t.Fatalf("ENTRYPOINT %q: %v", line, err)
			}
		}
	}
	return stages
}

// TestDockerfile checks the Dockerfile's build and that its images are the
// ones hack/image builds without Docker (the real-node tests run those):
// the same files, the same numeric user, the same entrypoint.
func TestDockerfile(t *testing.T) {
	dir := root(t)
	b, err := os.ReadFile(filepath.Join(dir, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	gomod, _ := os.ReadFile(filepath.Join(dir, "go.mod"))
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(string(gomod))[1]
	if !regexp.MustCompile(`(?m)^FROM golang:` + regexp.QuoteMeta(goVersion) + `\.\d+-bookworm@sha256:[0-9a-f]{64} AS build$`).MatchString(df) {
		t.Fatalf("Dockerfile does not build with go %s (a golang:%s.N image pinned by digest)", goVersion, goVersion)
	}
	if !strings.Contains(df, "CGO_ENABLED=0") {
		t.Fatal("the binaries are not static")
	}
	stages := dockerStages(t, df)
	for name, spec := range map[string]image.Spec{"": image.AAAS("/bin", "aaas"), "dshsim": image.DSHSim("/bin", "dshsim")} {
		st := stages[name]
		if st == nil {
			t.Fatalf("no stage %q in the Dockerfile", name)
		}
		var want []string
		for f := range spec.Files {
			want = append(want, f)
		}
		slices.Sort(want)
		slices.Sort(st.files)
		for k := range spec.Labels {
			if _, ok := st.labels[k]; !ok {
				t.Errorf("stage %q: hack/image labels the image %s, the Dockerfile does not", name, k)
			}
		}
		if len(st.labels) != len(spec.Labels) {
			t.Errorf("stage %q: Dockerfile labels %v, hack/image %v", name, st.labels, spec.Labels)
		}
		if !slices.Equal(st.files, want) || st.user != spec.User || !slices.Equal(st.entrypoint, spec.Entrypoint) {
			t.Errorf("stage %q: Dockerfile has files %v, user %q, entrypoint %v; hack/image builds %v, %q, %v",
				name, st.files, st.user, st.entrypoint, want, spec.User, spec.Entrypoint)
		}
		if !regexp.MustCompile(`^\d+:\d+$`).MatchString(st.user) {
			t.Errorf("stage %q runs as %q: the kubelet can verify runAsNonRoot only for a numeric user", name, st.user)
		}
	}
	cmds, _ := filepath.Glob(filepath.Join(dir, "cmd", "*"))
	for _, c := range cmds {
		name := filepath.Base(c)
		if name == "devstack" {
			continue // the local stack is not shipped
		}
		if !strings.Contains(df, "./cmd/"+name) {
			t.Errorf("the Dockerfile does not build %s", name)
		}
	}
}

// TestMakeRun starts `make run` as a newcomer would (on free ports),
// signs up on both edges, and stops it with Ctrl-C.
func TestMakeRun(t *testing.T) {
	devclustertest.Need(t, cluster) // make run starts one
	dir := root(t)
	nats, _ := embednats.FreePort()
	a, _ := embednats.FreePort()
	b, _ := embednats.FreePort()
	state := t.TempDir()
	cmd := exec.Command("make", "-s", "run", fmt.Sprintf("RUN_ARGS=-state %s -nats-port %d -edge-ports %d,%d -metrics-port 0", state, nats, a, b))
	cmd.Dir = dir
	// Settings come from the environment, as README documents them.
	const invite = "from-the-environment"
	cmd.Env = append(os.Environ(), "SIGNUP_INVITE_CODE="+invite, "AUTH_RATE_LIMIT=1000")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) })
	lines := make(chan string, 100)
	go func() {
		s := bufio.NewScanner(out)
		for s.Scan() {
			lines <- s.Text()
		}
		close(lines)
	}()
	var printed string
	var log []string
	deadline := time.After(4 * time.Minute)
	for ready := false; !ready; {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("make run ended early:\n%s", strings.Join(log, "\n"))
			}
			log = append(log, l)
			if f := strings.Fields(l); len(f) == 2 && f[0] == "invite" {
				printed = f[1]
			}
			ready = strings.HasPrefix(l, "ready in")
		case <-deadline:
			t.Fatalf("make run not ready after 4 minutes:\n%s", strings.Join(log, "\n"))
		}
	}
	t.Logf("make run ready")
	if printed != invite {
		t.Fatalf("make run printed invite %q, the environment said %q", printed, invite)
	}
	for i, port := range []int{a, b} {
		if want := fmt.Sprintf("sandboxes at http://<user>.localhost:%d/", port); !slices.ContainsFunc(log, func(l string) bool { return strings.Contains(l, want) }) {
			t.Fatalf("make run does not say %q:\n%s", want, strings.Join(log, "\n"))
		}
		c := testenv.NewClient(t, fmt.Sprintf("http://localhost:%d", port))
		if r := c.Do("GET", "/", nil); r.StatusCode != 200 || !strings.Contains(string(r.Body), "Create your sandbox") {
			t.Fatalf("landing page on %d: %d", port, r.StatusCode)
		}
		user := fmt.Sprintf("newcomer%d", i)
		token := c.Signup(user, invite)
		// Each sandbox on its own origin: the gateway sends /u/<user>/
		// there, and a bearer token reaches the sandbox on it (browsers
		// resolve *.localhost to this machine; this client dials it).
		origin := fmt.Sprintf("http://%s.localhost:%d", user, port)
		if r := c.Do("GET", "/u/"+user+"/api/files", nil); r.StatusCode != http.StatusMovedPermanently || r.Header.Get("Location") != origin+"/api/files" {
			t.Fatalf("/u/%s/ on the gateway: %d to %q, want 301 to %s/api/files", user, r.StatusCode, r.Header.Get("Location"), origin)
		}
		sandbox := testenv.NewClient(t, origin)
		d := &net.Dialer{Timeout: 10 * time.Second}
		sandbox.HTTP.Transport = &http.Transport{DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, fmt.Sprintf("127.0.0.1:%d", port))
		}}
		if r := sandbox.Do("GET", "/api/files", nil, "Authorization", "Bearer "+token); r.StatusCode != 200 {
			t.Fatalf("sandbox of %s on its origin: %d %s", user, r.StatusCode, r.Body)
		}
	}
	t.Logf("signed up on both edges")
	if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		for l := range lines {
			log = append(log, l)
		}
		done <- cmd.Wait()
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatalf("make run did not stop:\n%s", strings.Join(log, "\n"))
	}
	t.Logf("stopped")
	if !contains(log, "stopping…") {
		t.Fatalf("no clean stop:\n%s", strings.Join(log, "\n"))
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if out, _ := exec.Command("pgrep", "-f", state).Output(); len(out) > 0 {
			return fmt.Errorf("processes survived: %s", out)
		}
		return nil
	})
}

// TestPodsRunAsNumericUsers: the kubelet refuses runAsNonRoot for an image
// whose user is a name (CreateContainerConfigError) and copies no group
// from a numeric one, so every pod that asks for runAsNonRoot names its
// user and group by number, and the aaas ones match the image's.
func TestPodsRunAsNumericUsers(t *testing.T) {
	objs := renderInstall(t, "manifests/exposure/gateway-api-sso")
	for _, kind := range []string{"Deployment", "StatefulSet"} {
		for _, o := range manifests.Pick(objs, kind) {
			sc, _, _ := unstructured.NestedMap(o.Object, "spec", "template", "spec", "securityContext")
			user, hasUser := sc["runAsUser"].(int64)
			group, hasGroup := sc["runAsGroup"].(int64)
			if sc["runAsNonRoot"] != true || !hasUser || !hasGroup || user == 0 || group == 0 {
				t.Errorf("%s %s: securityContext %v wants runAsNonRoot with a numeric runAsUser and runAsGroup", kind, o.GetName(), sc)
			}
			if strings.HasPrefix(o.GetName(), "aaas-") && fmt.Sprintf("%d:%d", user, group) != image.NonRoot {
				t.Errorf("%s %s runs as %d:%d, the image as %s", kind, o.GetName(), user, group, image.NonRoot)
			}
		}
	}
}

// TestSandboxTemplateStartsTheStandIn: the template's command line is DSH
// Web's (`web --host 0.0.0.0 --port 3080`), and the DSH stand-in the kind
// overlay and the real-node tests run accepts it and listens on the
// template's port.
func TestSandboxTemplateStartsTheStandIn(t *testing.T) {
	for _, dir := range []string{"manifests/sandbox", "manifests/dev/kind"} {
		objs, err := manifests.Render(dir)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := get(t, objs, "SandboxTemplate", "dsh-web")
		containers, _, _ := unstructured.NestedSlice(tmpl.Object, "spec", "podTemplate", "spec", "containers")
		c := containers[0].(map[string]any)
		if _, ok := c["command"]; ok {
			t.Fatalf("%s overrides the image's entrypoint: %v", dir, c["command"])
		}
		var args []string
		for _, a := range c["args"].([]any) {
			args = append(args, a.(string))
		}
		o, err := dshsim.OptionsFromEnv(args, func(string) string { return "" })
		if err != nil {
			t.Fatalf("%s: dshsim refuses the template's args %q: %v", dir, args, err)
		}
		port := c["ports"].([]any)[0].(map[string]any)["containerPort"].(int64)
		if o.Listen != fmt.Sprintf("0.0.0.0:%d", port) {
			t.Fatalf("%s: dshsim would listen on %s, the template expects %d", dir, o.Listen, port)
		}
		if dir == "manifests/dev/kind" && c["image"] != "dshsim:dev" {
			t.Fatalf("the kind overlay runs %v", c["image"])
		}
	}
}

// TestToolsArePinnedWhereVersionsSayIt: the tools modules build the
// versions versions.env names (the tools cache is keyed by them).
func TestToolsArePinnedWhereVersionsSayIt(t *testing.T) {
	dir := root(t)
	for mod, want := range map[string]string{
		"kubernetes":    "k8s.io/kubernetes " + aaas.Version("KUBERNETES_VERSION"),
		"agent-sandbox": "sigs.k8s.io/agent-sandbox " + aaas.Version("AGENT_SANDBOX_VERSION"),
		"staticcheck":   "honnef.co/go/tools " + aaas.Version("STATICCHECK_VERSION"),
		"kube-router":   "github.com/cloudnativelabs/kube-router/v2 " + aaas.Version("KUBE_ROUTER_VERSION"),
		"coredns":       "github.com/coredns/coredns " + aaas.Version("COREDNS_VERSION"),
		"helm":          "helm.sh/helm/v4 " + aaas.Version("HELM_VERSION"),
		"traefik":       "github.com/traefik/traefik/v3 " + aaas.Version("TRAEFIK_VERSION"),
		"oauth2-proxy":  "github.com/oauth2-proxy/oauth2-proxy/v7 " + aaas.Version("OAUTH2_PROXY_VERSION"),
		"oidcop":        "github.com/zitadel/oidc/v3 " + aaas.Version("ZITADEL_OIDC_VERSION"),
		"compose":       "github.com/docker/compose/v2 " + aaas.Version("COMPOSE_VERSION"),
	} {
		b, err := os.ReadFile(filepath.Join(dir, "hack", "tools", mod, "go.mod"))
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`(?m)^\s*(require\s+)?` + regexp.QuoteMeta(want) + `\s*$`).Match(b) {
			t.Errorf("hack/tools/%s/go.mod does not require %s", mod, want)
		}
	}
}

// TestSandboxOriginsAreExposed: the documented install (README's
// kustomization and commands, the ingress exposure) serves the sandboxes'
// wildcard: ConfigMap dsh-web names SANDBOX_DOMAIN, which the edge must
// read (no silent path mode), the Ingress routes *.<that domain> to the
// edge with its own certificate's Secret, README's patch renames that
// rule and its TLS entry alike, and the template sets DSH_TRUSTED_HOSTS
// only where a ConfigMap in the tenants' namespace says so (path mode),
// which the documented install does not create. The SSO variant routes the
// wildcard alike.
func TestSandboxOriginsAreExposed(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	m := regexp.MustCompile(`kubectl -n aaas create configmap dsh-web --from-literal=trusted-hosts=(\S+) --from-literal=sandbox-domain=(\S+)\n`).FindStringSubmatch(readme)
	if m == nil {
		t.Fatal("README's install does not create ConfigMap dsh-web with trusted-hosts and sandbox-domain")
	}
	gateway, domain := m[1], m[2]
	if strings.Contains(readme, "kubectl -n aaas-sandboxes create configmap dsh-web") {
		t.Fatal("README's install gives DSH trusted hosts, which sandbox origins do without")
	}
	for _, want := range []string{"path: /spec/rules/1/host\n        value: \"*." + domain + "\"", "path: /spec/tls/1/hosts/0\n        value: \"*." + domain + "\""} {
		if !strings.Contains(readme, want) {
			t.Errorf("README's kustomization does not patch %q", want)
		}
	}

	objs := renderInstall(t, "manifests/exposure/ingress")
	ing := get(t, objs, "Ingress", "aaas")
	rules, _, _ := unstructured.NestedSlice(ing.Object, "spec", "rules")
	tls, _, _ := unstructured.NestedSlice(ing.Object, "spec", "tls")
	if len(rules) != 2 || len(tls) != 2 {
		t.Fatalf("the Ingress has %d rules and %d TLS entries, want the gateway's and the sandboxes'", len(rules), len(tls))
	}
	for i, want := range []struct{ host, secret string }{{gateway, "aaas-tls"}, {"*." + domain, "aaas-sandboxes-tls"}} {
		r := rules[i].(map[string]any)
		backend := fmt.Sprint(r["http"])
		if r["host"] != want.host || !strings.Contains(backend, "name:aaas-edge") {
			t.Errorf("rule %d: host %v to %s, want %s to aaas-edge", i, r["host"], backend, want.host)
		}
		e := tls[i].(map[string]any)
		if fmt.Sprint(e["hosts"]) != "["+want.host+"]" || e["secretName"] != want.secret {
			t.Errorf("TLS entry %d: %v in %v, want %s in %s", i, e["hosts"], e["secretName"], want.host, want.secret)
		}
	}

	containers, _, _ := unstructured.NestedSlice(get(t, objs, "Deployment", "aaas-edge").Object, "spec", "template", "spec", "containers")
	var ref map[string]any
	for _, e := range containers[0].(map[string]any)["env"].([]any) {
		if e := e.(map[string]any); e["name"] == "SANDBOX_DOMAIN" {
			ref, _, _ = unstructured.NestedMap(e, "valueFrom", "configMapKeyRef")
		}
	}
	if ref["name"] != "dsh-web" || ref["key"] != "sandbox-domain" || ref["optional"] == true {
		t.Fatalf("the edge's SANDBOX_DOMAIN comes from %v, want ConfigMap dsh-web's sandbox-domain, required", ref)
	}

	// The SSO variant: the wildcard has a listener with its own Secret and
	// a route of its own to the edge, naming nothing but the wildcard (the
	// gateway's host still goes only through oauth2-proxy).
	sso := renderInstall(t, "manifests/exposure/gateway-api-sso")
	listeners, _, _ := unstructured.NestedSlice(get(t, sso, "Gateway", "aaas").Object, "spec", "listeners")
	if len(listeners) != 2 || !strings.Contains(fmt.Sprint(listeners[1]), "hostname:*.sandboxes.aaas.example.com") || !strings.Contains(fmt.Sprint(listeners[1]), "name:aaas-sandboxes-tls") {
		t.Fatalf("the Gateway's listeners: %v", listeners)
	}
	route := get(t, sso, "HTTPRoute", "aaas-sandboxes")
	if hosts, _, _ := unstructured.NestedStringSlice(route.Object, "spec", "hostnames"); fmt.Sprint(hosts) != "[*.sandboxes.aaas.example.com]" || !strings.Contains(fmt.Sprint(route.Object["spec"]), "name:aaas-edge") {
		t.Fatalf("HTTPRoute aaas-sandboxes: %v", route.Object["spec"])
	}
	get(t, sso, "NetworkPolicy", "aaas-edge-from-gateway")

	tmpl := get(t, objs, "SandboxTemplate", "dsh-web")
	tc, _, _ := unstructured.NestedSlice(tmpl.Object, "spec", "podTemplate", "spec", "containers")
	for _, e := range tc[0].(map[string]any)["env"].([]any) {
		if e := e.(map[string]any); e["name"] == "DSH_TRUSTED_HOSTS" {
			r, _, _ := unstructured.NestedMap(e, "valueFrom", "configMapKeyRef")
			if r["name"] != "dsh-web" || r["optional"] != true || e["value"] != nil {
				t.Fatalf("DSH_TRUSTED_HOSTS: %v, want ConfigMap dsh-web's trusted-hosts, optional", e)
			}
		}
	}
}

// TestNoSandboxHoldsAProviderKey: whatever an operator composes, the pods
// tenants run get no Secret at all (no envFrom, no secretKeyRef, no secret
// or projected volume), every provider base URL the template sets is the
// broker's Service and every provider key variable the worthless
// placeholder; the provider-key Secret is mounted by the broker and by no
// other workload (security review S18, invariant 13).
func TestNoSandboxHoldsAProviderKey(t *testing.T) {
	renders := map[string][]*unstructured.Unstructured{}
	dirs, err := manifests.Overlays()
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range dirs {
		objs, err := manifests.Render(dir)
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		renders[dir] = objs
	}
	components, err := manifests.Components()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range components {
		renders["base + sandbox + "+c] = renderInstall(t, c)
	}
	templates := 0
	for what, objs := range renders {
		for _, tmpl := range manifests.Pick(objs, "SandboxTemplate") {
			templates++
			spec, _, _ := unstructured.NestedMap(tmpl.Object, "spec", "podTemplate", "spec")
			if leak := secretsIn(spec); len(leak) > 0 {
				t.Errorf("%s: SandboxTemplate %s gives its pods Secrets: %v", what, tmpl.GetName(), leak)
			}
			urls := 0
			for _, c := range containersOf(spec) {
				for _, e := range c["env"].([]any) {
					e := e.(map[string]any)
					name, value := e["name"].(string), e["value"]
					switch {
					case strings.HasSuffix(name, "_API_KEY") && value != "aaas-broker":
						t.Errorf("%s: %s=%v in the sandbox, want the placeholder aaas-broker", what, name, value)
					case strings.HasSuffix(name, "_BASE_URL"):
						urls++
						if v, _ := value.(string); !strings.HasPrefix(v, "http://aaas-broker."+controlNS+".svc:8090/") {
							t.Errorf("%s: %s=%v in the sandbox, want the broker's Service", what, name, value)
						}
					}
				}
			}
			if urls == 0 {
				t.Errorf("%s: SandboxTemplate %s points no provider at the broker", what, tmpl.GetName())
			}
		}
		for _, kind := range []string{"Deployment", "StatefulSet", "DaemonSet", "Job"} {
			for _, w := range manifests.Pick(objs, kind) {
				spec, _, _ := unstructured.NestedMap(w.Object, "spec", "template", "spec")
				for _, s := range secretsIn(spec) {
					if s == "aaas-provider-keys" && w.GetName() != "aaas-broker" {
						t.Errorf("%s: %s %s mounts the provider keys", what, kind, w.GetName())
					}
				}
			}
		}
	}
	if templates == 0 {
		t.Fatal("no SandboxTemplate rendered")
	}
}

// secretsIn lists the Secrets a pod spec hands its containers.
func secretsIn(spec map[string]any) []string {
	var names []string
	for _, c := range containersOf(spec) {
		for _, f := range asList(c["envFrom"]) {
			if ref, ok := f.(map[string]any)["secretRef"].(map[string]any); ok {
				names = append(names, fmt.Sprint(ref["name"]))
			}
		}
		for _, e := range asList(c["env"]) {
			if ref, ok, _ := unstructured.NestedMap(e.(map[string]any), "valueFrom", "secretKeyRef"); ok {
				names = append(names, fmt.Sprint(ref["name"]))
			}
		}
	}
	for _, v := range asList(spec["volumes"]) {
		v := v.(map[string]any)
		if s, ok := v["secret"].(map[string]any); ok {
			names = append(names, fmt.Sprint(s["secretName"]))
		}
		if p, ok := v["projected"].(map[string]any); ok {
			for _, src := range asList(p["sources"]) {
				if s, ok := src.(map[string]any)["secret"].(map[string]any); ok {
					names = append(names, fmt.Sprint(s["name"]))
				}
			}
		}
	}
	return names
}

func containersOf(spec map[string]any) []map[string]any {
	var cs []map[string]any
	for _, key := range []string{"initContainers", "containers"} {
		for _, c := range asList(spec[key]) {
			cs = append(cs, c.(map[string]any))
		}
	}
	return cs
}

func asList(v any) []any { l, _ := v.([]any); return l }
