// Package devcluster runs a real Kubernetes control plane on this machine
// for tests and `make run`: etcd, kube-apiserver (RBAC, service-account
// tokens) and kube-controller-manager, with one of two nodes.
//
// The simulated node (the default, for the fast tests) runs on loopback
// beside the agent-sandbox CRDs and controller as host processes: it runs
// each pod's container as a real dshsim process on its own loopback IP and
// ignores images, container args and NetworkPolicy.
//
// The real node (Options.Node = NodeReal) is a kubelet with containerd,
// runc and the CNI bridge, kube-scheduler, kube-proxy, kube-router
// enforcing NetworkPolicy, CoreDNS and a volume provisioner. It runs the
// images it is given and nothing else (no registry is ever reached), keeps
// all pod traffic on this machine, needs root, runs one at a time, and
// leaves the machine as it found it. agent-sandbox is installed on it the
// way operators install it (InstallAgentSandbox).
package devcluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/embednats"
)

// NodeKind selects the node a cluster runs.
type NodeKind string

const (
	// NodeSimulated runs every container as a dshsim process.
	NodeSimulated NodeKind = "sim"
	// NodeReal runs a real kubelet with containerd.
	NodeReal NodeKind = "real"
)

// Options configures a cluster.
type Options struct {
	// Dir holds all state; a new temp dir (removed on Stop) when empty.
	Dir string
	// Node is NodeSimulated (default) or NodeReal.
	Node NodeKind
	// DSHSim is the dshsim binary the simulated node runs for every
	// container (simulated node only).
	DSHSim string
	// Images are docker-archive tarballs the real node imports before it
	// reports ready (the pause image is built and imported by devcluster).
	Images []string
	// ProbePeriod caps probe periods so tests need not wait a pod's full
	// periodSeconds (default 250ms).
	ProbePeriod time.Duration
	// CrashBackoff is the first restart delay of a crashed container; it
	// doubles per restart up to 32x (default 500ms; the kubelet uses 10s).
	CrashBackoff time.Duration
	Log          *slog.Logger
}

// Cluster is a running control plane with one simulated node.
type Cluster struct {
	// Dir holds etcd data, certificates, kubeconfigs, logs, pod and volume
	// directories.
	Dir string
	// Kubeconfig is the path of an admin (system:masters) kubeconfig.
	Kubeconfig string
	// Config and Client are admin access.
	Config *rest.Config
	Client kubernetes.Interface
	// Node is the simulated node (nil on a real node).
	Node *Node
	// Real is the real node (nil on a simulated node).
	Real *RealNode
	// EtcdURL is etcd's client URL (plain HTTP on loopback): tests read
	// the API server's writes from its history there.
	EtcdURL string

	ownDir bool
	pki    *pki
	server string
	procs  []*child.Process // in start order
	// opts are how each of procs was started, for RestartControlPlane.
	opts    []child.Options
	cancel  context.CancelFunc
	log     *slog.Logger
	started time.Time
}

// Start brings the cluster up and returns once the agent-sandbox
// controller is running and the node is Ready.
func Start(ctx context.Context, o Options) (_ *Cluster, err error) {
	bins, err := findBinaries()
	if err != nil {
		return nil, err
	}
	switch o.Node {
	case "", NodeSimulated:
		o.Node = NodeSimulated
		if o.DSHSim == "" {
			return nil, errors.New("devcluster: Options.DSHSim (the dshsim binary) is required")
		}
		// Containers run in their pod's directory: a relative path would not
		// resolve there.
		if o.DSHSim, err = filepath.Abs(o.DSHSim); err != nil {
			return nil, fmt.Errorf("devcluster: %w", err)
		}
	case NodeReal:
	default:
		return nil, fmt.Errorf("devcluster: unknown node kind %q (want %s or %s)", o.Node, NodeSimulated, NodeReal)
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.ProbePeriod == 0 {
		o.ProbePeriod = 250 * time.Millisecond
	}
	if o.CrashBackoff == 0 {
		o.CrashBackoff = 500 * time.Millisecond
	}
	c := &Cluster{Dir: o.Dir, log: o.Log, started: time.Now()}
	if c.Dir == "" {
		if c.Dir, err = os.MkdirTemp("", "devcluster-"); err != nil {
			return nil, fmt.Errorf("devcluster dir: %w", err)
		}
		c.ownDir = true
	}
	if c.Dir, err = filepath.Abs(c.Dir); err != nil {
		return nil, fmt.Errorf("devcluster dir: %w", err)
	}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	for _, d := range []string{"logs", "etcd", "pods", "pvcs"} {
		if err := os.MkdirAll(filepath.Join(c.Dir, d), 0o700); err != nil {
			return nil, fmt.Errorf("devcluster dir: %w", err)
		}
	}
	if c.pki, err = newPKI(filepath.Join(c.Dir, "pki")); err != nil {
		return nil, err
	}
	if o.Node == NodeReal {
		// The lock, a killed run's leftovers and the network the API
		// server binds to come before anything else.
		if c.Real, err = prepareRealNode(c, bins); err != nil {
			return nil, err
		}
		if err := c.pki.all(apiServiceIP, gatewayIP); err != nil {
			return nil, err
		}
		if err := c.pki.realNode(realNodeName, gatewayIP); err != nil {
			return nil, err
		}
	} else if err := c.pki.all(simServiceIP); err != nil {
		return nil, err
	}

	if c.EtcdURL, err = c.startEtcd(bins.etcd); err != nil {
		return nil, err
	}
	// A kube-apiserver whose first storage calls time out (etcd slow on
	// a loaded machine; a clean-clone make test saw one exit 255) exits:
	// start it once more, as a supervisor would.
	if err := c.startAPIServer(ctx, bins.apiserver, c.EtcdURL); errors.Is(err, errExited) {
		c.log.Warn("kube-apiserver exited while starting; starting it again", "err", err)
		err = c.startAPIServer(ctx, bins.apiserver, c.EtcdURL)
		if err != nil {
			return nil, err
		}
	} else if err != nil {
		return nil, err
	}
	if c.Real != nil {
		if err := c.startControllerManager(bins.controllerManager); err != nil {
			return nil, err
		}
		if err := c.startScheduler(bins.scheduler); err != nil {
			return nil, err
		}
		if err := c.Real.start(ctx, bins, o.Images); err != nil {
			return nil, err
		}
		c.log.Info("devcluster ready", "node", "real", "dir", c.Dir, "server", c.server, "took", time.Since(c.started).Round(time.Millisecond))
		return c, nil
	}
	// CRDs before the controller manager: its garbage collector discovers
	// resource types at start and otherwise only on a 30s resync, so claims
	// deleted meanwhile would keep their sandboxes that long.
	if err := c.installCRDs(ctx); err != nil {
		return nil, err
	}
	if err := c.startControllerManager(bins.controllerManager); err != nil {
		return nil, err
	}
	if err := c.startAgentSandbox(bins.agentSandbox); err != nil {
		return nil, err
	}
	nctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	if c.Node, err = startNode(nctx, c.Client, nodeOptions{
		dir: c.Dir, dshsim: o.DSHSim, pki: c.pki, probePeriod: o.ProbePeriod, crashBackoff: o.CrashBackoff, log: o.Log,
	}); err != nil {
		return nil, err
	}
	c.log.Info("devcluster ready", "dir", c.Dir, "server", c.server, "took", time.Since(c.started).Round(time.Millisecond))
	return c, nil
}

// Stop shuts down the node's pods and every control-plane process, newest
// first, and removes the directory if Start created it. It is safe to call
// more than once.
func (c *Cluster) Stop() {
	if err := c.stop(); err != nil {
		c.log.Warn("devcluster stop", "err", err)
	}
}

// StopChecked is Stop that reports what it could not clean up.
func (c *Cluster) StopChecked() error { return c.stop() }

func (c *Cluster) stop() error {
	if c.Node != nil {
		c.Node.shutdown()
	}
	if c.Real != nil {
		c.Real.stopNode()
	}
	if c.cancel != nil {
		c.cancel()
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].Stop(10 * time.Second)
	}
	c.procs, c.opts = nil, nil
	var err error
	if c.Real != nil {
		err = c.Real.release()
		c.Real = nil
	}
	if c.ownDir && c.Dir != "" {
		if rerr := os.RemoveAll(c.Dir); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}
	return err
}

// PIDs lists the control-plane and container processes still running.
func (c *Cluster) PIDs() []int {
	var pids []int
	for _, p := range c.procs {
		if !p.Exited() {
			pids = append(pids, p.PID())
		}
	}
	if c.Node != nil {
		pids = append(pids, c.Node.pids()...)
	}
	return pids
}

func (c *Cluster) start(name, bin string, args []string, env []string) (*child.Process, error) {
	if env == nil {
		env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + c.Dir}
	}
	o := child.Options{Name: name, Path: bin, Args: args, Env: env, Dir: c.Dir, Log: filepath.Join(c.Dir, "logs", name+".log")}
	p, err := child.Start(o)
	if err != nil {
		return nil, err
	}
	c.procs = append(c.procs, p)
	c.opts = append(c.opts, o)
	return p, nil
}

// RestartControlPlane stops kube-apiserver and etcd (SIGTERM), keeps them
// down for down, and starts them again on the same ports and data, as a
// control-plane upgrade or a managed cluster's API outage does; it returns
// once the API server is ready again. Clients see refused connections
// meanwhile, then their watches expire and must resync.
func (c *Cluster) RestartControlPlane(ctx context.Context, down time.Duration) error {
	idx := map[string]int{}
	for i, p := range c.procs {
		idx[p.Name()] = i
	}
	ei, eok := idx["etcd"]
	ai, aok := idx["kube-apiserver"]
	if !eok || !aok {
		return errors.New("devcluster: no etcd or kube-apiserver to restart")
	}
	c.procs[ai].Stop(10 * time.Second)
	c.procs[ei].Stop(10 * time.Second)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(down):
	}
	for _, i := range []int{ei, ai} {
		p, err := child.Start(c.opts[i])
		if err != nil {
			return err
		}
		c.procs[i] = p
	}
	tr, err := rest.TransportFor(c.Config)
	if err != nil {
		return err
	}
	return c.waitHealthy(c.procs[ai], c.server+"/readyz", &http.Client{Transport: tr, Timeout: 5 * time.Second}, 90*time.Second)
}

// waitHealthy polls url until it answers 200, the process dies, or the
// timeout passes; errors include the end of the process log.
func (c *Cluster) waitHealthy(p *child.Process, url string, client *http.Client, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if p.Exited() {
			return fmt.Errorf("%s %w: %v\n%s", p.Name(), errExited, p.Err(), p.LogTail(20))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not healthy after %s (%v)\n%s", p.Name(), timeout, err, p.LogTail(20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *Cluster) startEtcd(bin string) (string, error) {
	cport, err := embednats.FreePort()
	if err != nil {
		return "", err
	}
	pport, err := embednats.FreePort()
	if err != nil {
		return "", err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(cport)
	peer := "http://127.0.0.1:" + strconv.Itoa(pport)
	p, err := c.start("etcd", bin, []string{
		"--name=devcluster",
		"--data-dir=" + filepath.Join(c.Dir, "etcd"),
		"--listen-client-urls=" + client, "--advertise-client-urls=" + client,
		"--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
		"--initial-cluster=devcluster=" + peer,
		"--snapshot-count=100000",
		"--quota-backend-bytes=4294967296",
		"--log-level=warn",
	}, nil)
	if err != nil {
		return "", err
	}
	return client, c.waitHealthy(p, client+"/health", http.DefaultClient, 30*time.Second)
}

// simServiceIP is the API server's Service address on the simulated node,
// which has no Services otherwise.
const simServiceIP = "10.0.0.1"

func (c *Cluster) startAPIServer(ctx context.Context, bin, etcdURL string) error {
	port, err := embednats.FreePort()
	if err != nil {
		return err
	}
	// On the simulated node everything is loopback. The real node's pods
	// reach the API server through the kubernetes Service, whose endpoint
	// is the address advertised here: the bridge gateway.
	addr, nodeArgs := "127.0.0.1", []string{
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.0.0.0/24",
		"--endpoint-reconciler-type=none",
	}
	if c.Real != nil {
		addr, nodeArgs = gatewayIP, []string{
			"--authorization-mode=Node,RBAC",
			"--enable-admission-plugins=NodeRestriction",
			"--service-cluster-ip-range=" + serviceCIDR,
		}
	}
	c.server = "https://" + addr + ":" + strconv.Itoa(port)
	const issuer = "https://kubernetes.default.svc.cluster.local"
	p, err := c.start("kube-apiserver", bin, append(nodeArgs,
		"--etcd-servers="+etcdURL,
		"--bind-address="+addr, "--advertise-address="+addr, "--secure-port="+strconv.Itoa(port),
		"--cert-dir="+filepath.Join(c.Dir, "pki"),
		"--tls-cert-file="+c.pki.path("apiserver.crt"), "--tls-private-key-file="+c.pki.path("apiserver.key"),
		"--client-ca-file="+c.pki.path("ca.crt"),
		"--service-account-issuer="+issuer, "--api-audiences="+issuer,
		"--service-account-key-file="+c.pki.path("sa.pub"),
		"--service-account-signing-key-file="+c.pki.path("sa.key"),
		"--kubelet-client-certificate="+c.pki.path("apiserver-kubelet-client.crt"),
		"--kubelet-client-key="+c.pki.path("apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP",
		"--allow-privileged=true",
		"--profiling=false",
		"--enable-priority-and-fairness=false",
		"--event-ttl=1h",
		"--v=0",
	), nil)
	if err != nil {
		return err
	}
	if err := c.writeAdminKubeconfig(); err != nil {
		return err
	}
	tr, err := rest.TransportFor(c.Config)
	if err != nil {
		return fmt.Errorf("admin transport: %w", err)
	}
	if err := c.waitHealthy(p, c.server+"/readyz", &http.Client{Transport: tr, Timeout: 5 * time.Second}, 90*time.Second); err != nil {
		return err
	}
	c.Client, err = kubernetes.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("admin client: %w", err)
	}
	return nil
}

func (c *Cluster) writeAdminKubeconfig() error {
	c.Config = &rest.Config{
		Host: c.server,
		TLSClientConfig: rest.TLSClientConfig{
			CAFile: c.pki.path("ca.crt"), CertFile: c.pki.path("admin.crt"), KeyFile: c.pki.path("admin.key"),
		},
		QPS: 200, Burst: 400,
	}
	c.Kubeconfig = filepath.Join(c.Dir, "admin.kubeconfig")
	return writeKubeconfig(c.Kubeconfig, c.server, c.pki.caPEM(), &clientcmdapi.AuthInfo{
		ClientCertificate: c.pki.path("admin.crt"), ClientKey: c.pki.path("admin.key"),
	})
}

func writeKubeconfig(path, server string, ca []byte, auth *clientcmdapi.AuthInfo) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["devcluster"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos["user"] = auth
	cfg.Contexts["devcluster"] = &clientcmdapi.Context{Cluster: "devcluster", AuthInfo: "user", Namespace: "default"}
	cfg.CurrentContext = "devcluster"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}

func (c *Cluster) startControllerManager(bin string) error {
	port, err := embednats.FreePort()
	if err != nil {
		return err
	}
	// The simulated node needs only the controllers behind what it fakes;
	// the real node gets all of them (workloads, endpoints, volume binding,
	// node IPAM), each with its own service account, as kubeadm runs them.
	kubeconfig, nodeArgs := c.Kubeconfig, []string{
		"--controllers=garbage-collector-controller,namespace-controller,serviceaccount-controller,serviceaccount-token-controller,persistentvolumeclaim-protection-controller,root-ca-certificate-publisher-controller",
		"--use-service-account-credentials=false",
	}
	if c.Real != nil {
		if kubeconfig, err = c.componentKubeconfig("kube-controller-manager"); err != nil {
			return err
		}
		nodeArgs = []string{
			"--use-service-account-credentials=true",
			"--allocate-node-cidrs=true", "--cluster-cidr=" + podCIDR, "--node-cidr-mask-size=24",
			"--service-cluster-ip-range=" + serviceCIDR,
		}
	}
	p, err := c.start("kube-controller-manager", bin, append(nodeArgs,
		"--kubeconfig="+kubeconfig,
		"--authentication-kubeconfig="+kubeconfig,
		"--authorization-kubeconfig="+kubeconfig,
		"--service-account-private-key-file="+c.pki.path("sa.key"),
		"--root-ca-file="+c.pki.path("ca.crt"),
		"--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(port),
		"--cert-dir="+filepath.Join(c.Dir, "pki", "kcm"),
		"--v=0",
	), nil)
	if err != nil {
		return err
	}
	return c.waitHealthy(p, "https://127.0.0.1:"+strconv.Itoa(port)+"/healthz", insecureClient, 60*time.Second)
}

// errExited is a component that exited before it was healthy.
var errExited = errors.New("exited")

// insecureClient polls the components' self-signed health endpoints.
var insecureClient = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}

// startScheduler runs kube-scheduler for the real node (the simulated node
// binds pods itself).
func (c *Cluster) startScheduler(bin string) error {
	port, err := embednats.FreePort()
	if err != nil {
		return err
	}
	kubeconfig, err := c.componentKubeconfig("kube-scheduler")
	if err != nil {
		return err
	}
	p, err := c.start("kube-scheduler", bin, []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
		"--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(port),
		"--v=0",
	}, nil)
	if err != nil {
		return err
	}
	return c.waitHealthy(p, "https://127.0.0.1:"+strconv.Itoa(port)+"/healthz", insecureClient, 60*time.Second)
}

// componentKubeconfig writes a kubeconfig for the client certificate
// <name>.crt and returns its path.
func (c *Cluster) componentKubeconfig(name string) (string, error) {
	path := filepath.Join(c.Dir, name+".kubeconfig")
	return path, writeKubeconfig(path, c.server, c.pki.caPEM(), &clientcmdapi.AuthInfo{
		ClientCertificate: c.pki.path(name + ".crt"), ClientKey: c.pki.path(name + ".key"),
	})
}

func (c *Cluster) startAgentSandbox(bin string) error {
	probe, err := embednats.FreePort()
	if err != nil {
		return err
	}
	p, err := c.start("agent-sandbox-controller", bin, []string{
		"--extensions", "--enable-webhook=false", "--leader-elect=false",
		"--metrics-bind-address=0",
		"--health-probe-bind-address=127.0.0.1:" + strconv.Itoa(probe),
		"--kubeconfig=" + c.Kubeconfig,
	}, nil)
	if err != nil {
		return err
	}
	return c.waitHealthy(p, "http://127.0.0.1:"+strconv.Itoa(probe)+"/readyz", http.DefaultClient, 60*time.Second)
}
