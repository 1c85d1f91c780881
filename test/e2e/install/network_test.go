package install_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// TestPodSecurityRestricted: both namespaces enforce the restricted
// profile, so every control-plane pod and every sandbox running in them
// passed it; a pod that does not is refused in each, so the labels are
// really enforced.
func TestPodSecurityRestricted(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	for ns, want := range map[string][]string{controlNS: {"nats", "aaas-edge", "aaas-lifecycle", "aaas-sweeper"}, sandboxNS: {"dsh-web"}} {
		n, err := cluster.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n.Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
			t.Fatalf("namespace %s labels %v", ns, n.Labels)
		}
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		running := map[string]int{}
		for _, p := range pods.Items {
			if p.Status.Phase == corev1.PodRunning {
				running[p.Labels["app.kubernetes.io/name"]]++
			}
		}
		for _, name := range want {
			if running[name] == 0 {
				t.Errorf("no %s pod running under restricted in %s: %v", name, ns, running)
			}
		}
		bad := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "not-restricted"},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: probeRef}}},
		}
		_, err = cluster.Client.CoreV1().Pods(ns).Create(ctx, bad, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err == nil || !strings.Contains(err.Error(), "restricted") {
			t.Fatalf("%s: a pod without a restricted security context was not refused: %v", ns, err)
		}
	}
}

// probe runs netprobe against targets from inside pod and returns its
// lines by target.
func probe(t *testing.T, pod *corev1.Pod, targets ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(ephemeral(t, pod, probeRef, targets...)), "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 {
			out[strings.TrimSuffix(f[1], ":")] = l
		}
	}
	return out
}

// ephemeral runs image with args in pod as an ephemeral container (same
// network namespace, same labels, so the same policies; the restricted
// security context) and returns what it printed.
func ephemeral(t *testing.T, pod *corev1.Pod, image string, args ...string) string {
	t.Helper()
	ctx := testenv.Context(t, 2*time.Minute)
	name := "probe-" + randomHex(3)
	p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Spec.EphemeralContainers = append(p.Spec.EphemeralContainers, corev1.EphemeralContainer{
		EphemeralContainerCommon: corev1.EphemeralContainerCommon{
			Name: name, Image: image, ImagePullPolicy: corev1.PullNever, Args: args,
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
	var done *corev1.ContainerStateTerminated
	testutil.Eventually(t, time.Minute, func() error {
		p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, s := range p.Status.EphemeralContainerStatuses {
			if s.Name == name && s.State.Terminated != nil {
				done = s.State.Terminated
				return nil
			}
		}
		return fmt.Errorf("probe in %s still running", pod.Name)
	})
	b, err := cluster.Client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: name}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A probe killed with its pod (or never started) prints nothing: say
	// so rather than let every row read as an empty answer.
	if done.ExitCode != 0 {
		state := "gone"
		if p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{}); err == nil {
			state = fmt.Sprintf("%s, deleting: %v", p.Status.Phase, p.DeletionTimestamp != nil)
		}
		t.Fatalf("%s in %s ended %d (%s %s; pod %s): %q", image, pod.Name, done.ExitCode, done.Reason, done.Message, state, b)
	}
	return string(b)
}

func ptr[T any](v T) *T { return &v }

// TestReachability probes the network from inside pods with the policy
// enforcer on: tenants reach nothing of the platform and no other tenant,
// the edge and lifecycle reach sandboxes across the namespaces, the edge
// alone an app on a preview port (and on no other port), and only aaas
// pods reach NATS. Stand-ins answer pods at the cloud metadata
// address, at a public address where the API server is reached (as a
// managed cluster's endpoint is; README's API address setting names it)
// and at another public address, so that those rows are decided by
// policy, not by the test bed's routing.
func TestReachability(t *testing.T) {
	ctx := testenv.Context(t, 3*time.Minute)
	metadata := standIn(t, "169.254.169.254:80", "")
	api := standIn(t, apiEndpoint, cluster.Config.Host)
	public := standIn(t, "198.51.100.8:443", "")
	list := func(selector string) []corev1.Pod {
		pods, err := cluster.Client.CoreV1().Pods(controlNS).List(ctx, metav1.ListOptions{LabelSelector: selector, FieldSelector: "status.phase=Running"})
		if err != nil {
			t.Fatal(err)
		}
		if len(pods.Items) == 0 {
			t.Fatalf("no running pod for %s", selector)
		}
		return pods.Items
	}
	// The sandboxes probed from and to belong to users of this test, kept
	// awake: this install suspends a sandbox after 20 s without traffic,
	// and the probes go around the gateway, so a sandbox of an earlier
	// test (or of this one, unheld) is suspended mid-probe and its pod
	// goes with the probe in it (clean-clone runs saw both: a probe that
	// printed nothing, an app refused on a pod already gone). Spares are
	// no steadier: the warm pool replaces those it finds stale or excess.
	// A user's agent runs dev servers on a preview port (5173) and on one
	// the policy does not list (5174), started through DSH on pia's origin.
	c := client(t, ingress(t)).WithTimeout(2 * time.Minute)
	auth := bearer(awakeUser(t, c, "pia"))
	for _, port := range []string{"5173", "5174"} {
		if r := c.At(origin("pia")).Do("POST", "/api/apps?port="+port, nil, auth...); r.StatusCode != http.StatusCreated {
			t.Fatalf("start an app on %s: %d %s", port, r.StatusCode, r.Body)
		}
	}
	awakeUser(t, client(t, ingress(t)).WithTimeout(2*time.Minute), "quinn")
	pia, quinn := runningPod(t, "pia"), runningPod(t, "quinn")
	// quinn's sandbox probes; pia's is the other tenant it must not reach.
	sandboxes := []corev1.Pod{quinn, pia}
	other := quinn
	edges, lifecycles, nats := list("app.kubernetes.io/name=aaas-edge"), list("app.kubernetes.io/name=aaas-lifecycle"), list("app.kubernetes.io/name=nats")
	brokers := list("app.kubernetes.io/name=aaas-broker")
	preview, unlisted := net.JoinHostPort(pia.Status.PodIP, "5173"), net.JoinHostPort(pia.Status.PodIP, "5174")
	svc := func(name string) string {
		s, err := cluster.Client.CoreV1().Services(controlNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return s.Spec.ClusterIP
	}
	apiSvc, err := cluster.Client.CoreV1().Services("default").Get(ctx, "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	apiHost := strings.TrimPrefix(cluster.Config.Host, "https://")
	var (
		sandbox       = net.JoinHostPort(sandboxes[1].Status.PodIP, "3080")
		natsPod       = net.JoinHostPort(nats[0].Status.PodIP, "4222")
		natsService   = net.JoinHostPort(svc("nats"), "4222")
		apiService    = net.JoinHostPort(apiSvc.Spec.ClusterIP, "443")
		apiServer     = apiHost
		edgeMetrics   = net.JoinHostPort(edges[0].Status.PodIP, "9090")
		edgeHTTP      = net.JoinHostPort(edges[0].Status.PodIP, "8080")
		natsMonitor   = net.JoinHostPort(nats[0].Status.PodIP, "8222")
		natsRoute     = net.JoinHostPort(nats[0].Status.PodIP, "6222")
		lifecycleMetr = net.JoinHostPort(lifecycles[0].Status.PodIP, "9091")
		brokerPod     = net.JoinHostPort(brokers[0].Status.PodIP, "8090")
		brokerService = net.JoinHostPort(svc("aaas-broker"), "8090")
		brokerMetrics = net.JoinHostPort(brokers[0].Status.PodIP, "9093")
	)
	stranger := strangerPod(t, controlNS)
	tenantStranger := strangerPod(t, sandboxNS)
	if err := cluster.CreateNamespace(ctx, "monitoring"); err != nil {
		t.Fatal(err)
	}
	monitor := strangerPod(t, "monitoring")
	// kube-router puts a new pod's address into the policies' sets
	// asynchronously, and a loaded node takes its time (a clean-clone run
	// saw this brand-new pod refused everywhere): wait until the
	// monitoring pod's first allowed path is open before judging the rest.
	// Only an allowed path is waited for; a denied one is judged as it is,
	// since waiting could only hide a hole.
	testutil.Eventually(t, 2*time.Minute, func() error {
		if line := probe(t, monitor, edgeMetrics)[edgeMetrics]; !strings.HasPrefix(line, "open ") {
			return fmt.Errorf("the monitoring pod does not reach the edge's metrics port yet: %s", line)
		}
		return nil
	})
	checkReach(t, []reach{
		{&sandboxes[0], natsPod, false, "a sandbox reaches NATS (pod)"},
		{&sandboxes[0], natsService, false, "a sandbox reaches NATS (Service)"},
		{&sandboxes[0], natsRoute, false, "a sandbox reaches NATS's route port"},
		{&sandboxes[0], natsMonitor, false, "a sandbox reaches NATS's monitoring port"},
		{&sandboxes[0], apiService, false, "a sandbox reaches the API server (Service)"},
		{&sandboxes[0], apiServer, false, "a sandbox reaches the API server (its own address)"},
		{&sandboxes[0], api, false, "a sandbox reaches the API server's public endpoint (README's API address)"},
		{&sandboxes[0], public, true, "a sandbox reaches a public address (control)"},
		{&sandboxes[0], sandbox, false, "a sandbox reaches another sandbox"},
		{&sandboxes[0], edgeMetrics, false, "a sandbox reaches the edge's metrics port"},
		{&sandboxes[0], edgeHTTP, false, "a sandbox reaches the edge directly"},
		{&sandboxes[0], lifecycleMetr, false, "a sandbox reaches lifecycle's metrics port"},
		{&sandboxes[0], metadata, false, "a sandbox reaches the cloud metadata address"},
		{&edges[0], sandbox, true, "the edge reaches a sandbox on 3080"},
		{&edges[0], natsService, true, "the edge reaches NATS"},
		{&lifecycles[0], sandbox, true, "lifecycle reaches a sandbox on 3080"},
		{&edges[0], preview, true, "the edge reaches a sandbox's app on a preview port"},
		{&edges[0], unlisted, false, "the edge reaches a sandbox's app on a port not listed"},
		{&lifecycles[0], preview, false, "lifecycle reaches a sandbox's preview port"},
		{&other, preview, false, "a sandbox reaches another sandbox's preview port"},
		{&lifecycles[0], natsPod, true, "lifecycle reaches NATS"},
		{stranger, natsPod, false, "a pod that is not aaas reaches NATS"},
		{stranger, natsService, false, "a pod that is not aaas reaches NATS (Service)"},
		{stranger, sandbox, false, "a pod that is not aaas reaches a sandbox"},
		{stranger, preview, false, "a pod that is not aaas reaches a sandbox's preview port"},
		{tenantStranger, preview, false, "another pod in the tenants' namespace reaches a preview port"},
		{tenantStranger, natsPod, false, "another pod in the tenants' namespace reaches NATS"},
		{tenantStranger, edgeHTTP, false, "another pod in the tenants' namespace reaches the edge"},
		{stranger, api, true, "the API endpoint stand-in answers pods without a policy (control)"},
		{stranger, metadata, true, "the metadata stand-in answers pods without a policy (control)"},
		{stranger, lifecycleMetr, true, "lifecycle's metrics port is open (control)"},
		{&lifecycles[0], apiService, true, "lifecycle reaches the API server (control)"},
		{monitor, edgeMetrics, true, "the monitoring namespace reaches the edge's metrics port"},
		{monitor, natsMonitor, true, "the monitoring namespace reaches NATS's monitoring port"},
		{monitor, natsPod, false, "the monitoring namespace reaches NATS's client port"},
		{monitor, edgeHTTP, false, "the monitoring namespace reaches the edge's HTTP port"},
		// The model broker: sandboxes on its port only, nobody else; it
		// reaches no sandbox.
		{&sandboxes[0], brokerService, true, "a sandbox reaches the broker (Service)"},
		{&sandboxes[0], brokerPod, true, "a sandbox reaches the broker (pod)"},
		{&sandboxes[0], brokerMetrics, false, "a sandbox reaches the broker's metrics port"},
		{&edges[0], brokerPod, false, "the edge reaches the broker"},
		{&lifecycles[0], brokerPod, false, "lifecycle reaches the broker"},
		{stranger, brokerService, false, "a pod that is not aaas reaches the broker"},
		{tenantStranger, brokerPod, false, "another pod in the tenants' namespace reaches the broker"},
		{&brokers[0], sandbox, false, "the broker reaches a sandbox"},
		{&brokers[0], natsService, true, "the broker reaches NATS"},
		{monitor, brokerMetrics, true, "the monitoring namespace reaches the broker's metrics port"},
		{monitor, brokerPod, false, "the monitoring namespace reaches the broker's HTTP port"},
	})
}

// reach is one row of a reachability matrix: whether from opens a TCP
// connection to target, and what it means.
type reach struct {
	from    *corev1.Pod
	target  string
	open    bool
	meaning string
}

// checkReach probes every row from inside its pod (one ephemeral
// container per pod) and reports each row's outcome.
func checkReach(t *testing.T, rows []reach) {
	t.Helper()
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

// standIn answers TCP on addr for pods only: a local route in the pods'
// own routing table delivers their packets to it on this machine (the
// machine's own route to the address is untouched). With forward (an
// https:// URL or host:port), each connection is relayed there, so the
// stand-in is that server at this address; otherwise it writes a line and
// closes.
func standIn(t *testing.T, addr, forward string) string {
	t.Helper()
	forward = strings.TrimPrefix(forward, "https://")
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
			if forward == "" {
				_, _ = io.WriteString(c, "stand-in\n")
				c.Close()
				continue
			}
			go func() {
				defer c.Close()
				up, err := net.DialTimeout("tcp", forward, 5*time.Second)
				if err != nil {
					return
				}
				defer up.Close()
				go func() { _, _ = io.Copy(up, c) }()
				_, _ = io.Copy(c, up)
			}()
		}
	}()
	return addr
}

// awakeUser signs user up on c and keeps her sandbox awake until the test
// ends (then lets it sleep again); it returns her bearer token.
func awakeUser(t *testing.T, c *testenv.Client, user string) string {
	t.Helper()
	tok := c.Signup(user, invite)
	hold := func(d string) error {
		if r := c.Form("/_/keepawake", "for", d); r.StatusCode != http.StatusOK {
			return fmt.Errorf("keep-awake %s for %s: %d %s", d, user, r.StatusCode, r.Body)
		}
		return nil
	}
	testutil.Eventually(t, 3*time.Minute, func() error { return hold("30m") })
	t.Cleanup(func() {
		if err := hold("0"); err != nil {
			t.Error(err)
		}
	})
	return tok
}

// runningPod waits for user's sandbox to have exactly one pod, running
// with an address, and returns it.
func runningPod(t *testing.T, user string) corev1.Pod {
	t.Helper()
	var pod corev1.Pod
	testutil.Eventually(t, 3*time.Minute, func() error {
		pods := userPods(t, user)
		if len(pods) != 1 || pods[0].Status.Phase != corev1.PodRunning || pods[0].Status.PodIP == "" {
			return fmt.Errorf("%s has %d pods, want one running", user, len(pods))
		}
		pod = pods[0]
		return nil
	})
	return pod
}
