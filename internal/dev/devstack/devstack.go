// Package devstack runs the whole system on one machine for `make run`.
// On the simulated node (the default): an embedded NATS server with the
// streams and buckets provisioned, a local Kubernetes control plane
// (devcluster) with a warm pool of dshsim sandboxes, and the aaas
// processes as local processes. On the real node (`make run NODE=real`):
// the documented install (agent-sandbox, then base, sandbox and the ingress
// exposure) from locally built images on a real kubelet, with the edges'
// Service forwarded to the same local ports. Either way the processes take
// the operator's settings (config.Variables) from the environment, and
// every run starts from a clean state.
package devstack

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/manifests"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/natsauth"
)

// The namespaces, as in the manifests: the control plane's (lifecycle's
// ServiceAccount; on the real node everything but the sandboxes) and the
// tenants' (sandboxes, claims, template, pool, lifecycle's Role).
const (
	ControlPlaneNamespace = config.DefaultControlPlaneNamespace
	SandboxNamespace      = config.DefaultSandboxNamespace
)

// Options configures a stack.
type Options struct {
	// StateDir holds NATS data, the cluster and logs; it is wiped at start.
	StateDir string
	NATSPort int
	// EdgePorts are where the edge replicas listen (one replica each).
	EdgePorts []int
	// MetricsPort is the first metrics port; processes take consecutive
	// ones. Zero picks a free port for each.
	MetricsPort int
	// BinDir holds the aaas binaries (dshsim, edge, lifecycle, sweeper).
	BinDir string
	// Node is devcluster.NodeSimulated (default) or devcluster.NodeReal.
	Node devcluster.NodeKind
	// PathMode serves every sandbox under /u/<user>/ on the edges' own
	// hosts (SANDBOX_DOMAIN empty). By default each sandbox has its own
	// origin, <user>.localhost:<port> (SANDBOX_DOMAIN=localhost:<port>,
	// unless the environment sets SANDBOX_DOMAIN): browsers resolve
	// *.localhost to this machine and treat it as a secure context.
	PathMode bool
	// Env adds to every process's environment (e.g. a short IDLE_TIMEOUT);
	// it wins over the settings taken from the environment.
	Env map[string]string
	// Getenv reads the operator's settings (os.Getenv when nil).
	Getenv func(string) string
	// Ready, if set, receives what a client of the stack needs once it
	// serves.
	Ready func(Info)
	Out   io.Writer
	Log   *slog.Logger
}

// Info describes a running stack.
type Info struct {
	NATSURL string
	// NATSAdmin is the seed file of an unrestricted NATS identity, for
	// harnesses that inspect the stack.
	NATSAdmin  string
	Kubeconfig string // admin
	EdgeURLs   []string
	// SandboxDomains are the edges' SANDBOX_DOMAIN, one per EdgeURLs entry
	// ("" in path mode).
	SandboxDomains []string
	Invite         string
	// Metrics and PIDs map a process name (lifecycle, edge-a, …) to its
	// metrics address and process id.
	Metrics map[string]string
	PIDs    map[string]int
	// Broker is the model broker's URL (the sandboxes' provider base URLs
	// are under it); Provider is the stand-in's, which ProviderKey opens
	// (for harnesses measuring the broker beside a direct call).
	Broker, Provider, ProviderKey string
}

// owned are the settings devstack itself decides: where each process
// listens, how it finds NATS and Kubernetes, and its name.
var owned = map[string]bool{
	"NATS_URL": true, "LISTEN_ADDR": true, "METRICS_ADDR": true, "INSTANCE_ID": true,
	"KUBECONFIG": true, "SANDBOX_NAMESPACE": true, "CONTROL_PLANE_NAMESPACE": true,
}

// settings are the operator's settings from the environment (every
// variable an aaas process reads, except the ones devstack owns), with
// o.Env on top.
func (o Options) settings() map[string]string {
	getenv := o.Getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	out := map[string]string{}
	for _, name := range config.Variables() {
		if v := getenv(name); v != "" && !owned[name] {
			out[name] = v
		}
	}
	for k, v := range o.Env {
		out[k] = v
	}
	return out
}

// Run starts the stack and blocks until ctx ends, then stops everything.
func Run(ctx context.Context, o Options) error {
	start := time.Now()
	bin, err := filepath.Abs(o.BinDir)
	if err != nil {
		return err
	}
	o.BinDir = bin
	if err := os.RemoveAll(o.StateDir); err != nil {
		return fmt.Errorf("clean %s: %w", o.StateDir, err)
	}
	if o.Node == devcluster.NodeReal {
		return runReal(ctx, o, start)
	}
	// NATS with the production identities: each process kind its own
	// nkey and permissions, no anonymous clients.
	ids, err := natsauth.Generate(filepath.Join(o.StateDir, "nats-keys"))
	if err != nil {
		return err
	}
	ns, err := embednats.Start(embednats.Options{Dir: filepath.Join(o.StateDir, "nats"), Port: o.NATSPort, Name: "devstack", Users: ids.Users()})
	if err != nil {
		return fmt.Errorf("start nats: %w", err)
	}
	defer ns.Stop()
	env := map[string]string{
		"HANDSHAKE_KEYS": randomKey(), "LOG_LEVEL": "info", "SIGNUP_INVITE_CODE": randomString(9),
		"COOKIE_SECURE": "false", "ALLOW_INSECURE_COOKIES": "1",
		// The development sizing: its caps fit the embedded server's store.
		"EXPECTED_ACCOUNTS": "10000",
	}
	for k, v := range o.settings() {
		env[k] = v
	}
	logDir := filepath.Join(o.StateDir, "logs")
	if err := os.MkdirAll(logDir, 0o700); err != nil {
		return err
	}
	// The setup step, as lifecycle's init container runs it.
	setup, err := startChild("setup", filepath.Join(o.BinDir, "setup"), logDir, processEnv(env, ns.URL(), ids, natsauth.Setup, nil))
	if err != nil {
		return err
	}
	if err := setup.Wait(ctx, time.Minute); err != nil {
		return fmt.Errorf("%w; see %s", err, setup.LogPath())
	}
	fmt.Fprintf(o.Out, "NATS       %s (streams %s, %s, %s)\n", ns.URL(), events.StreamCommands, events.StreamActivity, events.StreamAudit)

	// Model calls: the provider stand-in, and the broker the sandboxes
	// call (started with the other processes).
	m, err := newModels(o.StateDir, env)
	if err != nil {
		return err
	}
	sim, err := startChild("providersim", filepath.Join(o.BinDir, "providersim"), logDir, m.simEnv(o.Env))
	if err != nil {
		return err
	}
	defer sim.Stop(5 * time.Second)
	fmt.Fprintf(o.Out, "models     the broker at http://%s, in front of the provider stand-in at http://%s (logs/providersim.log)\n", m.brokerAddr, m.simAddr)

	fmt.Fprintln(o.Out, "starting the local control plane (etcd, kube-apiserver, kube-controller-manager, agent-sandbox)…")
	cluster, err := devcluster.Start(ctx, devcluster.Options{
		Dir:    filepath.Join(o.StateDir, "devcluster"),
		DSHSim: filepath.Join(o.BinDir, "dshsim"),
		Log:    o.Log,
	})
	if err != nil {
		return fmt.Errorf("start devcluster: %w", err)
	}
	defer cluster.Stop()
	for _, ns := range []string{ControlPlaneNamespace, SandboxNamespace} {
		if err := cluster.CreateNamespace(ctx, ns); err != nil {
			return err
		}
	}
	if err := cluster.InstallSandboxes(ctx, SandboxNamespace, m.sandboxes); err != nil {
		return fmt.Errorf("warm pool: %w", err)
	}
	fmt.Fprintf(o.Out, "Kubernetes %s\n           kubectl --kubeconfig %s -n %s get sandboxes,pods\n", cluster.Config.Host, cluster.Kubeconfig, SandboxNamespace)

	kubeconfig, err := lifecycleCredentials(ctx, cluster)
	if err != nil {
		return err
	}
	children, err := startProcesses(o, logDir, ns.URL(), ids, kubeconfig, env, m)
	defer func() {
		// Edges first (they drain), then the workers.
		for i := len(children) - 1; i >= 0; i-- {
			children[i].Stop(30 * time.Second)
		}
	}()
	if err != nil {
		return err
	}
	if err := waitServing(ctx, o.EdgePorts, children); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "logs       %s\n", filepath.Join(o.StateDir, "logs"))
	info := Info{NATSURL: ns.URL(), NATSAdmin: ids.SeedFile(natsauth.Admin), Kubeconfig: cluster.Kubeconfig, Invite: env["SIGNUP_INVITE_CODE"], Metrics: map[string]string{}, PIDs: map[string]int{},
		Broker: "http://" + m.brokerAddr, Provider: "http://" + m.simAddr, ProviderKey: m.env["PROVIDERSIM_KEYS"]}
	for _, port := range o.EdgePorts {
		info.SandboxDomains = append(info.SandboxDomains, o.sandboxDomain(env, port))
	}
	for _, c := range children {
		info.Metrics[c.Name()] = c.metrics
		info.PIDs[c.Name()] = c.PID()
	}
	o.ready(info, start)
	select {
	case <-ctx.Done():
	case name := <-exitedChild(children):
		fmt.Fprintf(o.Out, "%s exited; see its log. Stopping.\n", name)
	}
	fmt.Fprintln(o.Out, "stopping…")
	return nil
}

// ready prints what to open and hands info to o.Ready.
func (o Options) ready(info Info, start time.Time) {
	for i, port := range o.EdgePorts {
		fmt.Fprintf(o.Out, "open       http://localhost:%d/\n", port)
		info.EdgeURLs = append(info.EdgeURLs, fmt.Sprintf("http://localhost:%d", port))
		switch domain := info.SandboxDomains[i]; domain {
		case "":
			fmt.Fprintf(o.Out, "           sandboxes at http://localhost:%d/u/<user>/ (path mode: all on the gateway's origin)\n", port)
		default:
			fmt.Fprintf(o.Out, "           sandboxes at http://<user>.%s/ (each its own origin; Chromium resolves *.localhost here)\n", domain)
		}
	}
	if info.Invite != "" {
		fmt.Fprintf(o.Out, "invite     %s\n", info.Invite)
	}
	fmt.Fprintf(o.Out, "ready in %s. Press Ctrl-C to stop.\n", time.Since(start).Round(100*time.Millisecond))
	if o.Ready != nil {
		o.Ready(info)
	}
}

// lifecycleCredentials applies lifecycle's ServiceAccount (manifests/base,
// the control plane's namespace) and its Role and RoleBinding
// (manifests/sandbox, the tenants' namespace) as the manifests place them,
// and returns a kubeconfig for it, so the local worker runs with exactly
// the production rights.
func lifecycleCredentials(ctx context.Context, c *devcluster.Cluster) (string, error) {
	var rbac []*unstructured.Unstructured
	for dir, kinds := range map[string][]string{"manifests/base": {"ServiceAccount"}, "manifests/sandbox": {"Role", "RoleBinding"}} {
		objs, err := manifests.Render(dir)
		if err != nil {
			return "", err
		}
		for _, kind := range kinds {
			rbac = append(rbac, manifests.Pick(objs, kind)...)
		}
	}
	if err := c.Apply(ctx, SandboxNamespace, rbac...); err != nil {
		return "", err
	}
	path, _, err := c.ServiceAccountKubeconfig(ctx, ControlPlaneNamespace, "aaas-lifecycle")
	return path, err
}

// processEnv is the environment of one process: the stack's settings,
// where NATS is and the role's own nkey, and extra.
func processEnv(settings map[string]string, natsURL string, ids *natsauth.Identities, role natsauth.Role, extra map[string]string) map[string]string {
	env := map[string]string{"PATH": os.Getenv("PATH")}
	for k, v := range settings {
		env[k] = v
	}
	env["NATS_URL"], env["NATS_NKEY"] = natsURL, ids.SeedFile(role)
	for k, v := range extra {
		env[k] = v
	}
	return env
}

func startProcesses(o Options, logDir, natsURL string, ids *natsauth.Identities, kubeconfig string, settings map[string]string, m *models) ([]*aaasProc, error) {
	metrics := o.MetricsPort
	with := func(role natsauth.Role, extra map[string]string) map[string]string {
		port := metrics
		if o.MetricsPort == 0 {
			port, _ = embednats.FreePort()
		} else {
			metrics++
		}
		extra["METRICS_ADDR"] = fmt.Sprintf("127.0.0.1:%d", port)
		return processEnv(settings, natsURL, ids, role, extra)
	}
	specs := []struct {
		name string
		env  map[string]string
	}{
		{"lifecycle", with(natsauth.Lifecycle, map[string]string{"KUBECONFIG": kubeconfig, "SANDBOX_NAMESPACE": SandboxNamespace, "CONTROL_PLANE_NAMESPACE": ControlPlaneNamespace, "INSTANCE_ID": "lifecycle-a"})},
		{"sweeper", with(natsauth.Sweeper, map[string]string{"INSTANCE_ID": "sweeper-a"})},
		{"broker", with(natsauth.Broker, m.broker())},
	}
	for i, port := range o.EdgePorts {
		specs = append(specs, struct {
			name string
			env  map[string]string
		}{fmt.Sprintf("edge-%c", 'a'+i), with(natsauth.Edge, o.edgeEnv(settings, i, port))})
	}
	var children []*aaasProc
	for _, s := range specs {
		bin := filepath.Join(o.BinDir, strings.SplitN(s.name, "-", 2)[0])
		p, err := startChild(s.name, bin, logDir, s.env)
		if err != nil {
			return children, err
		}
		children = append(children, &aaasProc{Process: p, metrics: s.env["METRICS_ADDR"]})
	}
	return children, nil
}

// aaasProc is one long-running aaas process of the stack.
type aaasProc struct {
	*child.Process
	metrics string // its METRICS_ADDR
}

// startChild starts an aaas binary with env, logging to logDir/name.log.
func startChild(name, bin, logDir string, env map[string]string) (*child.Process, error) {
	return child.Start(child.Options{Name: name, Path: bin, Env: child.Environ(env), Log: filepath.Join(logDir, name+".log")})
}

// edgeEnv is what devstack decides for edge i: loopback only (a dev stack
// with plain-HTTP cookies is not for the LAN), the names a browser on
// this machine uses for it unless the operator set PUBLIC_HOSTS, and its
// SANDBOX_DOMAIN.
func (o Options) edgeEnv(settings map[string]string, i, port int) map[string]string {
	env := map[string]string{"LISTEN_ADDR": fmt.Sprintf("127.0.0.1:%d", port), "INSTANCE_ID": fmt.Sprintf("edge-%c", 'a'+i), "SANDBOX_DOMAIN": o.sandboxDomain(settings, port)}
	if settings["PUBLIC_HOSTS"] == "" {
		env["PUBLIC_HOSTS"] = fmt.Sprintf("127.0.0.1:%d,localhost:%d", port, port)
	}
	return env
}

// sandboxDomain is the SANDBOX_DOMAIN of the edge on port: "" in path
// mode, else the environment's, else localhost:<port>, under which
// browsers resolve every name to this machine.
func (o Options) sandboxDomain(settings map[string]string, port int) string {
	switch {
	case o.PathMode:
		return ""
	case settings["SANDBOX_DOMAIN"] != "":
		return settings["SANDBOX_DOMAIN"]
	}
	return fmt.Sprintf("localhost:%d", port)
}

// waitServing waits until every edge answers /readyz.
func waitServing(ctx context.Context, ports []int, children []*aaasProc) error {
	for _, port := range ports {
		url := fmt.Sprintf("http://127.0.0.1:%d/readyz", port)
		for {
			resp, err := http.Get(url)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			for _, c := range children {
				if c.Exited() {
					return fmt.Errorf("%s exited during start; see %s", c.Name(), c.LogPath())
				}
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

func exitedChild(children []*aaasProc) <-chan string {
	ch := make(chan string, len(children))
	for _, c := range children {
		go func() { <-c.Done(); ch <- c.Name() }()
	}
	return ch
}

func randomKey() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}

func randomString(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)[:n]
}
