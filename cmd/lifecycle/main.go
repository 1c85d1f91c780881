// Command lifecycle executes the gateway's commands against Kubernetes and
// mirrors Kubernetes state into NATS KV; see the README for its
// configuration.
package main

import (
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/lifecycle"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

func main() {
	cfg, err := config.LoadLifecycle(config.FromOS())
	process.Main(natsauth.Lifecycle, cfg.Common, err, func(p *process.Process) error { return run(p, cfg) })
}

func run(p *process.Process, cfg config.Lifecycle) error {
	rc, err := kubeConfig(cfg.Kubeconfig)
	if err != nil {
		return err
	}
	cluster, err := sandbox.New(rc, sandbox.Config{
		Namespace: cfg.Namespace, WarmPool: cfg.WarmPool,
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
	w, err := lifecycle.New(p.Ctx, lifecycle.Options{
		Cluster: cluster, JS: p.JS, Publisher: events.NewPublisher(p.JS, cfg.InstanceID, p.Log), Sealer: sealer,
		LogTailLines: cfg.LogTailLines, HandshakeTTL: cfg.Buckets.HandshakeTTL, RecreateTimeout: cfg.RecreateTimeout,
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
