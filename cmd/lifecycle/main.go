// Command lifecycle executes the gateway's commands against Kubernetes and
// mirrors Kubernetes state into NATS KV; see the README for its
// configuration. `lifecycle adopt` instead migrates the seed gateway's
// claims once and exits (README, "Migrating from the seed gateway").
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	extclient "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned"

	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/lifecycle"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/notify"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "adopt" {
		os.Exit(adopt(os.Args[2:]))
	}
	cfg, err := config.LoadLifecycle(config.FromOS())
	process.Main(natsauth.Lifecycle, cfg.Common, err, func(p *process.Process) error { return run(p, cfg) })
}

func run(p *process.Process, cfg config.Lifecycle) error {
	rc, err := kubeConfig(cfg.Kubeconfig)
	if err != nil {
		return err
	}
	cluster, err := sandbox.New(rc, sandbox.Config{
		Namespace:  cfg.SandboxNamespace,
		ManagedKey: cfg.ManagedKey, ManagedValue: cfg.ManagedValue,
		Container: cfg.Container, Port: cfg.Port, UseService: cfg.UpstreamAddress == "service",
		QPS: cfg.KubeQPS, Burst: cfg.KubeBurst, CallTimeout: cfg.KubeCallTimeout, LogLimitBytes: cfg.LogLimitBytes, Log: p.Log,
	})
	if err != nil {
		return err
	}
	sealer, err := handshake.NewSealer(cfg.HandshakeKeys...)
	if err != nil {
		return err
	}
	n := notify.New(notify.Options{URL: cfg.Notify.URL, Secret: cfg.Notify.Secret, Attempts: cfg.Notify.Attempts, Backoff: cfg.Notify.Backoff,
		Queue: cfg.Notify.Queue, Log: p.Log, Metrics: p.Metrics})
	go n.Run(p.Ctx)
	w, err := lifecycle.New(p.Ctx, lifecycle.Options{
		Cluster: cluster, JS: p.JS, Publisher: events.NewPublisher(p.JS, cfg.InstanceID, p.Log), Sealer: sealer,
		LogTailLines: cfg.LogTailLines, LogLimitBytes: cfg.LogLimitBytes, HandshakeTTL: cfg.Buckets.HandshakeTTL,
		HandshakeTimeout: cfg.HandshakeTimeout, HandshakeWorkers: cfg.HandshakeWorkers, RecreateTimeout: cfg.RecreateTimeout, PruneInterval: cfg.PruneInterval,
		Profiles: cfg.Profiles, MaxSandboxes: cfg.MaxSandboxes, Rollout: cfg.Rollout, RolloutPercent: cfg.RolloutPercent, RolloutGroups: cfg.RolloutGroups, RolloutProbation: cfg.RolloutProbation,
		Limits: capacity.Limits{MaxRunning: cfg.MaxRunning, MaxStarts: cfg.MaxStarts, Profiles: cfg.Profiles.Caps()}, Notify: n,
		Log: p.Log, Metrics: p.Metrics,
	})
	if err != nil {
		return err
	}
	p.SetReady(w.Ready)
	if err := cluster.Start(p.Ctx); err != nil {
		return err
	}
	locks, err := kv.Open[kv.Holder](p.Ctx, p.JS, state.BucketLocks)
	if err != nil {
		return err
	}
	go kv.NewLease(locks, "lifecycle-mirror", cfg.InstanceID, cfg.LeaseTTL, p.Log).Run(p.Ctx, w.Lead)

	return events.Consume(p.Ctx, p.JS, events.CommandConsumerConfig(cfg.Workers, cfg.MaxDeliver, cfg.AckWait), w.Handle, w.Exhausted, p.Log)
}

// kubeConfig uses KUBECONFIG when set, in-cluster credentials otherwise.
func kubeConfig(path string) (*rest.Config, error) {
	if path != "" {
		return clientcmd.BuildConfigFromFlags("", path)
	}
	return rest.InClusterConfig()
}

// adopt runs `lifecycle adopt` (lifecycle.Adopt): 0 when done, 1 when
// Kubernetes refused something, 2 for bad flags or configuration.
func adopt(args []string) int {
	fs := flag.NewFlagSet("lifecycle adopt", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: lifecycle adopt [--apply] [--user NAME ...] [--owner-annotation key=value] [--token-annotation KEY]")
		fmt.Fprintln(fs.Output(), "Adopts the seed gateway's SandboxClaims in SANDBOX_NAMESPACE; a dry run unless --apply.")
		fs.PrintDefaults()
	}
	o := lifecycle.AdoptOptions{}
	fs.BoolVar(&o.Apply, "apply", false, "patch the claims (without it, only report what would change)")
	fs.Func("user", "also adopt dsh-`NAME`, which lacks the seed's marker (repeatable)", func(s string) error {
		o.Users = append(o.Users, strings.TrimSpace(s))
		return nil
	})
	fs.StringVar(&o.Owner, "owner-annotation", lifecycle.SeedOwner, "the seed's `key=value` marker, as annotation or label")
	fs.StringVar(&o.TokenAnnotation, "token-annotation", sandbox.TokenHashAnnotation, "the annotation `KEY` holding the seed's token hash")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "lifecycle adopt: unexpected argument %q (flags only)\n", fs.Arg(0))
		return 2
	}
	cfg, err := config.LoadAdopt(config.FromOS())
	if err != nil {
		fmt.Fprintf(os.Stderr, "lifecycle adopt: configuration:\n%v\n", err)
		return 2
	}
	o.Namespace, o.ManagedKey, o.ManagedValue = cfg.SandboxNamespace, cfg.ManagedKey, cfg.ManagedValue
	if err := o.Validate(); err != nil {
		fmt.Fprintf(os.Stderr, "lifecycle adopt:\n%v\n", err)
		return 2
	}
	rc, err := kubeConfig(cfg.Kubeconfig)
	if err != nil {
		fmt.Fprintf(os.Stderr, "lifecycle adopt: kubernetes configuration: %v\n", err)
		return 2
	}
	rc.QPS, rc.Burst, rc.Timeout = cfg.KubeQPS, cfg.KubeBurst, cfg.KubeCallTimeout
	ext, err := extclient.NewForConfig(rc)
	if err != nil {
		fmt.Fprintf(os.Stderr, "lifecycle adopt: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := lifecycle.Adopt(ctx, ext.ExtensionsV1beta1().SandboxClaims(cfg.SandboxNamespace), o, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "lifecycle adopt: %v\n", err)
		return 1
	}
	return 0
}
