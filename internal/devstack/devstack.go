// Package devstack runs the whole system on one machine for `make run`: an
// embedded NATS server with the streams and buckets provisioned, and (as
// the other processes land) the local control plane and the aaas processes.
package devstack

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsconn"
)

// Options configures a stack.
type Options struct {
	// StateDir keeps NATS data between runs (sessions survive a restart).
	StateDir string
	NATSPort int
	Out      io.Writer
	Log      *slog.Logger
}

// Run starts the stack and blocks until ctx ends, then stops everything.
func Run(ctx context.Context, o Options) error {
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
	fmt.Fprintf(o.Out, "aaas devstack\n  NATS      %s (JetStream, state in %s)\n  streams   %s, %s, %s\n  buckets   %s, %s, %s, %s, %s, %s, %s\nPress Ctrl-C to stop.\n",
		ns.URL(), filepath.Join(o.StateDir, "nats"),
		events.StreamCommands, events.StreamActivity, events.StreamAudit,
		kv.BucketSessions, kv.BucketUsers, kv.BucketSandboxes, kv.BucketHandshakes, kv.BucketRequests, kv.BucketRateLimit, kv.BucketLocks)
	<-ctx.Done()
	fmt.Fprintln(o.Out, "stopping")
	return nil
}
