// Package devstack runs the whole system on one machine for `make run`: an
// embedded NATS server with the streams and buckets provisioned, a local
// Kubernetes control plane (devcluster) with a warm pool of dshsim
// sandboxes, and the aaas processes. Every run starts from a clean state.
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

	"github.com/aaas-project/aaas/internal/devcluster"
	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/manifests"
	"github.com/aaas-project/aaas/internal/natsconn"
)

// Namespace is where the sandboxes live, as in the manifests.
const Namespace = "dsh-demo"

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
	// Env adds to every process's environment (e.g. a short IDLE_TIMEOUT).
	Env map[string]string
	// Ready, if set, receives what a client of the stack needs once it
	// serves.
	Ready func(Info)
	Out   io.Writer
	Log   *slog.Logger
}

// Info describes a running stack.
type Info struct {
	NATSURL    string
	Kubeconfig string // admin
	EdgeURLs   []string
	Invite     string
	// Metrics and PIDs map a process name (lifecycle, edge-a, …) to its
	// metrics address and process id.
	Metrics map[string]string
	PIDs    map[string]int
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
	ns, err := embednats.Start(embednats.Options{Dir: filepath.Join(o.StateDir, "nats"), Port: o.NATSPort, Name: "devstack"})
	if err != nil {
		return fmt.Errorf("start nats: %w", err)
	}
	defer ns.Stop()
	nc, js, err := natsconn.Connect(natsconn.Options{URL: ns.URL(), Name: "devstack"}, o.Log)
	if err != nil {
		return err
	}
	defer nc.Close()
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := natsconn.Provision(pctx, js, events.DefaultStreamsConfig(), kv.DefaultBucketsConfig()); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "NATS       %s (streams %s, %s, %s)\n", ns.URL(), events.StreamCommands, events.StreamActivity, events.StreamAudit)

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
	if err := cluster.CreateNamespace(ctx, Namespace); err != nil {
		return err
	}
	if err := cluster.InstallSandboxes(ctx, Namespace, nil); err != nil {
		return fmt.Errorf("warm pool: %w", err)
	}
	fmt.Fprintf(o.Out, "Kubernetes %s\n           kubectl --kubeconfig %s -n %s get sandboxes,pods\n", cluster.Config.Host, cluster.Kubeconfig, Namespace)

	kubeconfig, err := lifecycleCredentials(ctx, cluster)
	if err != nil {
		return err
	}
	invite := randomString(9)
	children, err := startProcesses(o, ns.URL(), kubeconfig, invite)
	defer func() {
		// Edges first (they drain), then the workers.
		for i := len(children) - 1; i >= 0; i-- {
			children[i].stop(30 * time.Second)
		}
	}()
	if err != nil {
		return err
	}
	if err := waitServing(ctx, o.EdgePorts, children); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "logs       %s\n", filepath.Join(o.StateDir, "logs"))
	for _, port := range o.EdgePorts {
		fmt.Fprintf(o.Out, "open       http://localhost:%d/\n", port)
	}
	fmt.Fprintf(o.Out, "invite     %s\n", invite)
	fmt.Fprintf(o.Out, "ready in %s. Press Ctrl-C to stop.\n", time.Since(start).Round(100*time.Millisecond))
	if o.Ready != nil {
		info := Info{NATSURL: ns.URL(), Kubeconfig: cluster.Kubeconfig, Invite: invite, Metrics: map[string]string{}, PIDs: map[string]int{}}
		for _, port := range o.EdgePorts {
			info.EdgeURLs = append(info.EdgeURLs, fmt.Sprintf("http://localhost:%d", port))
		}
		for _, c := range children {
			info.Metrics[c.name] = c.metrics
			info.PIDs[c.name] = c.cmd.Process.Pid
		}
		o.Ready(info)
	}
	select {
	case <-ctx.Done():
	case name := <-exitedChild(children):
		fmt.Fprintf(o.Out, "%s exited; see its log. Stopping.\n", name)
	}
	fmt.Fprintln(o.Out, "stopping…")
	return nil
}

// lifecycleCredentials applies the lifecycle ServiceAccount and Role from
// manifests/base and returns a kubeconfig for it, so the local worker runs
// with exactly the production rights.
func lifecycleCredentials(ctx context.Context, c *devcluster.Cluster) (string, error) {
	objs, err := manifests.Render("manifests/base")
	if err != nil {
		return "", err
	}
	var rbac []*unstructured.Unstructured
	for _, kind := range []string{"ServiceAccount", "Role", "RoleBinding"} {
		rbac = append(rbac, manifests.Pick(objs, kind)...)
	}
	if err := c.Apply(ctx, Namespace, rbac...); err != nil {
		return "", err
	}
	path, _, err := c.ServiceAccountKubeconfig(ctx, Namespace, "aaas-lifecycle")
	return path, err
}

func startProcesses(o Options, natsURL, kubeconfig, invite string) ([]*child, error) {
	logDir := filepath.Join(o.StateDir, "logs")
	if err := os.MkdirAll(logDir, 0o700); err != nil {
		return nil, err
	}
	common := map[string]string{
		"NATS_URL": natsURL, "HANDSHAKE_KEY": randomKey(), "LOG_LEVEL": "info", "PATH": os.Getenv("PATH"),
	}
	for k, v := range o.Env {
		common[k] = v
	}
	metrics := o.MetricsPort
	with := func(extra map[string]string) map[string]string {
		port := metrics
		if o.MetricsPort == 0 {
			port, _ = embednats.FreePort()
		} else {
			metrics++
		}
		env := map[string]string{"METRICS_ADDR": fmt.Sprintf("127.0.0.1:%d", port)}
		for k, v := range common {
			env[k] = v
		}
		for k, v := range extra {
			env[k] = v
		}
		return env
	}
	specs := []struct {
		name string
		env  map[string]string
	}{
		{"lifecycle", with(map[string]string{"KUBECONFIG": kubeconfig, "NAMESPACE": Namespace, "INSTANCE_ID": "lifecycle-a"})},
		{"sweeper", with(map[string]string{"INSTANCE_ID": "sweeper-a"})},
	}
	for i, port := range o.EdgePorts {
		specs = append(specs, struct {
			name string
			env  map[string]string
		}{fmt.Sprintf("edge-%c", 'a'+i), with(map[string]string{
			"LISTEN_ADDR": fmt.Sprintf(":%d", port), "INSTANCE_ID": fmt.Sprintf("edge-%c", 'a'+i),
			"COOKIE_SECURE": "false", "ALLOW_INSECURE_COOKIES": "1", "SIGNUP_INVITE_CODE": invite,
		})})
	}
	var children []*child
	for _, s := range specs {
		bin := filepath.Join(o.BinDir, strings.SplitN(s.name, "-", 2)[0])
		c, err := startChild(s.name, bin, logDir, s.env)
		if err != nil {
			return children, err
		}
		c.metrics = s.env["METRICS_ADDR"]
		children = append(children, c)
	}
	return children, nil
}

// waitServing waits until every edge answers /readyz.
func waitServing(ctx context.Context, ports []int, children []*child) error {
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
				if c.exited() {
					return fmt.Errorf("%s exited during start; see %s", c.name, c.log)
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

func exitedChild(children []*child) <-chan string {
	ch := make(chan string, len(children))
	for _, c := range children {
		go func() { <-c.done; ch <- c.name }()
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
