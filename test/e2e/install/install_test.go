// Package install_test is the deployment tier: it installs aaas exactly as
// README.md tells operators (agent-sandbox's release, the namespace, the
// Secret and ConfigMap, and the operator's kustomization read from the
// README with only the registry and host name substituted) onto the
// real-node devcluster, where images, container args, image users,
// probes, volumes, Pod Security and NetworkPolicy are all real. It then
// uses the install as a client would, through the edge Service, and
// probes the network from inside pods. The machine must be left as it
// was found: TestMain compares devcluster.HostState before and after.
package install_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/devcluster"
	"github.com/aaas-project/aaas/internal/gobuild"
	"github.com/aaas-project/aaas/internal/image"
	"github.com/aaas-project/aaas/internal/manifests"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

const (
	namespace = "dsh-demo"
	// registry and domain replace the README's registry.example.com and
	// aaas.example.com, as an operator replaces them.
	registry = "registry.local"
	domain   = "aaas.test"
	// idleTimeout is what the test sets in aaas-config (README: edit the
	// ConfigMap, restart), so that idle suspend is observable.
	idleTimeout = "20s"
)

var (
	cluster *devcluster.Cluster
	// edge is the aaas-edge Service's ClusterIP address (host:port), which
	// this machine reaches through the node's bridge.
	edge   string
	invite string
	// probeRef is the image of the netprobe command (ephemeral containers).
	probeRef = registry + "/netprobe:test"
)

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	// A run killed before its cleanup must not count as this one's change.
	if err := devcluster.CleanupRealNode(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	before := devcluster.HostState()
	tmp, err := os.MkdirTemp("", "install-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)
	code := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		start := time.Now()
		objs, err := operatorInstall()
		if err != nil {
			fmt.Fprintln(os.Stderr, "install:", err)
			return 1
		}
		tars, err := buildImages(tmp, objs)
		if err != nil {
			fmt.Fprintln(os.Stderr, "images:", err)
			return 1
		}
		built := time.Since(start)
		cluster, err = devcluster.Start(ctx, devcluster.Options{Node: devcluster.NodeReal, Images: tars, Dir: filepath.Join(tmp, "cluster")})
		if err != nil {
			fmt.Fprintln(os.Stderr, "devcluster:", err)
			return 1
		}
		defer func() {
			if err := cluster.StopChecked(); err != nil {
				fmt.Fprintln(os.Stderr, "devcluster stop:", err)
			}
		}()
		up := time.Since(start)
		if err := install(ctx, objs); err != nil {
			fmt.Fprintln(os.Stderr, "install:", err)
			dumpPods(namespace)
			return 1
		}
		fmt.Fprintf(os.Stderr, "images built in %s, real node up at %s, install rolled out at %s\n",
			built.Round(time.Millisecond), up.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		return m.Run()
	}()
	if after := devcluster.HostState(); after != before {
		fmt.Fprintf(os.Stderr, "the real node left the machine changed:\n%s", diff(before, after))
		return 1
	}
	return code
}

// readme returns README.md's install: the operator's kustomization (the
// yaml block that starts with "# kustomization.yaml") and the shell
// commands that follow it, with the registry and host name replaced.
func readme() (kustomization string, commands []string, err error) {
	b, err := os.ReadFile(filepath.Join(testenv.Root(), "README.md"))
	if err != nil {
		return "", nil, err
	}
	text := strings.NewReplacer("registry.example.com", registry, "aaas.example.com", domain).Replace(string(b))
	blocks := regexp.MustCompile("(?s)```(yaml|sh)\n(.*?)```").FindAllStringSubmatch(text, -1)
	for i, bl := range blocks {
		if bl[1] == "yaml" && strings.HasPrefix(bl[2], "# kustomization.yaml\n") && i+1 < len(blocks) && blocks[i+1][1] == "sh" {
			return bl[2], strings.Split(strings.TrimSpace(blocks[i+1][2]), "\n"), nil
		}
	}
	return "", nil, fmt.Errorf("README.md has no kustomization.yaml block followed by its commands")
}

// operatorInstall renders the README's kustomization and checks that its
// commands are the ones install performs.
func operatorInstall() ([]*unstructured.Unstructured, error) {
	k, commands, err := readme()
	if err != nil {
		return nil, err
	}
	want := []string{
		"kubectl apply --server-side -f https://github.com/kubernetes-sigs/agent-sandbox/releases/download/" + aaas.Version("AGENT_SANDBOX_VERSION") + "/sandbox-with-extensions.yaml",
		"kubectl create namespace " + namespace,
		"go run github.com/aaas-project/aaas/hack/natsauth@main -secret | kubectl apply -f -",
		`kubectl -n dsh-demo create secret generic aaas-secrets --from-literal=handshake-keys="$(openssl rand -base64 32)" --from-literal=invite-code="$(openssl rand -hex 8)"`,
		"kubectl -n dsh-demo create configmap dsh-web --from-literal=trusted-hosts=" + domain,
		"kubectl apply -k .",
	}
	if strings.Join(commands, "\n") != strings.Join(want, "\n") {
		return nil, fmt.Errorf("README's install commands changed; update this test with them:\n%s", strings.Join(commands, "\n"))
	}
	return manifests.RenderKustomization(k)
}

// images lists the images the rendered install runs that come from the
// operator's registry.
func images(objs []*unstructured.Unstructured) map[string]bool {
	refs := map[string]bool{}
	re := regexp.MustCompile(`"image":"(` + regexp.QuoteMeta(registry) + `/[^"]+)"`)
	for _, o := range objs {
		b, _ := o.MarshalJSON()
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			refs[m[1]] = true
		}
	}
	return refs
}

// buildImages builds the aaas binaries and every image the install names
// (aaas, the DSH stand-in, NATS, agent-sandbox) plus the probe.
func buildImages(dir string, objs []*unstructured.Unstructured) ([]string, error) {
	var aaasRef, dshRef string
	for ref := range images(objs) {
		switch {
		case strings.HasPrefix(ref, registry+"/aaas:"):
			aaasRef = ref
		case strings.HasPrefix(ref, registry+"/dsh-web:"):
			dshRef = ref
		default:
			return nil, fmt.Errorf("the install names an image this test does not build: %s", ref)
		}
	}
	if aaasRef == "" || dshRef == "" {
		return nil, fmt.Errorf("the install does not name the aaas and DSH images from %s: %v", registry, images(objs))
	}
	bin := filepath.Join(dir, "bin")
	for _, c := range append(append([]string{}, image.AAASBinaries...), "dshsim") {
		if _, err := gobuild.Binary(bin, "github.com/aaas-project/aaas/cmd/"+c); err != nil {
			return nil, err
		}
	}
	tars, err := image.Install(bin, filepath.Join(dir, "images"), aaasRef, dshRef, devcluster.AgentSandboxBinary())
	if err != nil {
		return nil, err
	}
	probe, err := image.Program(filepath.Join(dir, "images"), "github.com/aaas-project/aaas/test/e2e/install/netprobe", probeRef, image.NonRoot)
	if err != nil {
		return nil, err
	}
	return append(tars, probe), nil
}

// install performs README's commands through the API, then sets the idle
// timeout as an operator would (edit aaas-config, restart), and waits for
// every rollout and the warm pool.
func install(ctx context.Context, objs []*unstructured.Unstructured) error {
	if err := cluster.InstallAgentSandbox(ctx); err != nil {
		return err
	}
	if err := cluster.CreateNamespace(ctx, namespace); err != nil {
		return err
	}
	natsCreds, err := natsauth.SecretData()
	if err != nil {
		return err
	}
	if _, err := cluster.Client.CoreV1().Secrets(namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "aaas-nats"}, Data: natsCreds,
	}, metav1.CreateOptions{}); err != nil {
		return err
	}
	invite = randomHex(8)
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	core := cluster.Client.CoreV1()
	if _, err := core.Secrets(namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "aaas-secrets"},
		StringData: map[string]string{"handshake-keys": base64.StdEncoding.EncodeToString(key), "invite-code": invite},
	}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := core.ConfigMaps(namespace).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "dsh-web"}, Data: map[string]string{"trusted-hosts": domain},
	}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if err := cluster.Apply(ctx, namespace, objs...); err != nil {
		return err
	}
	if err := cluster.WaitRollout(ctx, namespace, 5*time.Minute); err != nil {
		return err
	}
	patch := fmt.Sprintf(`{"data":{"IDLE_TIMEOUT":%q}}`, idleTimeout)
	if _, err := core.ConfigMaps(namespace).Patch(ctx, "aaas-config", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return err
	}
	restart := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339))
	if _, err := cluster.Client.AppsV1().Deployments(namespace).Patch(ctx, "aaas-sweeper", types.StrategicMergePatchType, []byte(restart), metav1.PatchOptions{}); err != nil {
		return err
	}
	if err := cluster.WaitRollout(ctx, namespace, 3*time.Minute); err != nil {
		return err
	}
	svc, err := core.Services(namespace).Get(ctx, "aaas-edge", metav1.GetOptions{})
	if err != nil {
		return err
	}
	edge = net.JoinHostPort(svc.Spec.ClusterIP, "8080")
	_, ext, err := cluster.SandboxClients()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(3 * time.Minute)
	for {
		p, err := ext.ExtensionsV1beta1().SandboxWarmPools(namespace).Get(ctx, "dsh-pool", metav1.GetOptions{})
		if err == nil && p.Status.ReadyReplicas >= 2 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("warm pool not ready: %v %+v", err, p)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// dumpPods prints every pod's state and its containers' last log lines, for
// a failed install.
func dumpPods(ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return
	}
	for _, p := range pods.Items {
		fmt.Fprintf(os.Stderr, "pod %s: %s\n", p.Name, p.Status.Phase)
		for _, cs := range p.Status.ContainerStatuses {
			fmt.Fprintf(os.Stderr, "  %s ready=%v restarts=%d state=%+v\n", cs.Name, cs.Ready, cs.RestartCount, cs.State)
			tail := int64(10)
			b, _ := cluster.Client.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{Container: cs.Name, TailLines: &tail}).DoRaw(ctx)
			fmt.Fprintf(os.Stderr, "  %s\n", strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", "\n  "))
		}
	}
}

func diff(a, b string) string {
	al, bl := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(a, "\n") {
		al[l] = true
	}
	for _, l := range strings.Split(b, "\n") {
		bl[l] = true
	}
	var out strings.Builder
	for _, l := range strings.Split(a, "\n") {
		if !bl[l] {
			fmt.Fprintf(&out, "- %s\n", l)
		}
	}
	for _, l := range strings.Split(b, "\n") {
		if !al[l] {
			fmt.Fprintf(&out, "+ %s\n", l)
		}
	}
	return out.String()
}

// client talks to the edge Service as a browser on https://aaas.test
// would through the ingress: Host is the public name, the connection goes
// to the Service.
func client(t *testing.T) *testenv.Client {
	c := testenv.NewClient(t, "http://"+domain)
	c.HTTP.Transport = &http.Transport{DialContext: dialEdge}
	return c
}

func dialEdge(ctx context.Context, network, _ string) (net.Conn, error) {
	return (&net.Dialer{}).DialContext(ctx, network, edge)
}

func bearer(tok string) []string { return []string{"Authorization", "Bearer " + tok} }

// TestUserJourney is what a user does, through the edge Service: sign up
// and get a Ready sandbox, use it over HTTP, SSE and WebSocket (every
// request needs the DSH handshake lifecycle performed), leave it idle until
// it is suspended, come back and find the files, recreate it, delete the
// account.
func TestUserJourney(t *testing.T) {
	c := client(t).WithTimeout(2 * time.Minute)
	tok := c.Signup("alice", invite)
	auth := bearer(tok)

	if r := c.Do("GET", "/u/alice/api/files", nil, auth...); r.StatusCode != http.StatusOK {
		t.Fatalf("files: %d %s", r.StatusCode, r.Body)
	}
	body := bytes.Repeat([]byte("kept across suspend "), 1000)
	if r := c.Do("PUT", "/u/alice/api/files/notes.txt", bytes.NewReader(body), auth...); r.StatusCode/100 != 2 {
		t.Fatalf("upload: %d %s", r.StatusCode, r.Body)
	}
	sse(t, tok)
	echo(t, tok)

	// Idle: nothing in flight, no requests for idleTimeout.
	phase := func() string {
		r := c.Do("GET", "/_/status", nil, auth...)
		p, _ := r.JSON()["phase"].(string)
		return p
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		if p := phase(); p != "Suspended" {
			return fmt.Errorf("phase %s", p)
		}
		return nil
	})
	if pods := userPods(t, "alice"); len(pods) != 0 {
		t.Fatalf("suspended, but %d pods remain", len(pods))
	}
	t.Logf("suspended after %s idle", idleTimeout)
	start := time.Now()
	r := c.Do("GET", "/u/alice/api/files/notes.txt", nil, auth...)
	if r.StatusCode != http.StatusOK || !bytes.Equal(r.Body, body) {
		t.Fatalf("after wake: %d, %d bytes (want %d)", r.StatusCode, len(r.Body), len(body))
	}
	t.Logf("woken with files kept in %s", time.Since(start).Round(time.Millisecond))

	r = c.Do("POST", "/recreate", nil, append(auth, "Accept", "application/json")...)
	if r.StatusCode != http.StatusAccepted {
		t.Fatalf("recreate: %d %s", r.StatusCode, r.Body)
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		r := c.Do("GET", "/u/alice/api/files", nil, auth...)
		if r.StatusCode != http.StatusOK {
			return fmt.Errorf("files after recreate: %d", r.StatusCode)
		}
		if bytes.Contains(r.Body, []byte("notes.txt")) {
			return fmt.Errorf("recreated workspace still has notes.txt: %s", r.Body)
		}
		return nil
	})

	claims := volumeClaims(t, "alice")
	if len(claims) == 0 {
		t.Fatal("alice has no volume claim")
	}
	if r := c.Do("DELETE", "/users/alice", nil, append(auth, "Accept", "application/json")...); r.StatusCode/100 != 2 {
		t.Fatalf("delete: %d %s", r.StatusCode, r.Body)
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		if p := userPods(t, "alice"); len(p) > 0 {
			return fmt.Errorf("%d pods remain", len(p))
		}
		for _, pvc := range claims {
			if _, err := cluster.Client.CoreV1().PersistentVolumeClaims(namespace).Get(context.Background(), pvc.Name, metav1.GetOptions{}); err == nil {
				return fmt.Errorf("claim %s remains", pvc.Name)
			}
			if _, err := cluster.Client.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{}); err == nil {
				return fmt.Errorf("volume %s remains", pvc.Spec.VolumeName)
			}
		}
		return nil
	})
	if r := c.Do("GET", "/u/alice/api/files", nil, auth...); r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("deleted account still served: %d", r.StatusCode)
	}
}

// sse reads a short event stream through the edge.
func sse(t *testing.T, tok string) {
	t.Helper()
	req, _ := http.NewRequest("GET", "http://"+domain+"/u/alice/api/events?interval=200&count=3", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := client(t).HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("events: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	events := 0
	s := bufio.NewScanner(resp.Body)
	for s.Scan() {
		if strings.HasPrefix(s.Text(), "data:") {
			events++
		}
	}
	if events != 3 {
		t.Fatalf("%d events, want 3", events)
	}
}

// echo round-trips WebSocket messages through the edge.
func echo(t *testing.T, tok string) {
	t.Helper()
	d := websocket.Dialer{NetDialContext: dialEdge, HandshakeTimeout: 30 * time.Second}
	ws, resp, err := d.Dial("ws://"+domain+"/u/alice/api/ws", http.Header{"Authorization": {"Bearer " + tok}})
	if err != nil {
		status := 0
		if resp != nil {
			status = resp.StatusCode
		}
		t.Fatalf("websocket: %v (%d)", err, status)
	}
	defer ws.Close()
	for _, msg := range []string{"hello", "from the real node"} {
		if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, got, err := ws.ReadMessage(); err != nil || string(got) != msg {
			t.Fatalf("echo: %q %v", got, err)
		}
	}
}

// userPods are the pods of user's sandbox.
func userPods(t *testing.T, user string) []corev1.Pod {
	t.Helper()
	pods, err := cluster.Client.CoreV1().Pods(namespace).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=dsh-web"})
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Pod
	for _, p := range pods.Items {
		if owner(t, &p) == user {
			out = append(out, p)
		}
	}
	return out
}

// owner is the user whose claim owns the pod's Sandbox ("" for the pool's).
func owner(t *testing.T, p *corev1.Pod) string {
	t.Helper()
	sc, _, err := cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range p.OwnerReferences {
		if ref.Kind != "Sandbox" {
			continue
		}
		sb, err := sc.AgentsV1beta1().Sandboxes(namespace).Get(context.Background(), ref.Name, metav1.GetOptions{})
		if err != nil {
			return ""
		}
		for _, o := range sb.OwnerReferences {
			if o.Kind == "SandboxClaim" {
				return strings.TrimPrefix(o.Name, "dsh-")
			}
		}
	}
	return ""
}

// volumeClaims are the PersistentVolumeClaims user's pods mount.
func volumeClaims(t *testing.T, user string) []*corev1.PersistentVolumeClaim {
	t.Helper()
	var out []*corev1.PersistentVolumeClaim
	for _, p := range userPods(t, user) {
		for _, v := range p.Spec.Volumes {
			if v.PersistentVolumeClaim == nil {
				continue
			}
			pvc, err := cluster.Client.CoreV1().PersistentVolumeClaims(namespace).Get(context.Background(), v.PersistentVolumeClaim.ClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, pvc)
		}
	}
	return out
}

// TestPodSecurityRestricted: the namespace enforces the restricted profile,
// so every control-plane pod and sandbox running in it passed it; a pod
// that does not is refused, so the label is really enforced.
func TestPodSecurityRestricted(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	ns, err := cluster.Client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ns.Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
		t.Fatalf("namespace labels %v", ns.Labels)
	}
	pods, err := cluster.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	running := map[string]int{}
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodRunning {
			running[p.Labels["app.kubernetes.io/name"]]++
		}
	}
	for _, name := range []string{"nats", "aaas-edge", "aaas-lifecycle", "aaas-sweeper", "dsh-web"} {
		if running[name] == 0 {
			t.Errorf("no %s pod running under restricted: %v", name, running)
		}
	}
	bad := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "not-restricted"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: probeRef}}},
	}
	_, err = cluster.Client.CoreV1().Pods(namespace).Create(ctx, bad, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if err == nil || !strings.Contains(err.Error(), "restricted") {
		t.Fatalf("a pod without a restricted security context was not refused: %v", err)
	}
}

// probe runs netprobe against targets from inside pod, as an ephemeral
// container (same network namespace, same labels, so the same policies),
// and returns its lines by target.
func probe(t *testing.T, pod *corev1.Pod, targets ...string) map[string]string {
	t.Helper()
	ctx := testenv.Context(t, 2*time.Minute)
	name := "probe-" + randomHex(3)
	p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Spec.EphemeralContainers = append(p.Spec.EphemeralContainers, corev1.EphemeralContainer{
		EphemeralContainerCommon: corev1.EphemeralContainerCommon{
			Name: name, Image: probeRef, ImagePullPolicy: corev1.PullNever, Args: targets,
			SecurityContext: &corev1.SecurityContext{
				RunAsNonRoot: ptr(true), AllowPrivilegeEscalation: ptr(false),
				Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
		},
	})
	if _, err := cluster.Client.CoreV1().Pods(pod.Namespace).UpdateEphemeralContainers(ctx, pod.Name, p, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("ephemeral container in %s: %v", pod.Name, err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, s := range p.Status.EphemeralContainerStatuses {
			if s.Name == name && s.State.Terminated != nil {
				return nil
			}
		}
		return fmt.Errorf("probe in %s still running", pod.Name)
	})
	b, err := cluster.Client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: name}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 {
			out[strings.TrimSuffix(f[1], ":")] = l
		}
	}
	return out
}

func ptr[T any](v T) *T { return &v }

// TestReachability probes the network from inside pods with the policy
// enforcer on: tenants reach nothing of the platform and no other tenant,
// the edge and lifecycle reach sandboxes, and only aaas pods reach NATS.
// A stand-in for the cloud metadata address answers pods, so that its row
// is decided by policy, not by the test bed's routing.
func TestReachability(t *testing.T) {
	ctx := testenv.Context(t, 3*time.Minute)
	metadata := metadataStandIn(t)
	list := func(selector string) []corev1.Pod {
		pods, err := cluster.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector, FieldSelector: "status.phase=Running"})
		if err != nil {
			t.Fatal(err)
		}
		if len(pods.Items) == 0 {
			t.Fatalf("no running pod for %s", selector)
		}
		return pods.Items
	}
	// Earlier tests take pods from the warm pool, which refills them.
	var sandboxes []corev1.Pod
	testutil.Eventually(t, 2*time.Minute, func() error {
		pods, err := cluster.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=dsh-web", FieldSelector: "status.phase=Running"})
		if err != nil {
			return err
		}
		if sandboxes = pods.Items; len(sandboxes) < 2 {
			return fmt.Errorf("%d sandboxes running, want two to probe between", len(sandboxes))
		}
		return nil
	})
	edges, lifecycles, nats := list("app.kubernetes.io/name=aaas-edge"), list("app.kubernetes.io/name=aaas-lifecycle"), list("app.kubernetes.io/name=nats")
	svc := func(name string) string {
		s, err := cluster.Client.CoreV1().Services(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return s.Spec.ClusterIP
	}
	apiSvc, err := cluster.Client.CoreV1().Services("default").Get(ctx, "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var (
		sandbox       = net.JoinHostPort(sandboxes[1].Status.PodIP, "3080")
		natsPod       = net.JoinHostPort(nats[0].Status.PodIP, "4222")
		natsService   = net.JoinHostPort(svc("nats"), "4222")
		apiService    = net.JoinHostPort(apiSvc.Spec.ClusterIP, "443")
		edgeMetrics   = net.JoinHostPort(edges[0].Status.PodIP, "9090")
		edgeHTTP      = net.JoinHostPort(edges[0].Status.PodIP, "8080")
		natsMonitor   = net.JoinHostPort(nats[0].Status.PodIP, "8222")
		natsRoute     = net.JoinHostPort(nats[0].Status.PodIP, "6222")
		lifecycleMetr = net.JoinHostPort(lifecycles[0].Status.PodIP, "9091")
	)
	type row struct {
		from    *corev1.Pod
		target  string
		open    bool
		meaning string
	}
	stranger := strangerPod(t, namespace)
	if err := cluster.CreateNamespace(ctx, "monitoring"); err != nil {
		t.Fatal(err)
	}
	monitor := strangerPod(t, "monitoring")
	rows := []row{
		{&sandboxes[0], natsPod, false, "a sandbox reaches NATS (pod)"},
		{&sandboxes[0], natsService, false, "a sandbox reaches NATS (Service)"},
		{&sandboxes[0], natsRoute, false, "a sandbox reaches NATS's route port"},
		{&sandboxes[0], natsMonitor, false, "a sandbox reaches NATS's monitoring port"},
		{&sandboxes[0], apiService, false, "a sandbox reaches the API server"},
		{&sandboxes[0], sandbox, false, "a sandbox reaches another sandbox"},
		{&sandboxes[0], edgeMetrics, false, "a sandbox reaches the edge's metrics port"},
		{&sandboxes[0], edgeHTTP, false, "a sandbox reaches the edge directly"},
		{&sandboxes[0], lifecycleMetr, false, "a sandbox reaches lifecycle's metrics port"},
		{&sandboxes[0], metadata, false, "a sandbox reaches the cloud metadata address"},
		{&edges[0], sandbox, true, "the edge reaches a sandbox on 3080"},
		{&edges[0], natsService, true, "the edge reaches NATS"},
		{&lifecycles[0], sandbox, true, "lifecycle reaches a sandbox on 3080"},
		{&lifecycles[0], natsPod, true, "lifecycle reaches NATS"},
		{stranger, natsPod, false, "a pod that is not aaas reaches NATS"},
		{stranger, natsService, false, "a pod that is not aaas reaches NATS (Service)"},
		{stranger, sandbox, false, "a pod that is not aaas reaches a sandbox"},
		{stranger, metadata, true, "the metadata stand-in answers pods without a policy (control)"},
		{stranger, lifecycleMetr, true, "lifecycle's metrics port is open (control)"},
		{&lifecycles[0], apiService, true, "lifecycle reaches the API server (control)"},
		{monitor, edgeMetrics, true, "the monitoring namespace reaches the edge's metrics port"},
		{monitor, natsMonitor, true, "the monitoring namespace reaches NATS's monitoring port"},
		{monitor, natsPod, false, "the monitoring namespace reaches NATS's client port"},
		{monitor, edgeHTTP, false, "the monitoring namespace reaches the edge's HTTP port"},
	}
	byPod := map[*corev1.Pod][]string{}
	for _, r := range rows {
		byPod[r.from] = append(byPod[r.from], r.target)
	}
	results := map[*corev1.Pod]map[string]string{}
	for pod, targets := range byPod {
		results[pod] = probe(t, pod, targets...)
	}
	for _, r := range rows {
		line := results[r.from][r.target]
		open := strings.HasPrefix(line, "open ")
		status := "PASS"
		if open != r.open || line == "" {
			status = "FAIL"
			t.Errorf("%s: want open=%v, got %q", r.meaning, r.open, line)
		}
		t.Logf("%s %-62s %s", status, r.meaning, line)
	}
}

// strangerPod is a pod without any aaas label in ns: what any workload an
// operator adds there looks like to the policies.
func strangerPod(t *testing.T, ns string) *corev1.Pod {
	t.Helper()
	ctx := testenv.Context(t, 2*time.Minute)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "stranger-" + randomHex(3), Labels: map[string]string{"app": "stranger"}},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr(false),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: ptr(true), RunAsUser: ptr(int64(65532)), RunAsGroup: ptr(int64(65532)),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			// pause keeps the pod running for the probes; its image is on
			// every node.
			Containers: []corev1.Container{{
				Name: "idle", Image: image.PauseRef, ImagePullPolicy: corev1.PullNever,
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: ptr(false), Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
			}},
		},
	}
	created, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods(ns).Delete(context.Background(), created.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
	})
	testutil.Eventually(t, time.Minute, func() error {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, created.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning {
			return fmt.Errorf("stranger pod %s", p.Status.Phase)
		}
		created = p
		return nil
	})
	return created
}

// metadataStandIn answers TCP on 169.254.169.254:80 for pods only: a local
// route in the pods' own routing table delivers their packets to it on this
// machine (the machine's own route to the address is untouched).
func metadataStandIn(t *testing.T) string {
	t.Helper()
	const addr = "169.254.169.254:80"
	ln, err := devcluster.ListenForPods(addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "metadata\n")
			c.Close()
		}
	}()
	return addr
}
