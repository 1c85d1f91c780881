package natsconn_test

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/natsconn"
	"github.com/aaas-project/aaas/internal/state"
)

// TestProvisionSaysHowBigAStoreItNeeds: a NATS whose store (embednats
// reserves at most 6 GiB per node) cannot hold the caps of a million
// accounts refuses them, on one server and in a cluster; setup then stops
// at once, naming what each node needs and the settings that decide it,
// instead of retrying forever. The same NATS takes the caps of the
// development sizing (the positive control).
func TestProvisionSaysHowBigAStoreItNeeds(t *testing.T) {
	single := natstest.Start(t)
	cluster := natstest.StartCluster(t, 3, embednats.Options{})
	for _, tc := range []struct {
		name     string
		url      string
		replicas int
	}{{"one server", single.URL(), 1}, {"three nodes", cluster.URLs(), 3}} {
		t.Run(tc.name, func(t *testing.T) {
			_, js := natstest.Connect(t, tc.url)
			ctx := natstest.Context(t, time.Minute)
			streams, buckets := events.DefaultStreamsConfig(), state.DefaultBucketsConfig()
			streams.Replicas, buckets.Replicas = tc.replicas, tc.replicas
			commands := events.CommandConsumerConfig(2, 5, time.Minute)
			big := buckets
			big.Accounts = config.DefaultExpectedAccounts
			start := time.Now()
			err := natsconn.Provision(ctx, js, streams, big, commands, slog.New(slog.DiscardHandler))
			if !errors.Is(err, natsconn.ErrStoreTooSmall) {
				t.Fatalf("provisioning a million accounts' caps on a 6 GiB store: %v", err)
			}
			need := (streams.StoreBytes() + big.StoreBytes()) >> 20
			for _, want := range []string{"EXPECTED_ACCOUNTS=1000000", "max_file_store", "Sizing"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("the error does not say %q: %v", want, err)
				}
			}
			if need < 6<<10 || !strings.Contains(err.Error(), "MiB") {
				t.Errorf("a million accounts need %d MiB per node, which a 6 GiB store should hold: %v", need, err)
			}
			if d := time.Since(start); d > 30*time.Second {
				t.Errorf("setup kept retrying for %s on a store too small", d)
			}
			// Refused before anything was made: no stream, no bucket, no
			// probe.
			names := js.StreamNames(ctx)
			for name := range names.Name() {
				t.Errorf("the refused attempt left stream %s", name)
			}
			if names.Err() != nil {
				t.Fatal(names.Err())
			}
			// The development sizing fits.
			if err := natsconn.Provision(ctx, js, streams, buckets, commands, slog.New(slog.DiscardHandler)); err != nil {
				t.Fatalf("the development sizing: %v", err)
			}
			for _, bc := range state.BucketConfigs(buckets) {
				kv, err := js.KeyValue(ctx, bc.Bucket)
				if err != nil {
					t.Fatal(err)
				}
				st, err := kv.Status(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if got := st.(*jetstream.KeyValueBucketStatus).StreamInfo().Config.MaxBytes; got != bc.MaxBytes {
					t.Errorf("bucket %s capped at %d, want %d", bc.Bucket, got, bc.MaxBytes)
				}
			}
		})
	}
}
