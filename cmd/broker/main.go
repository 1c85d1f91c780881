// Command broker is the model-API endpoint sandboxes call instead of
// their providers: it attributes each call to the user whose sandbox
// made it, forwards it with the provider key only it holds, and meters
// it. See the README for its configuration.
package main

import (
	"context"
	"net"

	"github.com/aaas-project/aaas/internal/broker"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/state"
)

func main() {
	cfg, err := config.LoadBroker(config.FromOS())
	process.Main(natsauth.Broker, cfg.Common, err, func(p *process.Process) error { return run(p, cfg) })
}

func run(p *process.Process, cfg config.Broker) error {
	keys, err := broker.LoadKeys(cfg.KeysDir, cfg.Providers)
	if err != nil {
		return err
	}
	boxes, err := kv.Open[state.Sandbox](p.Ctx, p.JS, state.BucketSandboxes)
	if err != nil {
		return err
	}
	index := broker.NewIndex()
	cache, err := kv.NewCache(p.Ctx, boxes, ">", p.Log, index.Watch())
	if err != nil {
		return err
	}
	ledger, err := broker.NewLedger(p.Ctx, broker.LedgerOptions{
		JS: p.JS, Budget: cfg.Budget, MaxConcurrent: cfg.MaxConcurrent, CallTimeout: cfg.CallTimeout,
		BeaconInterval: cfg.BeaconInterval, BeaconTTL: cfg.BeaconTTL, Instance: cfg.InstanceID,
		Log: p.Log, Metrics: p.Metrics,
	})
	if err != nil {
		return err
	}
	var own broker.Credentials
	if cfg.BYOK {
		ring, err := credentials.NewRing(cfg.CredentialKeys...)
		if err != nil {
			return err
		}
		stored, err := kv.Open[state.Credential](p.Ctx, p.JS, state.BucketCredentials)
		if err != nil {
			return err
		}
		own = credentials.Lookup(stored, ring)
	}
	srv, err := broker.New(broker.Options{
		Providers: cfg.Providers, Keys: keys, Prices: cfg.Prices, MaxBody: cfg.MaxBody,
		CallTimeout: cfg.CallTimeout, HeaderTimeout: cfg.HeaderTimeout, ShutdownTimeout: cfg.ShutdownTimeout,
		Ledger: ledger, Credentials: own,
		Index: index, Current: cache.Current, MaxStaleness: cfg.MaxStaleness,
		Instance: cfg.InstanceID, Log: p.Log, Metrics: p.Metrics,
	})
	if err != nil {
		return err
	}
	// What ended calls spent reaches NATS before the process exits,
	// after the server has drained (calls that end while it drains are
	// recorded too).
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
		defer cancel()
		if err := ledger.Flush(ctx); err != nil {
			p.Log.Warn("usage records not flushed before exit", "err", err)
		}
	}()
	// Until the index holds every sandbox, an address missing from it
	// proves nothing: listen only once it is loaded.
	select {
	case <-cache.Synced():
	case <-p.Ctx.Done():
		return nil
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return err
	}
	p.SetReady(cache.IsSynced)
	p.Log.Info("serving model calls", "addr", ln.Addr().String(), "providers", len(cfg.Providers))
	return srv.Serve(p.Ctx, ln)
}
