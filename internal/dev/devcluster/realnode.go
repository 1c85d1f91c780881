package devcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/template"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/image"
)

// realNodeName is the real node's name; only one real node runs per machine.
const realNodeName = "realnode"

// RealNode is a real kubelet with containerd, runc and the CNI bridge
// plugin, kube-proxy (iptables) for Services, kube-router (firewall only)
// enforcing NetworkPolicy, CoreDNS for cluster DNS, and a provisioner for
// PersistentVolumeClaims. It runs images imported into its containerd
// (nothing is ever pulled) and honours container args, image users,
// probes, security contexts and NetworkPolicy as a production node does.
type RealNode struct {
	Name string
	// ContainerdSocket is the address ctr and the kubelet use.
	ContainerdSocket string

	c        *Cluster
	dir      string
	lock     *os.File
	hostNet  bool
	procs    []*child.Process
	stopProv context.CancelFunc
}

// hostEnv is what the node's processes run with: they call iptables,
// mount, runc and the shim through PATH.
func hostEnv(home string) []string {
	return []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=" + home}
}

// preflightReal checks what a real node needs before anything changes on
// the machine, and says how to get what is missing.
func preflightReal(bins binaries) error {
	if os.Geteuid() != 0 {
		return errors.New("devcluster: the real node needs root (it configures networking, mounts and cgroups)")
	}
	var missing []string
	for _, c := range hostCommands {
		if _, err := exec.LookPath(c); err != nil {
			missing = append(missing, c)
		}
	}
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		missing = append(missing, "/usr/lib/cni/bridge")
	}
	for _, p := range []string{bins.kubelet, bins.kubeProxy, bins.scheduler, bins.kubeRouter, bins.coreDNS} {
		if _, err := os.Stat(p); err != nil {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("devcluster: the real node needs %s: run `make tools`", strings.Join(missing, ", "))
	}
	return nil
}

// lockRealNode takes the machine-wide lock (one real node per machine: it
// owns the bridge, the routes and the iptables chains) and cleans up after
// a previous run that was killed before it could.
func lockRealNode(dir string) (*os.File, error) {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return nil, fmt.Errorf("devcluster: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(stateDir, "realnode.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("devcluster: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		owner, _ := os.ReadFile(filepath.Join(stateDir, "realnode.dir"))
		f.Close()
		return nil, fmt.Errorf("devcluster: another real node is running on this machine (%s); stop it first", strings.TrimSpace(string(owner)))
	}
	prev, _ := os.ReadFile(filepath.Join(stateDir, "realnode.dir"))
	if p := strings.TrimSpace(string(prev)); p != "" {
		if err := cleanupHost(filepath.Join(p, "containerd", "containerd.sock"), p); err != nil {
			f.Close()
			return nil, fmt.Errorf("devcluster: cleaning up after the real node in %s: %w", p, err)
		}
		_ = os.RemoveAll(p)
	}
	if err := os.WriteFile(filepath.Join(stateDir, "realnode.dir"), []byte(dir), 0o600); dir != "" && err != nil {
		f.Close()
		return nil, fmt.Errorf("devcluster: %w", err)
	}
	return f, nil
}

// CleanupRealNode removes what a real node killed before its Stop left on
// this machine (Start does the same before it begins); it fails while
// another real node runs.
func CleanupRealNode() error {
	if os.Geteuid() != 0 {
		return nil // nothing of a real node can be here
	}
	f, err := lockRealNode("")
	if err != nil {
		return err
	}
	_ = os.Remove(filepath.Join(stateDir, "realnode.dir"))
	return f.Close()
}

// prepareRealNode runs before the control plane: the lock, the leftovers
// of a killed run, and the network the API server binds to.
func prepareRealNode(c *Cluster, bins binaries) (*RealNode, error) {
	if err := preflightReal(bins); err != nil {
		return nil, err
	}
	lock, err := lockRealNode(c.Dir)
	if err != nil {
		return nil, err
	}
	n := &RealNode{Name: realNodeName, c: c, dir: c.Dir, lock: lock, ContainerdSocket: filepath.Join(c.Dir, "containerd", "containerd.sock")}
	n.hostNet = true
	if err := setupHostNetwork(); err != nil {
		_ = n.release()
		return nil, err
	}
	return n, nil
}

// start runs the node's processes once the control plane is up.
func (n *RealNode) start(ctx context.Context, bins binaries, images []string) error {
	if err := n.startContainerd(ctx); err != nil {
		return err
	}
	pause, err := image.Pause(filepath.Join(n.dir, "images"))
	if err != nil {
		return err
	}
	if err := n.ImportImages(ctx, append([]string{pause}, images...)...); err != nil {
		return err
	}
	if err := n.startKubelet(bins.kubelet); err != nil {
		return err
	}
	if err := n.startKubeProxy(bins.kubeProxy); err != nil {
		return err
	}
	if err := n.waitReady(ctx); err != nil {
		return err
	}
	if err := n.startKubeRouter(bins.kubeRouter); err != nil {
		return err
	}
	if err := n.startCoreDNS(ctx, bins.coreDNS); err != nil {
		return err
	}
	pctx, cancel := context.WithCancel(context.Background())
	n.stopProv = cancel
	if err := startProvisioner(pctx, n.c.Client, n.Name, filepath.Join(n.dir, "volumes"), n.c.log); err != nil {
		return err
	}
	return n.waitServiceAccount(ctx)
}

func (n *RealNode) run(name, bin string, args ...string) (*child.Process, error) {
	p, err := child.Start(child.Options{Name: name, Path: bin, Args: args, Env: hostEnv(n.dir), Dir: n.dir, Log: filepath.Join(n.dir, "logs", name+".log")})
	if err != nil {
		return nil, err
	}
	n.procs = append(n.procs, p)
	return p, nil
}

// waitFor polls check until it succeeds, p exits, or timeout passes.
func waitFor(ctx context.Context, p *child.Process, what string, timeout time.Duration, check func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if p != nil && p.Exited() {
			return fmt.Errorf("%s exited: %v\n%s", p.Name(), p.Err(), p.LogTail(20))
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			tail := ""
			if p != nil {
				tail = "\n" + p.LogTail(20)
			}
			return fmt.Errorf("%s not ready after %s: %v%s", what, timeout, err, tail)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func httpOK(url string) func() error {
	return func() error {
		resp, err := (&http.Client{Timeout: 2 * time.Second}).Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", url, resp.Status)
		}
		return nil
	}
}

func render(path, text string, data any) error {
	var b bytes.Buffer
	if err := template.Must(template.New(filepath.Base(path)).Parse(text)).Execute(&b, data); err != nil {
		return err
	}
	return os.WriteFile(path, b.Bytes(), 0o600)
}

// containerdConfig keeps all of containerd's state in the cluster directory.
// restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE, so runc cannot
// lower oom_score_adj below 0 as the kubelet asks for every pod sandbox
// ("can't get final child's PID from pipe: EOF"); clamp to containerd's own.
const containerdConfig = `version = 2
root = "{{.Dir}}/containerd/root"
state = "{{.Dir}}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{{.Socket}}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{{.Pause}}"
  enable_selinux = false
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{{.Dir}}/cni"
    max_conf_num = 1
`

// cniConfig: the bridge plugin only. containerd sets up lo itself, and a
// loopback plugin in the chain would replace the bridge's result (losing
// the pod IP); no portmap, as nothing here uses hostPort.
const cniConfig = `{
  "cniVersion": "0.4.0",
  "name": "devcluster",
  "plugins": [{
    "type": "bridge",
    "bridge": "{{.Bridge}}",
    "isGateway": true,
    "ipMasq": false,
    "hairpinMode": true,
    "ipam": {
      "type": "host-local",
      "ranges": [[{"subnet": "{{.Subnet}}", "gateway": "{{.Gateway}}"}]],
      "routes": [{"dst": "0.0.0.0/0"}],
      "dataDir": "{{.Dir}}/cni-ipam"
    }
  }]
}
`

func (n *RealNode) startContainerd(ctx context.Context) error {
	for _, d := range []string{"containerd", "cni", "images", "volumes"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o700); err != nil {
			return err
		}
	}
	data := map[string]string{
		"Dir": n.dir, "Socket": n.ContainerdSocket, "Pause": image.PauseRef,
		"Bridge": bridgeName, "Subnet": nodePodCIDR, "Gateway": gatewayIP,
	}
	cfg := filepath.Join(n.dir, "containerd", "config.toml")
	if err := render(cfg, containerdConfig, data); err != nil {
		return err
	}
	if err := render(filepath.Join(n.dir, "cni", "10-devcluster.conflist"), cniConfig, data); err != nil {
		return err
	}
	p, err := n.run("containerd", "containerd", "--config", cfg)
	if err != nil {
		return err
	}
	return waitFor(ctx, p, "containerd", 30*time.Second, func() error {
		return run("ctr", "--address", n.ContainerdSocket, "version")
	})
}

// ContainerEnv is the environment of a container's process as the kernel
// holds it (/proc/<pid>/environ), for a container ID as pods report it
// ("containerd://…"): what the process was really started with, whatever
// the pod spec says.
func (n *RealNode) ContainerEnv(ctx context.Context, containerID string) ([]string, error) {
	id := strings.TrimPrefix(containerID, "containerd://")
	out, err := exec.CommandContext(ctx, "ctr", "--address", n.ContainerdSocket, "-n", "k8s.io", "tasks", "ls").Output()
	if err != nil {
		return nil, fmt.Errorf("ctr tasks ls: %w", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == id {
			b, err := os.ReadFile(filepath.Join("/proc", f[1], "environ"))
			if err != nil {
				return nil, err
			}
			return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00"), nil
		}
	}
	return nil, fmt.Errorf("container %s has no running task", id)
}

// ImportImages loads docker-archive tarballs into the node's containerd,
// where pods find them by the names they were tagged with.
func (n *RealNode) ImportImages(ctx context.Context, tarballs ...string) error {
	for _, t := range tarballs {
		cmd := exec.CommandContext(ctx, "ctr", "--address", n.ContainerdSocket, "-n", "k8s.io", "images", "import", t)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("import %s: %w: %s", filepath.Base(t), err, bytes.TrimSpace(out))
		}
	}
	return nil
}

// kubeletConfig: cgroup v1 host (kubelet ≥1.35 refuses it unless told),
// cgroupfs like containerd, pod logs and plugins in the cluster directory,
// no image garbage collection (imported images cannot be pulled again) and
// no eviction on the modest pressure a shared machine shows.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {{.IP}}
port: {{.Port}}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {{.HealthPort}}
tlsCertFile: {{.PKI}}/kubelet-serving.crt
tlsPrivateKeyFile: {{.PKI}}/kubelet-serving.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: {{.PKI}}/ca.crt}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://{{.Socket}}
imageServiceEndpoint: unix://{{.Socket}}
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /
enforceNodeAllocatable: [pods]
failSwapOn: false
clusterDNS: [{{.DNS}}]
clusterDomain: cluster.local
resolvConf: {{.Dir}}/resolv.conf
podLogsDir: {{.Dir}}/pod-logs
volumePluginDir: {{.Dir}}/kubelet/volume-plugins
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 50Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
evictionPressureTransitionPeriod: 10s
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 0s
maxPods: 110
registerNode: true
serializeImagePulls: false
`

func (n *RealNode) startKubelet(bin string) error {
	port, err := embednats.FreePort()
	if err != nil {
		return err
	}
	health, err := embednats.FreePort()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(n.dir, "resolv.conf"), []byte("nameserver "+dnsServiceIP+"\n"), 0o644); err != nil {
		return err
	}
	cfg := filepath.Join(n.dir, "kubelet-config.yaml")
	if err := render(cfg, kubeletConfig, map[string]any{
		"IP": gatewayIP, "Port": port, "HealthPort": health, "PKI": n.c.pki.dir, "Socket": n.ContainerdSocket,
		"DNS": dnsServiceIP, "Dir": n.dir,
	}); err != nil {
		return err
	}
	kc, err := n.c.componentKubeconfig("kubelet-client")
	if err != nil {
		return err
	}
	p, err := n.run("kubelet", bin, "--config="+cfg, "--kubeconfig="+kc,
		"--hostname-override="+n.Name, "--node-ip="+gatewayIP, "--root-dir="+filepath.Join(n.dir, "kubelet"), "--v=1")
	if err != nil {
		return err
	}
	return waitFor(context.Background(), p, "kubelet", 60*time.Second, httpOK(fmt.Sprintf("http://127.0.0.1:%d/healthz", health)))
}

const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {{.Kubeconfig}}
hostnameOverride: {{.Node}}
mode: iptables
clusterCIDR: {{.PodCIDR}}
bindAddress: 0.0.0.0
healthzBindAddress: 127.0.0.1:{{.Health}}
metricsBindAddress: 127.0.0.1:{{.Metrics}}
nodePortAddresses: [primary]
iptables:
  masqueradeAll: false
  syncPeriod: 30s
  minSyncPeriod: 1s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`

func (n *RealNode) startKubeProxy(bin string) error {
	kc, err := n.c.componentKubeconfig("kube-proxy")
	if err != nil {
		return err
	}
	health, err := embednats.FreePort()
	if err != nil {
		return err
	}
	metrics, err := embednats.FreePort()
	if err != nil {
		return err
	}
	cfg := filepath.Join(n.dir, "kube-proxy-config.yaml")
	if err := render(cfg, kubeProxyConfig, map[string]any{
		"Kubeconfig": kc, "Node": n.Name, "PodCIDR": podCIDR, "Health": health, "Metrics": metrics,
	}); err != nil {
		return err
	}
	p, err := n.run("kube-proxy", bin, "--config="+cfg, "--v=0")
	if err != nil {
		return err
	}
	// kube-proxy's healthz turns OK only once the node exists and its
	// rules are synced.
	return waitFor(context.Background(), p, "kube-proxy", 90*time.Second, httpOK(fmt.Sprintf("http://127.0.0.1:%d/healthz", health)))
}

func (n *RealNode) waitReady(ctx context.Context) error {
	return waitFor(ctx, nil, "node "+n.Name, 120*time.Second, func() error {
		node, err := n.c.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return errors.New("not Ready")
	})
}

func (n *RealNode) startKubeRouter(bin string) error {
	health, err := embednats.FreePort()
	if err != nil {
		return err
	}
	p, err := n.run("kube-router", bin, "--kubeconfig="+n.c.Kubeconfig, "--hostname-override="+n.Name,
		"--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
		"--enable-cni=false", "--enable-pod-egress=false", "--service-cluster-ip-range="+serviceCIDR,
		"--iptables-sync-period=1m", "--health-port="+strconv.Itoa(health), "--metrics-port=0", "--v=1")
	if err != nil {
		return err
	}
	return waitFor(context.Background(), p, "kube-router", 60*time.Second, httpOK(fmt.Sprintf("http://127.0.0.1:%d/healthz", health)))
}

// corefile: CoreDNS on the bridge gateway, answering for the cluster only.
// There is no forward plugin: nothing is ever resolved outside the machine.
// No cache either: it would keep the "no such host" a StatefulSet's pods get
// for each other's names in their first second for 30 seconds, and so hold
// up NATS's routes (the kubernetes plugin answers from its watch anyway).
const corefile = `.:53 {
    bind {{.IP}}
    errors
    health 127.0.0.1:{{.Health}}
    ready 127.0.0.1:{{.Ready}}
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig {{.Kubeconfig}} devcluster
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
}
`

// startCoreDNS runs CoreDNS as a host process and points the kube-dns
// Service at it through a selector-less EndpointSlice.
func (n *RealNode) startCoreDNS(ctx context.Context, bin string) error {
	health, err := embednats.FreePort()
	if err != nil {
		return err
	}
	ready, err := embednats.FreePort()
	if err != nil {
		return err
	}
	cfg := filepath.Join(n.dir, "Corefile")
	if err := render(cfg, corefile, map[string]any{"IP": gatewayIP, "Health": health, "Ready": ready, "Kubeconfig": n.c.Kubeconfig}); err != nil {
		return err
	}
	p, err := n.run("coredns", bin, "-conf", cfg)
	if err != nil {
		return err
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-dns", Namespace: "kube-system", Labels: map[string]string{"k8s-app": "kube-dns"}},
		Spec: corev1.ServiceSpec{ClusterIP: dnsServiceIP, Ports: []corev1.ServicePort{
			{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(53)},
			{Name: "dns-tcp", Port: 53, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(53)},
		}},
	}
	if _, err := n.c.Client.CoreV1().Services("kube-system").Create(ctx, svc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("kube-dns Service: %w", err)
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-dns-host", Namespace: "kube-system", Labels: map[string]string{
			discoveryv1.LabelServiceName: "kube-dns", discoveryv1.LabelManagedBy: "devcluster",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{
			{Name: ptr.To("dns"), Port: ptr.To[int32](53), Protocol: ptr.To(corev1.ProtocolUDP)},
			{Name: ptr.To("dns-tcp"), Port: ptr.To[int32](53), Protocol: ptr.To(corev1.ProtocolTCP)},
		},
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{gatewayIP}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}, NodeName: ptr.To(n.Name)}},
	}
	if _, err := n.c.Client.DiscoveryV1().EndpointSlices("kube-system").Create(ctx, slice, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("kube-dns EndpointSlice: %w", err)
	}
	return waitFor(ctx, p, "coredns", 30*time.Second, httpOK(fmt.Sprintf("http://127.0.0.1:%d/ready", ready)))
}

// waitServiceAccount waits for default/default and creates the default
// StorageClass the provisioner serves.
func (n *RealNode) waitServiceAccount(ctx context.Context) error {
	sc := &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: StorageClass, Annotations: map[string]string{
			"storageclass.kubernetes.io/is-default-class": "true",
		}},
		Provisioner:       provisionerName,
		ReclaimPolicy:     ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate),
	}
	if _, err := n.c.Client.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("StorageClass: %w", err)
	}
	// Pods are refused until the service-account controller made default/default.
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := n.c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
}

// stopPods stops the kubelet, then kills every container through
// containerd while it still runs (ctr tasks kill), so nothing outlives the
// node.
func (n *RealNode) stopPods(log *slog.Logger) {
	for _, p := range n.procs {
		if p.Name() == "kubelet" {
			p.Stop(10 * time.Second)
		}
	}
	if _, err := os.Stat(n.ContainerdSocket); err != nil {
		return
	}
	ctr := func(args ...string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		out, _ := exec.CommandContext(ctx, "ctr", append([]string{"--address", n.ContainerdSocket, "-n", "k8s.io"}, args...)...).Output()
		return string(out)
	}
	tasks := strings.Fields(ctr("tasks", "ls", "-q"))
	for _, t := range tasks {
		ctr("tasks", "kill", "-s", "SIGKILL", t)
	}
	for _, t := range tasks {
		for range 50 {
			if !strings.Contains(ctr("tasks", "ls", "-q"), t) {
				break
			}
			ctr("tasks", "rm", "-f", t)
			time.Sleep(100 * time.Millisecond)
		}
	}
	for _, c := range strings.Fields(ctr("containers", "ls", "-q")) {
		ctr("containers", "rm", c)
	}
	log.Debug("real node pods stopped", "tasks", len(tasks))
}

// stopNode ends the node's processes, newest first, after its pods.
func (n *RealNode) stopNode() {
	if n.stopProv != nil {
		n.stopProv()
	}
	n.stopPods(n.c.log)
	for i := len(n.procs) - 1; i >= 0; i-- {
		n.procs[i].Stop(10 * time.Second)
	}
	n.procs = nil
}

// release returns the machine to how it was and gives up the lock; the
// control plane must have stopped.
func (n *RealNode) release() error {
	var err error
	if n.hostNet {
		err = cleanupHost(n.ContainerdSocket, n.dir)
	}
	if n.lock != nil {
		_ = os.Remove(filepath.Join(stateDir, "realnode.dir"))
		n.lock.Close()
		n.lock = nil
	}
	return err
}
