// Package process is the start-up and shutdown every aaas binary shares:
// signal handling, the JSON logger, NATS connection and provisioning, and
// the metrics endpoint. The cmd packages call it and then wire their own
// parts.
package process

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/backup"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natsconn"
	"github.com/aaas-project/aaas/internal/telemetry"
)

// Process is a started aaas process.
type Process struct {
	Name    string
	Common  config.Common
	Log     *slog.Logger
	NC      *nats.Conn
	JS      jetstream.JetStream
	Metrics *prometheus.Registry
	// Ctx ends on SIGINT or SIGTERM.
	Ctx   context.Context
	stop  context.CancelFunc
	ready atomic.Pointer[func() bool]
}

// SetReady installs the check behind /readyz on the metrics port. Until
// it is called the process reports not ready, so a probe never sees a
// half-wired process as ready.
func (p *Process) SetReady(ready func() bool) { p.ready.Store(&ready) }

func (p *Process) isReady() bool {
	f := p.ready.Load()
	return f != nil && (*f)()
}

// Start serves metrics (not ready yet), connects to NATS as role and waits
// until the setup step has created the streams and buckets. Both waits last
// as long as it takes, until SIGTERM: in a rollout the processes start
// beside NATS, and exiting would only put them in CrashLoopBackOff, whose
// growing delay outlasts NATS's own start by far.
func Start(role natsauth.Role, common config.Common) (*Process, error) {
	name := string(role)
	log := telemetry.Logger(name, common.InstanceID, common.LogLevel)
	softLimit := limitMemoryFromCgroup()
	ctx, stop := notifyContext(log)
	p := &Process{Name: name, Common: common, Log: log, Metrics: telemetry.Registry(), Ctx: ctx, stop: stop}
	if err := telemetry.ServeMetrics(ctx, common.MetricsAddr, p.Metrics, p.isReady, common.Pprof, log); err != nil {
		stop()
		return nil, err
	}
	nc, js, err := connect(ctx, role, common, log)
	if err != nil {
		stop()
		return nil, err
	}
	p.NC, p.JS = nc, js
	registerNATSStats(p.Metrics, nc)
	p.Metrics.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "aaas_ready", Help: "1 while /readyz answers 200.", ConstLabels: prometheus.Labels{"process": name},
	}, func() float64 {
		if p.isReady() {
			return 1
		}
		return 0
	}))
	p.Metrics.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "aaas_kv_newer_records_total",
		Help: "Records this process refused as written by a newer release in a schema it does not read (upgrade it).",
	}, func() float64 { return float64(kv.NewerRecords()) }))
	p.Metrics.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "aaas_kv_cache_reloads_total",
		Help: "Times this process found a bucket recreated (NATS lost its data, or a restore) and reloaded it without a restart.",
	}, func() float64 { return float64(kv.CacheReloads()) }))
	loads := prometheus.NewDesc("aaas_kv_cache_loads_total",
		"Keys this process's bounded caches read from their bucket on a miss, by outcome: read (found), absent, failed (NATS unreachable or a newer record: answered as absent).",
		[]string{"outcome"}, nil)
	p.Metrics.MustRegister(collectorFunc{loads, func(ch chan<- prometheus.Metric) {
		read, absent, failed := kv.CacheLoads()
		ch <- prometheus.MustNewConstMetric(loads, prometheus.CounterValue, float64(read), "read")
		ch <- prometheus.MustNewConstMetric(loads, prometheus.CounterValue, float64(absent), "absent")
		ch <- prometheus.MustNewConstMetric(loads, prometheus.CounterValue, float64(failed), "failed")
	}})
	p.Metrics.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "aaas_kv_cache_evictions_total",
		Help: "Keys this process's bounded caches forgot to stay within their limits (each costs a read when next used).",
	}, func() float64 { return float64(kv.CacheEvictions()) }))
	streams, buckets := role.Requires()
	if err := natsconn.Require(ctx, js, streams, buckets, log); err != nil {
		p.Close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	p.Metrics.MustRegister(natsconn.Fill(js, streams, buckets))
	log.Info("started", "version", telemetry.BuildVersion(), "nats", nc.ConnectedUrlRedacted(), "memory_soft_limit", softLimit)
	return p, nil
}

func connect(ctx context.Context, role natsauth.Role, common config.Common, log *slog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	return natsconn.Connect(ctx, natsconn.Options{
		URL: common.NATSURL, Name: string(role) + "/" + common.InstanceID, Auth: common.NATS, InboxPrefix: role.InboxPrefix(),
		FailoverWait: common.NATSFailoverWait,
	}, log)
}

// Setup is the whole life of the setup step: connect with the setup
// identity, create or update every stream, bucket and the commands'
// consumer, exit. It waits for NATS as long as it takes, until SIGTERM.
func Setup(cfg config.Setup) error {
	log := telemetry.Logger(string(natsauth.Setup), cfg.InstanceID, cfg.LogLevel)
	ctx, stop := notifyContext(log)
	defer stop()
	nc, js, err := connect(ctx, natsauth.Setup, cfg.Common, log)
	if err != nil {
		return err
	}
	defer nc.Close()
	commands := events.CommandConsumerConfig(cfg.Workers, cfg.MaxDeliver, cfg.AckWait)
	if err := natsconn.Provision(ctx, js, cfg.Streams, cfg.Buckets, commands, log); err != nil {
		return fmt.Errorf("provision nats: %w", err)
	}
	log.Info("streams, buckets and consumers are in place", "nats", nc.ConnectedUrlRedacted())
	return nil
}

// Backup copies every stream and bucket into dir (setup backup DIR) with
// the backup identity, one line per stream on out; with dir "-", into a
// temporary directory, then to stdout as a tar archive (out is then
// stderr's).
func Backup(cfg config.Setup, dir string, out io.Writer) error {
	if dir == "-" {
		tmp, err := os.MkdirTemp("", "aaas-backup-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		if err := Backup(cfg, tmp, out); err != nil {
			return err
		}
		return backup.WriteTar(tmp, os.Stdout)
	}
	log := telemetry.Logger(string(natsauth.Backup), cfg.InstanceID, cfg.LogLevel)
	ctx, stop := notifyContext(log)
	defer stop()
	nc, _, err := connect(ctx, natsauth.Backup, cfg.Common, log)
	if err != nil {
		return err
	}
	defer nc.Close()
	m, err := backup.Backup(ctx, nc, dir, backup.Options{
		Streams: natsauth.Streams(), Inbox: natsauth.Backup.InboxPrefix(), Version: telemetry.BuildVersion(),
		Progress: func(s backup.Stream) { fmt.Fprintf(out, "%-22s %8d messages %12d bytes\n", s.Name, s.Messages, s.Size) },
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "backed up %d streams to %s (%s)\n", len(m.Streams), dir, backup.ManifestFile)
	return nil
}

// Restore recreates every stream and bucket of the backup in dir (setup
// restore [-replace] DIR) with the setup identity, one line per stream on
// out. The processes' caches notice the replaced buckets and reload them
// (kv.Cache); scaling the writers down meanwhile keeps their writes from
// landing in a stream about to be replaced (README, "Backup and restore").
// With dir "-" the backup is a tar archive on stdin (setup backup -'s).
func Restore(cfg config.Setup, dir string, replace bool, out io.Writer) error {
	if dir == "-" {
		tmp, err := os.MkdirTemp("", "aaas-restore-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		if err := backup.ReadTar(os.Stdin, tmp); err != nil {
			return err
		}
		dir = tmp
	}
	log := telemetry.Logger(string(natsauth.Setup), cfg.InstanceID, cfg.LogLevel)
	ctx, stop := notifyContext(log)
	defer stop()
	nc, _, err := connect(ctx, natsauth.Setup, cfg.Common, log)
	if err != nil {
		return err
	}
	defer nc.Close()
	m, err := backup.Restore(ctx, nc, dir, backup.Options{
		Replace:  replace,
		Progress: func(s backup.Stream) { fmt.Fprintf(out, "%-22s %8d messages restored\n", s.Name, s.Messages) },
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "restored %d streams from the backup taken %s by %s\n", len(m.Streams), m.Taken.Format(time.RFC3339), m.Version)
	return nil
}

// notifyContext is signal.NotifyContext that also logs which signal ended
// the process, so an unexpected stop says whether it was asked for with
// SIGTERM (an orchestrator) or SIGINT (a terminal).
func notifyContext(log *slog.Logger) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case sig := <-sigs:
			log.Info("stopping on signal", "signal", sig.String())
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, func() {
		signal.Stop(sigs)
		cancel()
	}
}

// Close drains the NATS connection (flushing pending publishes) and
// releases the signal handler.
func (p *Process) Close() {
	if p.NC != nil {
		_ = p.NC.Drain()
		deadline := time.Now().Add(5 * time.Second)
		for !p.NC.IsClosed() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	p.stop()
}

// Main is the whole life of an aaas binary: a configuration error (from
// loading, passed in as loadErr) or a start-up failure is reported and
// exits 1; otherwise run gets the started process and the binary exits
// when it returns, 1 if it failed.
func Main(role natsauth.Role, common config.Common, loadErr error, run func(*Process) error) {
	name := string(role)
	if loadErr != nil {
		Fatal(name, loadErr)
	}
	p, err := Start(role, common)
	if err != nil {
		Fatal(name, err)
	}
	if err := run(p); err != nil {
		p.Log.Error(name+" stopped", "err", err)
		p.Close()
		Fatal(name, err)
	}
	p.Close()
}

// Fatal reports a start-up error the way operators expect from every aaas
// binary, then exits with status 1.
func Fatal(name string, err error) {
	fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
	os.Exit(1)
}

// registerNATSStats exposes the client connection's counters, so the cost
// in NATS operations of anything the process does can be measured.
func registerNATSStats(reg prometheus.Registerer, nc *nats.Conn) {
	stat := func(name, help string, f func(nats.Statistics) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f(nc.Stats())) })
	}
	reg.MustRegister(
		stat("aaas_nats_out_msgs_total", "Messages this process sent to NATS.", func(s nats.Statistics) uint64 { return s.OutMsgs }),
		stat("aaas_nats_in_msgs_total", "Messages this process received from NATS.", func(s nats.Statistics) uint64 { return s.InMsgs }),
		stat("aaas_nats_reconnects_total", "Reconnections to NATS.", func(s nats.Statistics) uint64 { return s.Reconnects }),
	)
}

// collectorFunc is a collector of one described family.
type collectorFunc struct {
	desc    *prometheus.Desc
	collect func(chan<- prometheus.Metric)
}

func (c collectorFunc) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }
func (c collectorFunc) Collect(ch chan<- prometheus.Metric) { c.collect(ch) }
