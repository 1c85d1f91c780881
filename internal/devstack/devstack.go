// Package devstack runs the whole system on one machine for `make run`: an
// embedded NATS server with the streams and buckets provisioned, a local
// Kubernetes control plane (devcluster) with a warm pool of dshsim
// sandboxes, and the aaas processes. Every run starts from a clean state.
package devstack

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/aaas-project/aaas/internal/devcluster"
	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsconn"
)

// Namespace is where the sandboxes live, as in the manifests.
const Namespace = "dsh-demo"

// Options configures a stack.
type Options struct {
	// StateDir holds NATS data, the cluster and logs; it is wiped at start.
	StateDir string
	NATSPort int
	// BinDir holds the aaas binaries (dshsim, edge, lifecycle, sweeper).
	BinDir string
	Out    io.Writer
	Log    *slog.Logger
}

// Run starts the stack and blocks until ctx ends, then stops everything.
func Run(ctx context.Context, o Options) error {
	start := time.Now()
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
	fmt.Fprintf(o.Out, "ready in %s. Press Ctrl-C to stop.\n", time.Since(start).Round(100*time.Millisecond))
	<-ctx.Done()
	fmt.Fprintln(o.Out, "stopping…")
	return nil
}
