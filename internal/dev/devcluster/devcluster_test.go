package devcluster_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/providersim"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/handshake"
)

var cluster *devcluster.Cluster

// Own, not Main: these tests start, inspect and stop the cluster itself.
func TestMain(m *testing.M) { os.Exit(devclustertest.Own(m, &cluster)) }

// sandboxNS is a namespace with the manifests' template and a warm pool of
// two, with a short DSH auth TTL so expiry is testable.
func sandboxNS(t *testing.T, env ...corev1.EnvVar) string {
	t.Helper()
	ns := devclustertest.Namespace(t, cluster)
	err := cluster.InstallSandboxes(ctx(t), ns, func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		// env replaces the template's variables of the same names (its
		// provider base URLs point at the broker's Service).
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		c.Env = slices.DeleteFunc(c.Env, func(e corev1.EnvVar) bool {
			return slices.ContainsFunc(env, func(x corev1.EnvVar) bool { return x.Name == e.Name })
		})
		c.Env = append(c.Env, env...)
	})
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return c
}

func ready(conds []metav1.Condition) bool {
	for _, c := range conds {
		if c.Type == "Ready" {
			return c.Status == metav1.ConditionTrue
		}
	}
	return false
}

func claim(t *testing.T, ns, name string) *extv1beta1.SandboxClaim {
	t.Helper()
	_, ext, err := cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	c, err := ext.ExtensionsV1beta1().SandboxClaims(ns).Create(ctx(t), &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// readyClaim waits for a claim to be Ready and returns its sandbox.
func readyClaim(t *testing.T, ns, name string) *sandboxv1beta1.Sandbox {
	t.Helper()
	sc, ext, _ := cluster.SandboxClients()
	var sb *sandboxv1beta1.Sandbox
	testutil.Eventually(t, 60*time.Second, func() error {
		c, err := ext.ExtensionsV1beta1().SandboxClaims(ns).Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !ready(c.Status.Conditions) || c.Status.SandboxStatus.Name == "" {
			return fmt.Errorf("claim not ready: %+v", c.Status)
		}
		sb, err = sc.AgentsV1beta1().Sandboxes(ns).Get(ctx(t), c.Status.SandboxStatus.Name, metav1.GetOptions{})
		return err
	})
	return sb
}

// sandboxPod returns the Ready pod behind a sandbox.
func sandboxPod(t *testing.T, ns, sandbox string) *corev1.Pod {
	t.Helper()
	sc, _, _ := cluster.SandboxClients()
	var pod *corev1.Pod
	testutil.Eventually(t, 60*time.Second, func() error {
		sb, err := sc.AgentsV1beta1().Sandboxes(ns).Get(ctx(t), sandbox, metav1.GetOptions{})
		if err != nil {
			return err
		}
		name := sb.Annotations[sandboxv1beta1.SandboxPodNameAnnotation]
		if name == "" {
			name = sandbox
		}
		pod, err = cluster.Client.CoreV1().Pods(ns).Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pod.DeletionTimestamp != nil || !podReady(pod) {
			return fmt.Errorf("pod %s not ready: %s", pod.Name, pod.Status.Phase)
		}
		return nil
	})
	return pod
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// logToken reads the pod log through the API server (pods/log, served by
// the simulated kubelet) and returns the newest launch token.
func logToken(t *testing.T, client kubernetes.Interface, pod *corev1.Pod) string {
	t.Helper()
	var token string
	testutil.Eventually(t, 20*time.Second, func() error {
		tail := int64(50)
		b, err := client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: "dsh", TailLines: &tail}).DoRaw(ctx(t))
		if err != nil {
			return err
		}
		token, err = handshake.TokenFromLog(b)
		return err
	})
	return token
}

func dshCookie(t *testing.T, pod *corev1.Pod) string {
	t.Helper()
	cookie, err := handshake.Exchange(ctx(t), handshake.Client(), handshake.Request{
		Address: pod.Status.PodIP + ":3080", Token: logToken(t, cluster.Client, pod), Host: "localhost",
	})
	if err != nil {
		t.Fatal(err)
	}
	return cookie
}

func dshDo(t *testing.T, method string, pod *corev1.Pod, cookie, path string, body io.Reader) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx(t), method, "http://"+pod.Status.PodIP+":3080"+path, body)
	req.Host = "localhost"
	req.Header.Set("Cookie", cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func TestWarmPoolSandboxesAreReadyAndAnswerOnTheirPodIPs(t *testing.T) {
	ns := sandboxNS(t)
	sc, _, _ := cluster.SandboxClients()
	list, err := sc.AgentsV1beta1().Sandboxes(ns).List(ctx(t), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 2 {
		t.Fatalf("%d sandboxes, want 2", len(list.Items))
	}
	ips := map[string]bool{}
	for _, sb := range list.Items {
		if !ready(sb.Status.Conditions) {
			t.Fatalf("sandbox %s not ready: %+v", sb.Name, sb.Status.Conditions)
		}
		pod := sandboxPod(t, ns, sb.Name)
		if ips[pod.Status.PodIP] || !strings.HasPrefix(pod.Status.PodIP, "127.") || pod.Status.PodIP == "127.0.0.1" {
			t.Fatalf("pod IP %q is not its own loopback address", pod.Status.PodIP)
		}
		ips[pod.Status.PodIP] = true
		req, _ := http.NewRequest(http.MethodGet, "http://"+pod.Status.PodIP+":3080/favicon.svg", nil)
		req.Host = "localhost"
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("favicon on %s: %v %v", pod.Status.PodIP, resp, err)
		}
		resp.Body.Close()
	}
}

func TestClaimAdoptsAWarmSandboxAndThePoolRefills(t *testing.T) {
	ns := sandboxNS(t)
	sc, ext, _ := cluster.SandboxClients()
	before, _ := sc.AgentsV1beta1().Sandboxes(ns).List(ctx(t), metav1.ListOptions{})
	warm := map[string]bool{}
	for _, sb := range before.Items {
		warm[sb.Name] = true
	}

	start := time.Now()
	claim(t, ns, "dsh-bob")
	sb := readyClaim(t, ns, "dsh-bob")
	t.Logf("claim to Ready: %s", time.Since(start).Round(time.Millisecond))
	if !warm[sb.Name] {
		t.Fatalf("claim got sandbox %s, not one of the warm ones %v", sb.Name, warm)
	}
	testutil.Eventually(t, 60*time.Second, func() error {
		p, err := ext.ExtensionsV1beta1().SandboxWarmPools(ns).Get(ctx(t), "dsh-pool", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.ReadyReplicas < 2 {
			return fmt.Errorf("pool has %d ready", p.Status.ReadyReplicas)
		}
		return nil
	})

	// pods/log through the API server carries the token line, and the
	// token buys the auth cookie from the pod.
	pod := sandboxPod(t, ns, sb.Name)
	cookie := dshCookie(t, pod)
	if resp, _ := dshDo(t, http.MethodGet, pod, cookie, "/", nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("app page with cookie: %s", resp.Status)
	}
	if resp, _ := dshDo(t, http.MethodGet, pod, "", "/", nil); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("app page without cookie: %s", resp.Status)
	}
}

func TestSuspendAndResumeKeepTheVolume(t *testing.T) {
	ns := sandboxNS(t)
	claim(t, ns, "dsh-carol")
	sb := readyClaim(t, ns, "dsh-carol")
	pod := sandboxPod(t, ns, sb.Name)
	cookie := dshCookie(t, pod)
	oldToken := logToken(t, cluster.Client, pod)

	payload := bytes.Repeat([]byte("persist me\n"), 1000)
	sum := sha256.Sum256(payload)
	resp, body := dshDo(t, http.MethodPut, pod, cookie, "/api/files/notes.txt", bytes.NewReader(payload))
	if resp.StatusCode != http.StatusCreated || !strings.Contains(string(body), hex.EncodeToString(sum[:])) {
		t.Fatalf("upload: %s %s", resp.Status, body)
	}

	setMode(t, ns, sb.Name, sandboxv1beta1.SandboxOperatingModeSuspended)
	testutil.Eventually(t, 60*time.Second, func() error {
		_, err := cluster.Client.CoreV1().Pods(ns).Get(ctx(t), pod.Name, metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("pod still there (%v)", err)
		}
		return nil
	})
	for _, pid := range cluster.PIDs() {
		if strings.Contains(cmdline(pid), pod.Status.PodIP+":") {
			t.Fatalf("dshsim of the suspended pod still runs as pid %d", pid)
		}
	}

	setMode(t, ns, sb.Name, sandboxv1beta1.SandboxOperatingModeRunning)
	var resumed *corev1.Pod
	testutil.Eventually(t, 60*time.Second, func() error {
		resumed = sandboxPod(t, ns, sb.Name)
		if resumed.UID == pod.UID {
			return errors.New("same pod")
		}
		return nil
	})
	newToken := logToken(t, cluster.Client, resumed)
	if newToken == oldToken {
		t.Fatal("resumed pod kept the old launch token")
	}
	cookie = dshCookie(t, resumed)
	resp, body = dshDo(t, http.MethodGet, resumed, cookie, "/api/files/notes.txt", nil)
	if resp.StatusCode != http.StatusOK || !bytes.Equal(body, payload) {
		t.Fatalf("file after resume: %s, %d bytes", resp.Status, len(body))
	}
}

func setMode(t *testing.T, ns, sandbox string, mode sandboxv1beta1.SandboxOperatingMode) {
	t.Helper()
	sc, _, _ := cluster.SandboxClients()
	patch := fmt.Sprintf(`{"spec":{"operatingMode":%q}}`, mode)
	if _, err := sc.AgentsV1beta1().Sandboxes(ns).Patch(ctx(t), sandbox, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

func cmdline(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	return string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
}

func TestDeletingTheClaimRemovesSandboxPodPVCAndItsDirectory(t *testing.T) {
	ns := sandboxNS(t)
	claim(t, ns, "dsh-dave")
	sb := readyClaim(t, ns, "dsh-dave")
	pod := sandboxPod(t, ns, sb.Name)
	pvcName := "dsh-home-" + sb.Name
	dir, err := cluster.Node.PVCDir(ns, pvcName)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".credentials.yaml")); err != nil {
		t.Fatalf("PVC directory does not hold DSH_HOME: %v", err)
	}

	_, ext, _ := cluster.SandboxClients()
	sc, _, _ := cluster.SandboxClients()
	if err := ext.ExtensionsV1beta1().SandboxClaims(ns).Delete(ctx(t), "dsh-dave", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 90*time.Second, func() error {
		if _, err := sc.AgentsV1beta1().Sandboxes(ns).Get(ctx(t), sb.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("sandbox: %v", err)
		}
		if _, err := cluster.Client.CoreV1().Pods(ns).Get(ctx(t), pod.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("pod: %v", err)
		}
		if _, err := cluster.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx(t), pvcName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("pvc: %v", err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			return fmt.Errorf("pvc dir: %v", err)
		}
		return nil
	})
}

func TestGroupReadableCredentialsCrashLoop(t *testing.T) {
	ns := sandboxNS(t)
	claim(t, ns, "dsh-erin")
	sb := readyClaim(t, ns, "dsh-erin")
	dir, err := cluster.Node.PVCDir(ns, "dsh-home-"+sb.Name)
	if err != nil {
		t.Fatal(err)
	}
	// What the kubelet's default fsGroupChangePolicy (Always) would do on
	// the next start.
	if err := os.Chmod(filepath.Join(dir, ".credentials.yaml"), 0o640); err != nil {
		t.Fatal(err)
	}
	setMode(t, ns, sb.Name, sandboxv1beta1.SandboxOperatingModeSuspended)
	testutil.Eventually(t, 60*time.Second, func() error {
		pods, _ := cluster.Client.CoreV1().Pods(ns).List(ctx(t), metav1.ListOptions{})
		for _, p := range pods.Items {
			if strings.Contains(p.Name, sb.Name) {
				return fmt.Errorf("pod %s still there", p.Name)
			}
		}
		return nil
	})
	setMode(t, ns, sb.Name, sandboxv1beta1.SandboxOperatingModeRunning)
	testutil.Eventually(t, 60*time.Second, func() error {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx(t), metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if len(p.Status.ContainerStatuses) == 0 || p.DeletionTimestamp != nil {
				continue
			}
			cs := p.Status.ContainerStatuses[0]
			last := cs.LastTerminationState.Terminated
			if cs.RestartCount >= 1 && cs.State.Waiting != nil && cs.State.Waiting.Reason == "CrashLoopBackOff" &&
				last != nil && last.ExitCode == 1 && strings.Contains(last.Message, ".credentials.yaml") && !podReady(&p) {
				return nil
			}
		}
		return errors.New("no pod reports a crash loop about .credentials.yaml")
	})
}

func TestTokenRotationIsVisibleInPodLogs(t *testing.T) {
	ns := sandboxNS(t)
	claim(t, ns, "dsh-fay")
	sb := readyClaim(t, ns, "dsh-fay")
	pod := sandboxPod(t, ns, sb.Name)
	old := logToken(t, cluster.Client, pod)
	if err := cluster.Node.Signal(ns, pod.Name, "dsh", syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if tok := logToken(t, cluster.Client, pod); tok == old {
			return errors.New("still the old token")
		}
		return nil
	})
}

// A simulated pod's model calls come from its pod IP, as a real pod's do
// (the broker attributes calls by source address), whatever the pod spec
// says DEVCLUSTER_POD_IP is. The provider stand-in is the far end.
func TestPodConnectionsComeFromThePodIP(t *testing.T) {
	const key = "sk-node-test-4242"
	sim := providersim.New(providersim.Options{Keys: []string{key}})
	far := httptest.NewServer(sim)
	t.Cleanup(far.Close)
	ns := sandboxNS(t,
		corev1.EnvVar{Name: "DEEPSEEK_BASE_URL", Value: far.URL},
		corev1.EnvVar{Name: "DEEPSEEK_API_KEY", Value: key},
		corev1.EnvVar{Name: "DEVCLUSTER_POD_IP", Value: "127.0.0.1"})
	claim(t, ns, "dsh-gus")
	pod := sandboxPod(t, ns, readyClaim(t, ns, "dsh-gus").Name)
	resp, body := dshDo(t, http.MethodPost, pod, dshCookie(t, pod), "/api/chat", strings.NewReader(`{"message":"hi"}`))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "event: delta") || strings.Contains(string(body), "event: error") {
		t.Fatalf("chat = %s %s", resp.Status, body)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		calls := sim.Calls()
		if len(calls) != 1 || calls[0].Remote != pod.Status.PodIP || calls[0].KeyHint != "4242" {
			return fmt.Errorf("provider saw %+v, want one call from %s", calls, pod.Status.PodIP)
		}
		return nil
	})
}

func TestServiceAccountKubeconfigHasOnlyItsRoleRights(t *testing.T) {
	ns := devclustertest.Namespace(t, cluster)
	c := ctx(t)
	_, err := cluster.Client.CoreV1().ServiceAccounts(ns).Create(c, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "reader"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = cluster.Client.RbacV1().Roles(ns).Create(c, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"list"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = cluster.Client.RbacV1().RoleBindings(ns).Create(c, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "reader"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "reader"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "reader", Namespace: ns}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	path, cfg, err := cluster.ServiceAccountKubeconfig(c, ns, "reader")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
	sa := kubernetes.NewForConfigOrDie(cfg)
	if _, err := sa.CoreV1().ConfigMaps(ns).List(c, metav1.ListOptions{}); err != nil {
		t.Fatalf("list configmaps as the reader: %v", err)
	}
	if _, err := sa.CoreV1().Secrets(ns).List(c, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("list secrets as the reader: %v, want forbidden", err)
	}
	if _, err := sa.CoreV1().ConfigMaps("default").List(c, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("list configmaps in another namespace: %v, want forbidden", err)
	}
}

func TestStopLeavesNoProcessAndNoDirectory(t *testing.T) {
	devclustertest.Need(t, cluster) // it starts a second one
	bin, err := gobuild.Binary(t.TempDir(), "github.com/aaas-project/aaas/internal/dev/cmd/dshsim")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c, err := devcluster.Start(ctx(t), devcluster.Options{DSHSim: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("second cluster started in %s", time.Since(start).Round(time.Millisecond))
	if err := c.CreateNamespace(ctx(t), "dsh-demo"); err != nil {
		t.Fatal(err)
	}
	if err := c.InstallSandboxes(ctx(t), "dsh-demo", nil); err != nil {
		t.Fatal(err)
	}
	pids := c.PIDs()
	if len(pids) < 6 { // etcd, apiserver, kcm, agent-sandbox, 2 pods
		t.Fatalf("only %d processes running: %v", len(pids), pids)
	}
	dir := c.Dir
	c.Stop()
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err == nil || !errors.Is(err, syscall.ESRCH) {
			if _, serr := os.Stat(fmt.Sprintf("/proc/%d", pid)); serr == nil {
				t.Errorf("process %d survived Stop (%s)", pid, procState(pid))
			}
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("cluster dir %s survived Stop: %v", dir, err)
	}
}

func procState(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return string(b)
}

// TestAttachedClusterServesTheOwnersNode is what `make test`'s shared
// cluster relies on: a process attached to a shared cluster reaches the
// owner's simulated node (signals, volume directories) and mints
// service-account kubeconfigs that work.
func TestAttachedClusterServesTheOwnersNode(t *testing.T) {
	devclustertest.Need(t, cluster)
	sctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := cluster.Share(sctx); err != nil {
		t.Fatal(err)
	}
	other, err := devcluster.Attach(cluster.Dir)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Stop() // releases nothing of the owner's: the tests after this one still run

	ns := sandboxNS(t)
	claim(t, ns, "dsh-gus")
	sb := readyClaim(t, ns, "dsh-gus")
	pod := sandboxPod(t, ns, sb.Name)
	want, err := cluster.Node.PVCDir(ns, "dsh-home-"+sb.Name)
	if err != nil {
		t.Fatal(err)
	}
	if other.EtcdURL != cluster.EtcdURL || other.Kubeconfig != cluster.Kubeconfig {
		t.Fatalf("attached: etcd %q, kubeconfig %q; the owner's are %q, %q", other.EtcdURL, other.Kubeconfig, cluster.EtcdURL, cluster.Kubeconfig)
	}
	if got, err := other.Node.PVCDir(ns, "dsh-home-"+sb.Name); err != nil || got != want {
		t.Fatalf("attached PVCDir = %q, %v; the owner's is %q", got, err, want)
	}
	old := logToken(t, other.Client, pod)
	if err := other.Node.Signal(ns, pod.Name, "dsh", syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if tok := logToken(t, other.Client, pod); tok == old {
			return errors.New("still the old token: the signal did not reach the owner's pod")
		}
		return nil
	})
	if err := other.Node.Signal(ns, "no-such-pod", "dsh", syscall.SIGHUP); err == nil {
		t.Fatal("a signal to a pod that does not run succeeded")
	}

	if _, err := other.Client.CoreV1().ServiceAccounts(ns).Create(ctx(t), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "attached"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, cfg, err := other.ServiceAccountKubeconfig(ctx(t), ns, "attached")
	if err != nil {
		t.Fatal(err)
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Authenticated (not 401), and only what its (empty) Role grants.
	if _, err := c.CoreV1().Pods(ns).List(ctx(t), metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("listing pods as a bare service account: %v, want forbidden", err)
	}
}
