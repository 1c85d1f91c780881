// Package natsconn connects a process to NATS the way every aaas process
// should: reconnecting forever, logging connection changes, and creating the
// streams and buckets it relies on.
package natsconn

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
)

// Options for Connect.
type Options struct {
	URL string
	// Name identifies the client in server monitoring (process and instance).
	Name string
	// CredsFile is an optional NATS credentials file.
	CredsFile string
}

// Connect dials NATS and waits until the first connection succeeds or ctx
// ends. It never gives up on the server: before the first connection and
// after any loss it keeps reconnecting, and the caches keep serving
// meanwhile.
func Connect(ctx context.Context, o Options, log *slog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	opts := []nats.Option{
		nats.Name(o.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.RetryOnFailedConnect(true),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil means we closed it ourselves
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", "server", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subj := ""
			if sub != nil {
				subj = sub.Subject
			}
			log.Warn("nats async error", "subject", subj, "err", err)
		}),
	}
	if o.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(o.CredsFile))
	}
	nc, err := nats.Connect(o.URL, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to nats at %s: %w", o.URL, err)
	}
	if err := waitConnected(ctx, nc, o.URL, log); err != nil {
		nc.Close()
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return nc, js, nil
}

func waitConnected(ctx context.Context, nc *nats.Conn, url string, log *slog.Logger) error {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	logged := false
	for !nc.IsConnected() {
		if !logged && nc.LastError() != nil {
			log.Warn("waiting for nats", "url", url, "err", nc.LastError())
			logged = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("connect to nats at %s: %w (last error: %v)", url, ctx.Err(), nc.LastError())
		case <-t.C:
		}
	}
	return nil
}

// Provision creates or updates every stream and bucket. Each process runs
// it at start, so whichever starts first prepares NATS for the others. A
// JetStream cluster that is still electing its leaders refuses for a
// while; Provision retries until it succeeds or ctx ends.
func Provision(ctx context.Context, js jetstream.JetStream, s events.StreamsConfig, b kv.BucketsConfig, log *slog.Logger) error {
	delay := 250 * time.Millisecond
	for {
		err := provisionOnce(ctx, js, s, b)
		if err == nil || ctx.Err() != nil {
			return err
		}
		log.Warn("nats not ready for provisioning; retrying", "err", err, "in", delay)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

func provisionOnce(ctx context.Context, js jetstream.JetStream, s events.StreamsConfig, b kv.BucketsConfig) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := events.EnsureStreams(ctx, js, s); err != nil {
		return err
	}
	return kv.EnsureBuckets(ctx, js, b)
}
