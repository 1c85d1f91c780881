package natsconn

import (
	"context"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/kv"
)

// failover is a JetStream whose publishes (commands, KV writes, beacons,
// audit events) ride through a stream's leader election: when a NATS node dies,
// the streams it led answer nobody until the survivors elect a new leader
// (raft's election timeout is 4-9 s), and a write in that window would
// otherwise fail at once. Each publish is retried until it is stored, its
// context ends, or wait has passed (no quorum at all: the caller answers
// 503). Retrying is safe: commands carry a message id the stream
// deduplicates, and KV writes expect a revision (a retry of a write that
// was stored after all is a conflict the caller re-reads).
type failover struct {
	jetstream.JetStream
	wait time.Duration
}

func (f failover) Publish(ctx context.Context, subject string, data []byte, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	return f.PublishMsg(ctx, &nats.Msg{Subject: subject, Data: data}, opts...)
}

func (f failover) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	deadline := time.Now().Add(f.wait)
	for attempt := 1; ; attempt++ {
		// A leader that has lost its quorum but not yet noticed takes the
		// message and never acknowledges it: each attempt gets its own
		// deadline, so the caller's (a wake's minute) is not spent on one.
		actx, cancel := context.WithTimeout(ctx, max(min(attemptTimeout, time.Until(deadline)), failoverStep))
		ack, err := f.JetStream.PublishMsg(actx, m, opts...)
		cancel()
		if err == nil || !kv.Leaderless(ctx, err) || !time.Now().Before(deadline) {
			return ack, err
		}
		pause := min(time.Duration(attempt)*100*time.Millisecond, time.Second, time.Until(deadline))
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(pause):
		}
	}
}

// PublishMsgAsync (beacons, audit events) retries the same way, in the
// client's own retry loop: every failoverStep while nobody answers, for
// wait in all.
func (f failover) PublishMsgAsync(m *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	return f.JetStream.PublishMsgAsync(m, append(opts, jetstream.WithRetryWait(failoverStep), jetstream.WithRetryAttempts(int(f.wait/failoverStep)))...)
}

// FailoverWait is how long a publish or KV read keeps trying; kv.Open
// finds it here.
func (f failover) FailoverWait() time.Duration { return f.wait }

// failoverStep is the pause between asynchronous attempts, and the
// shortest a synchronous one may wait for its acknowledgement.
const failoverStep = 250 * time.Millisecond

// attemptTimeout bounds one synchronous attempt (the client's own default
// for a request without a deadline).
const attemptTimeout = 5 * time.Second
