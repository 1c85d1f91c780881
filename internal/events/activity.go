package events

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// FollowActivity reads the activity stream until ctx ends: first the
// newest beacon of every (user, edge), then each new one, handing fn the
// beacon, its stream sequence and the stream's time stamp (never the
// edge's clock). caughtUp runs once, when the beacons present at the start
// have all been handed over (at once if there are none). An ordered
// consumer resumes by itself after a disconnect or a server restart, from
// the last sequence it delivered, so no beacon is missed or seen twice.
// Undecodable beacons are logged and skipped.
func FollowActivity(ctx context.Context, js jetstream.JetStream, log *slog.Logger, fn func(b Beacon, seq uint64, stamped time.Time), caughtUp func()) error {
	cons, err := js.OrderedConsumer(ctx, StreamActivity, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{ActivitySubjectsAll},
		DeliverPolicy:  jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return fmt.Errorf("follow activity: %w", err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return fmt.Errorf("follow activity: %w", err)
	}
	done := false
	if info.NumPending == 0 {
		done = true
		caughtUp()
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		meta, err := m.Metadata()
		if err != nil {
			return
		}
		if b, err := Decode[Beacon](m.Data()); err != nil {
			log.Warn("undecodable beacon ignored", "subject", m.Subject(), "err", err)
		} else {
			fn(b, meta.Sequence.Stream, meta.Timestamp)
		}
		if meta.NumPending == 0 && !done {
			done = true
			caughtUp()
		}
	})
	if err != nil {
		return fmt.Errorf("follow activity: %w", err)
	}
	<-ctx.Done()
	cc.Stop()
	return nil
}
