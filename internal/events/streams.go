// Package events holds the JetStream streams that connect the processes: the
// command work queue that lifecycle workers drain, the activity stream whose
// last message per subject is the table of idle clocks, and the audit trail.
// It defines their subjects, the versioned message types carried on them,
// and the publish and consume helpers every process uses.
package events

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/jsconfig"
)

// Stream names.
const (
	StreamCommands = "AAAS_CMD"
	StreamActivity = "AAAS_ACTIVITY"
	StreamAudit    = "AAAS_AUDIT"
	// StreamUsage is every model call a broker forwarded, one message
	// each (UsageEvent): the record the monthly totals and exports are
	// made from.
	StreamUsage = "AAAS_USAGE"
)

// StreamsConfig sizes the streams for an environment.
type StreamsConfig struct {
	// Replicas is 1 for a single embedded server, 3 for a production cluster.
	Replicas int
	// DuplicateWindow is how long Nats-Msg-Id dedupe remembers a command.
	DuplicateWindow time.Duration
	// ActivityMaxAge drops idle clocks of users nobody has touched for this
	// long; the sweeper falls back to the sandbox's own Ready time for them.
	ActivityMaxAge time.Duration
	// AuditMaxAge is the audit trail's retention.
	AuditMaxAge time.Duration
	// UsageMaxAge is the model-call record's retention.
	UsageMaxAge time.Duration
	// CommandsMaxBytes, ActivityMaxBytes and AuditMaxBytes cap each
	// stream's storage, so no flood can fill JetStream's store for
	// everything else. Full, the command stream refuses new commands
	// (their requesters get 503); activity and audit drop their oldest.
	CommandsMaxBytes, ActivityMaxBytes, AuditMaxBytes, UsageMaxBytes int64
}

// DefaultStreamsConfig is the development sizing.
func DefaultStreamsConfig() StreamsConfig {
	return StreamsConfig{
		Replicas:        1,
		DuplicateWindow: 2 * time.Minute,
		ActivityMaxAge:  7 * 24 * time.Hour,
		AuditMaxAge:     30 * 24 * time.Hour,
		UsageMaxAge:     93 * 24 * time.Hour,
		// 1.75 GiB in all: with the buckets (state.BucketsConfig's
		// StoreBytes) what each NATS node reserves (README, Sizing).
		CommandsMaxBytes: 256 << 20,
		ActivityMaxBytes: 256 << 20,
		AuditMaxBytes:    1 << 30,
		UsageMaxBytes:    256 << 20,
	}
}

// StoreBytes is what the streams reserve in all on each NATS node that
// holds a replica of every one (JetStream reserves each cap against the
// node's max_file_store).
func (c StreamsConfig) StoreBytes() int64 {
	var sum int64
	for _, sc := range StreamConfigs(c) {
		sum += sc.MaxBytes
	}
	return sum
}

// StreamConfigs returns the stream definitions.
func StreamConfigs(c StreamsConfig) []jetstream.StreamConfig {
	return []jetstream.StreamConfig{
		{
			Name:        StreamCommands,
			Description: "lifecycle commands; one worker takes each",
			Subjects:    []string{commandPrefix + ">"},
			Retention:   jetstream.WorkQueuePolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			Duplicates:  c.DuplicateWindow,
			// No MaxAge: an unprocessed command must never expire unseen,
			// nor be dropped for a newer one when the stream is full.
			Discard:  jetstream.DiscardNew,
			MaxBytes: c.CommandsMaxBytes,
		},
		{
			Name:              StreamActivity,
			Description:       "edge activity beacons; the last one per user and edge is that edge's idle clock",
			Subjects:          []string{activityPrefix + ">"},
			Retention:         jetstream.LimitsPolicy,
			Storage:           jetstream.FileStorage,
			Replicas:          c.Replicas,
			MaxMsgsPerSubject: 1,
			MaxAge:            c.ActivityMaxAge,
			MaxBytes:          c.ActivityMaxBytes,
			Discard:           jetstream.DiscardOld,
			Duplicates:        time.Second,
			AllowDirect:       true,
		},
		{
			Name:        StreamAudit,
			Description: "audit trail of state changes, auth events and undeliverable commands",
			// The max-deliveries advisory is captured here so a command whose
			// worker crashed on every attempt still leaves a durable record.
			Subjects:   []string{AuditSubjectsAll, MaxDeliveriesAdvisory + ".>"},
			Retention:  jetstream.LimitsPolicy,
			Storage:    jetstream.FileStorage,
			Replicas:   c.Replicas,
			MaxAge:     c.AuditMaxAge,
			MaxBytes:   c.AuditMaxBytes,
			Discard:    jetstream.DiscardOld,
			Duplicates: c.DuplicateWindow,
		},
		{
			Name:        StreamUsage,
			Description: "model calls forwarded by the brokers, one message each",
			Subjects:    []string{usagePrefix + ">"},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.UsageMaxAge,
			MaxBytes:    c.UsageMaxBytes,
			Discard:     jetstream.DiscardOld,
			// A broker that publishes a call's usage again (no answer
			// the first time) must not count it twice.
			Duplicates: c.DuplicateWindow,
		},
	}
}

// MaxDeliveriesAdvisory is the advisory subject prefix for commands that
// exhausted their deliveries.
const MaxDeliveriesAdvisory = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." + StreamCommands

// EnsureStreams creates the streams or updates their configuration in place
// when it differs. It is idempotent and safe to run from every process at
// start.
func EnsureStreams(ctx context.Context, js jetstream.JetStream, c StreamsConfig) error {
	for _, sc := range StreamConfigs(c) {
		if s, err := js.Stream(ctx, sc.Name); err == nil && jsconfig.Holds(s.CachedInfo().Config, sc) {
			continue
		}
		if _, err := js.CreateOrUpdateStream(ctx, sc); err != nil {
			return fmt.Errorf("ensure stream %s: %w", sc.Name, err)
		}
	}
	return nil
}
