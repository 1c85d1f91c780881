// Package natstest starts real embedded NATS servers for tests, with
// cleanup registered on the test.
package natstest

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/natsauth"
)

// Start runs a single node with JetStream in a temp dir; anyone may
// connect.
func Start(t testing.TB) *embednats.Server { return StartWith(t, embednats.Options{}) }

// StartWith is Start with options (Dir defaults to a temp dir).
func StartWith(t testing.TB, o embednats.Options) *embednats.Server {
	t.Helper()
	if o.Dir == "" {
		o.Dir = t.TempDir()
	}
	s, err := embednats.Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// StartCluster runs n routed nodes with base's options (StartCluster in
// embednats).
func StartCluster(t testing.TB, n int, base embednats.Options) *embednats.Cluster {
	t.Helper()
	c, err := embednats.StartCluster(t.TempDir(), n, base)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Shutdown)
	return c
}

// Connect returns a client connection and a JetStream context for url.
func Connect(t testing.TB, url string, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	opts = append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}, opts...)
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// As is the connect option that authenticates as role.
func As(t testing.TB, ids *natsauth.Identities, role natsauth.Role) nats.Option {
	t.Helper()
	opt, err := nats.NkeyOptionFromSeed(ids.SeedFile(role))
	if err != nil {
		t.Fatal(err)
	}
	return opt
}

// Context is a test-scoped context with a deadline.
func Context(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// Provision runs ensure (creating streams or buckets) on a cluster that
// has just formed until it succeeds, each attempt bounded as setup's are
// (natsconn.Provision): a new stream's raft group may take seconds to
// elect its leader on a loaded machine, and a create whose answer is lost
// meanwhile would otherwise hold the test until its deadline.
func Provision(t testing.TB, ctx context.Context, ensure func(context.Context) error) {
	t.Helper()
	for {
		actx, cancel := context.WithTimeout(ctx, 15*time.Second)
		err := ensure(actx)
		cancel()
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("provisioning: %v", err)
		}
		t.Logf("provisioning: %v; trying again", err)
		select {
		case <-ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
}
