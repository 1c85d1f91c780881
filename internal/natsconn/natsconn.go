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

// Connect dials NATS. It does not fail when the server is briefly down
// after the first connection; it keeps reconnecting and the caches keep
// serving meanwhile.
func Connect(o Options, log *slog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	opts := []nats.Option{
		nats.Name(o.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.RetryOnFailedConnect(false),
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
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return nc, js, nil
}

// Provision creates or updates every stream and bucket. Each process runs
// it at start, so whichever starts first prepares NATS for the others.
func Provision(ctx context.Context, js jetstream.JetStream, s events.StreamsConfig, b kv.BucketsConfig) error {
	if err := events.EnsureStreams(ctx, js, s); err != nil {
		return err
	}
	return kv.EnsureBuckets(ctx, js, b)
}
