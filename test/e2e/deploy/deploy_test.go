// Package deploy tests what operators and developers deploy: every
// kustomize overlay against devcluster's API server (server-side dry-run),
// the security properties of the rendered objects, compose.yaml, the
// Dockerfile, and `make run` as a newcomer runs it.
package deploy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/devcluster"
	"github.com/aaas-project/aaas/internal/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dshsim"
	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/image"
	"github.com/aaas-project/aaas/internal/manifests"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
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

// install is an operator's kustomization of base and sandbox with the
// given components (as README shows it).
func install(components ...string) string {
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: dsh-demo\nresources:\n" +
		"  - " + manifests.Source + "base\n  - " + manifests.Source + "sandbox\ncomponents:\n"
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
	ctx := testenv.Context(t, 5*time.Minute)
	if err := cluster.InstallGatewayAPI(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cluster.InstallPrometheusOperatorCRDs(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cluster.CreateNamespace(ctx, "dsh-demo"); err != nil {
		t.Fatal(err)
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
		if err := cluster.ApplyWith(ctx, "dsh-demo", devcluster.ApplyOptions{DryRun: true}, objs...); err != nil {
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
		if n := len(manifests.Pick(objs, "Namespace")); n != 1 {
			t.Fatalf("%d Namespaces", n)
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

func TestBaseKeepsKubernetesRightsToLifecycle(t *testing.T) {
	objs, err := manifests.Render("manifests/base")
	if err != nil {
		t.Fatal(err)
	}
	if n := len(manifests.Pick(objs, "Role")); n != 1 {
		t.Fatalf("%d Roles in base, want only lifecycle's", n)
	}
	lc := get(t, objs, "Deployment", "aaas-lifecycle")
	if sa := podSpec(t, lc)["serviceAccountName"]; sa != "aaas-lifecycle" {
		t.Fatalf("lifecycle runs as %v", sa)
	}
	rb := get(t, objs, "RoleBinding", "aaas-lifecycle")
	subjects, _, _ := unstructured.NestedSlice(rb.Object, "subjects")
	if s := subjects[0].(map[string]any); s["name"] != "aaas-lifecycle" || s["namespace"] != "dsh-demo" {
		t.Fatalf("RoleBinding subject %v", s)
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

func TestComposeFile(t *testing.T) {
	dir := root(t)
	t.Setenv("HANDSHAKE_KEYS", testenv.HandshakeKey())
	opts, err := cli.NewProjectOptions([]string{filepath.Join(dir, "compose.yaml")}, cli.WithWorkingDirectory(dir), cli.WithOsEnv)
	if err != nil {
		t.Fatal(err)
	}
	p, err := opts.LoadProject(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"nats": "", "setup": "setup", "edge-a": "edge", "edge-b": "edge", "lifecycle": "lifecycle", "sweeper": "sweeper"}
	if len(p.Services) != len(want) {
		t.Fatalf("services %v", p.ServiceNames())
	}
	for name, bin := range want {
		s, ok := p.Services[name]
		if !ok {
			t.Fatalf("no service %s", name)
		}
		if name == "nats" {
			if s.Image != aaas.Version("NATS_IMAGE") {
				t.Fatalf("nats image %s, versions.env says %s", s.Image, aaas.Version("NATS_IMAGE"))
			}
			continue
		}
		if s.Build == nil || s.Build.Context != dir || s.Image != "aaas:dev" {
			t.Fatalf("%s is not built from the Dockerfile: %+v %s", name, s.Build, s.Image)
		}
		if len(s.Entrypoint) != 1 || s.Entrypoint[0] != "/usr/local/bin/"+bin {
			t.Fatalf("%s runs %v", name, s.Entrypoint)
		}
		if *s.Environment["NATS_URL"] != "nats://nats:4222" || s.Environment["HANDSHAKE_KEYS"] == nil {
			t.Fatalf("%s environment %v", name, s.Environment)
		}
	}
	if a, b := *p.Services["edge-a"].Environment["LISTEN_ADDR"], *p.Services["edge-b"].Environment["LISTEN_ADDR"]; a != ":8080" || b != ":8081" {
		t.Fatalf("edges listen on %s and %s", a, b)
	}
	lc := p.Services["lifecycle"]
	if *lc.Environment["KUBECONFIG"] != "/kube/config" || len(lc.Volumes) != 1 || lc.Volumes[0].Target != "/kube/config" || !lc.Volumes[0].ReadOnly {
		t.Fatalf("lifecycle kubeconfig mount: %+v %v", lc.Volumes, lc.Environment["KUBECONFIG"])
	}
	for _, name := range []string{"edge-a", "edge-b", "lifecycle"} {
		if !strings.HasPrefix(p.Services[name].NetworkMode, "container:") {
			t.Fatalf("%s does not share the kind node's network", name)
		}
	}
	if _, ok := p.Services["sweeper"].Environment["KUBECONFIG"]; ok {
		t.Fatal("the sweeper got Kubernetes credentials")
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
	if !strings.Contains(df, "ARG GO_VERSION="+goVersion) {
		t.Fatalf("Dockerfile does not build with go %s", goVersion)
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
		c := testenv.NewClient(t, fmt.Sprintf("http://localhost:%d", port))
		if r := c.Do("GET", "/", nil); r.StatusCode != 200 || !strings.Contains(string(r.Body), "Create your sandbox") {
			t.Fatalf("landing page on %d: %d", port, r.StatusCode)
		}
		user := fmt.Sprintf("newcomer%d", i)
		c.Signup(user, invite)
		if r := c.Do("GET", "/u/"+user+"/api/files", nil); r.StatusCode != 200 {
			t.Fatalf("sandbox of %s: %d %s", user, r.StatusCode, r.Body)
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
