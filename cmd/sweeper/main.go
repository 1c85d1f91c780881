// Command sweeper suspends idle sandboxes: it keeps idle clocks from the
// activity stream and, on the one replica holding the lease, asks
// lifecycle to suspend what nobody uses. It holds no Kubernetes
// credentials; see the README for its configuration.
package main

import (
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/notify"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/sweeper"
)

func main() {
	cfg, err := config.LoadSweeper(config.FromOS())
	process.Main(natsauth.Sweeper, cfg.Common, err, func(p *process.Process) error { return run(p, cfg) })
}

func run(p *process.Process, cfg config.Sweeper) error {
	n := notify.New(notify.Options{URL: cfg.Notify.URL, Secret: cfg.Notify.Secret, Attempts: cfg.Notify.Attempts, Backoff: cfg.Notify.Backoff,
		Queue: cfg.Notify.Queue, Log: p.Log, Metrics: p.Metrics})
	go n.Run(p.Ctx)
	s, err := sweeper.New(p.Ctx, sweeper.Options{
		JS: p.JS, Publisher: events.NewPublisher(p.JS, cfg.InstanceID, p.Log),
		Policy: cfg.Policy, Profiles: cfg.Profiles, Interval: cfg.Interval,
		IdleEvict: cfg.IdleEvict, MaxRunning: cfg.MaxRunning, Notify: n, WarnBefore: cfg.Notify.WarnBefore,
		Log: p.Log, Metrics: p.Metrics,
	})
	if err != nil {
		return err
	}
	p.SetReady(s.Ready)
	locks, err := kv.Open[kv.Holder](p.Ctx, p.JS, state.BucketLocks)
	if err != nil {
		return err
	}
	go kv.NewLease(locks, "sweeper", cfg.InstanceID, cfg.LeaseTTL, p.Log).Run(p.Ctx, s.Lead)
	return s.Follow(p.Ctx)
}
