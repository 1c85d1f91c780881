// Package natsconn connects a process to NATS the way every aaas process
// should: reconnecting forever, logging connection changes, and creating the
// streams and buckets it relies on.
package natsconn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// Options for Connect.
type Options struct {
	URL string
	// Name identifies the client in server monitoring (process and instance).
	Name string
	// Auth is the identity (an nkey seed or credentials file) and TLS.
	Auth config.NATSAuth
	// InboxPrefix replaces _INBOX for replies; each identity may only
	// subscribe below its own.
	InboxPrefix string
	// FailoverWait is how long a synchronous publish keeps trying while
	// its stream elects a new leader (see failover).
	FailoverWait time.Duration
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
	auth, err := authOptions(o)
	if err != nil {
		return nil, nil, err
	}
	opts = append(opts, auth...)
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
	if o.FailoverWait > 0 {
		js = failover{JetStream: js, wait: o.FailoverWait}
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

func authOptions(o Options) ([]nats.Option, error) {
	var opts []nats.Option
	a := o.Auth
	switch {
	case a.NKey != "":
		opt, err := nkeyOption(a.NKey)
		if err != nil {
			return nil, fmt.Errorf("NATS_NKEY %s: %w", a.NKey, err)
		}
		opts = append(opts, opt)
	case a.Creds != "":
		opts = append(opts, nats.UserCredentials(a.Creds))
	}
	if a.CA != "" {
		opts = append(opts, nats.RootCAs(a.CA))
	}
	if a.Cert != "" {
		opts = append(opts, nats.ClientCert(a.Cert, a.Key))
	}
	if o.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(o.InboxPrefix))
	}
	return opts, nil
}

// nkeyOption authenticates with the seed in file as it is now, for the
// life of the connection. nats.go's NkeyOptionFromSeed keeps the public
// key but reads the seed again for every reconnect: once a rotation has
// replaced the mounted Secret's seed (the kubelet updates it in running
// pods), a process would offer its old key signed by the new seed, and
// every reconnect would be refused until the pod restarted. Holding the
// pair keeps each process on one identity until it restarts, which is
// what the rotation procedure counts on.
func nkeyOption(file string) (nats.Option, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	kp, err := nkeys.ParseDecoratedNKey(b)
	clear(b)
	if err != nil {
		return nil, err
	}
	pub, err := kp.PublicKey()
	if err != nil || !nkeys.IsValidPublicUserKey(pub) {
		return nil, errors.New("not a user nkey seed")
	}
	return nats.Nkey(pub, kp.Sign), nil
}

// Provision is the setup step: it creates or updates every stream and
// bucket and the commands' consumer, with the setup identity (the only one
// allowed to). A JetStream cluster that is still electing its leaders
// refuses for a while; Provision retries until it succeeds or ctx ends.
//
// A NATS whose store cannot hold the caps (max_file_store below what
// EXPECTED_ACCOUNTS needs) is not waited for: Provision says how much
// each node needs and returns (ErrStoreTooSmall).
func Provision(ctx context.Context, js jetstream.JetStream, s events.StreamsConfig, b state.BucketsConfig, commands events.ConsumerConfig, log *slog.Logger) error {
	return retry(ctx, log, "nats not ready for provisioning", func(ctx context.Context) error {
		if err := reserve(ctx, js, s, b); err != nil {
			return err
		}
		if err := events.EnsureStreams(ctx, js, s); err != nil {
			return tooSmall(err, s, b)
		}
		if err := state.EnsureBuckets(ctx, js, b); err != nil {
			return tooSmall(err, s, b)
		}
		_, err := events.EnsureConsumer(ctx, js, commands)
		return err
	})
}

// Require waits until the streams and buckets exist, as setup leaves
// them: the processes only check (they may not create), and stay unready
// meanwhile.
func Require(ctx context.Context, js jetstream.JetStream, streams, buckets []string, log *slog.Logger) error {
	return retry(ctx, log, "waiting for the setup step to create streams and buckets", func(ctx context.Context) error {
		for _, name := range streams {
			if _, err := js.Stream(ctx, name); err != nil {
				return fmt.Errorf("stream %s: %w", name, err)
			}
		}
		for _, name := range buckets {
			if _, err := js.KeyValue(ctx, name); err != nil {
				return fmt.Errorf("bucket %s: %w", name, err)
			}
		}
		return nil
	})
}

// reserve makes sure, before anything is created or grown, that NATS can
// reserve what the caps add to those already in place: it creates a probe
// stream of that size, replicated like the others, and deletes it. A store
// too small then refuses the probe, not the fifth of a dozen buckets, and
// nothing is left half provisioned (which a cluster cannot always shrink
// back: it checks a lowered cap against the room left as if the stream
// did not hold its own reservation).
func reserve(ctx context.Context, js jetstream.JetStream, s events.StreamsConfig, b state.BucketsConfig) error {
	var grow int64
	for _, sc := range events.StreamConfigs(s) {
		g, err := growth(ctx, js, sc.Name, sc.MaxBytes)
		if err != nil {
			return err
		}
		grow += g
	}
	for _, bc := range state.BucketConfigs(b) {
		g, err := growth(ctx, js, "KV_"+bc.Bucket, bc.MaxBytes)
		if err != nil {
			return err
		}
		grow += g
	}
	// A probe a setup killed midway left would hold its reservation.
	if err := js.DeleteStream(ctx, probeStream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("delete stream %s: %w", probeStream, err)
	}
	if grow == 0 {
		return nil
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: probeStream, Description: "setup's check that the caps fit; deleted at once",
		Subjects: []string{probeStream}, MaxBytes: grow, Replicas: b.Replicas, Storage: jetstream.FileStorage,
	}); err != nil {
		return tooSmall(fmt.Errorf("reserve %d MiB more: %w", grow>>20, err), s, b)
	}
	if err := js.DeleteStream(ctx, probeStream); err != nil {
		return fmt.Errorf("delete stream %s: %w", probeStream, err)
	}
	return nil
}

// probeStream is reserve's stream.
const probeStream = "AAAS_SIZING_PROBE"

// growth is how much more than now stream name's cap reserves at want.
func growth(ctx context.Context, js jetstream.JetStream, name string, want int64) (int64, error) {
	st, err := js.Stream(ctx, name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return want, nil
	case err != nil:
		return 0, fmt.Errorf("stream %s: %w", name, err)
	}
	return max(0, want-st.CachedInfo().Config.MaxBytes), nil
}

// ErrStoreTooSmall: a NATS node cannot reserve the caps of the streams
// and buckets (README, Sizing).
var ErrStoreTooSmall = errors.New("the NATS store is too small for the streams' and buckets' caps")

// JetStream's codes for a cap it cannot reserve (nats.go names none).
const (
	errCodeNoPeers         jetstream.ErrorCode = 10005
	errCodeInsufficient    jetstream.ErrorCode = 10023
	errCodeStorageExceeded jetstream.ErrorCode = 10047
)

// tooSmall is err, explained, when it is JetStream refusing to reserve a
// cap: in a cluster "no suitable peers for placement, insufficient
// storage", on one server "insufficient storage resources available".
func tooSmall(err error, s events.StreamsConfig, b state.BucketsConfig) error {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return err
	}
	switch {
	case apiErr.ErrorCode == errCodeStorageExceeded, apiErr.ErrorCode == errCodeInsufficient,
		apiErr.ErrorCode == errCodeNoPeers && strings.Contains(apiErr.Description, "insufficient storage"):
		return fmt.Errorf("%w: every NATS node needs a max_file_store of at least %d MiB for EXPECTED_ACCOUNTS=%d and EXPECTED_SESSIONS_PER_USER=%d (README, Sizing); raise it, or lower those: %w",
			ErrStoreTooSmall, (s.StoreBytes()+b.StoreBytes()+1<<20-1)>>20, b.Accounts, b.SessionsPerUser, err)
	}
	return err
}

func retry(ctx context.Context, log *slog.Logger, what string, f func(context.Context) error) error {
	delay := 250 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := f(actx)
		cancel()
		// A store too small stays so until an operator resizes NATS.
		if err == nil || ctx.Err() != nil || errors.Is(err, ErrStoreTooSmall) {
			return err
		}
		log.Warn(what+"; retrying", "err", err, "in", delay)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}
