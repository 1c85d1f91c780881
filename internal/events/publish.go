package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publisher writes commands, beacons, model calls' usage and audit events. Commands are
// published synchronously (the caller needs to know they are durable);
// beacons and audit events asynchronously, so the request path never waits
// on NATS.
type Publisher struct {
	js     jetstream.JetStream
	source string
	log    *slog.Logger
	// settle bounds how long Command keeps asking about a copy of its
	// command that another publisher is storing.
	settle time.Duration
}

// NewPublisher returns a publisher that stamps source (the process's
// instance id) on what it sends.
func NewPublisher(js jetstream.JetStream, source string, log *slog.Logger) *Publisher {
	p := &Publisher{js: js, source: source, log: log, settle: minSettle}
	// A copy being stored by a leader elected a moment ago commits when
	// its new quorum does, which can take as long as the election itself:
	// a connection that rides out elections (natsconn's) waits as long
	// for the copy.
	if f, ok := js.(interface{ FailoverWait() time.Duration }); ok {
		p.settle = max(p.settle, f.FailoverWait())
	}
	return p
}

// Command publishes c with its ID as Nats-Msg-Id. It reports whether the
// stream already held a command with that ID (a collapsed duplicate).
func (p *Publisher) Command(ctx context.Context, c Command) (duplicate bool, err error) {
	if c.IssuedBy == "" {
		c.IssuedBy = p.source
	}
	if c.Trace == "" {
		c.Trace = ident.RequestIDOf(ctx)
	}
	if err := c.Validate(); err != nil {
		return false, fmt.Errorf("publish %s command: %w", c.Verb, err)
	}
	data, err := json.Marshal(c)
	if err != nil {
		return false, fmt.Errorf("publish %s command: %w", c.Verb, err)
	}
	deadline := time.Now().Add(p.settle)
	for attempt := 1; ; attempt++ {
		ack, err := p.js.PublishMsg(ctx, &nats.Msg{Subject: c.Subject(), Data: data}, jetstream.WithMsgID(c.ID))
		switch {
		case err == nil:
			return ack.Duplicate, nil
		// Another publisher (an edge asking for the same wake or
		// handshake) is storing this very command right now; a clustered
		// stream says so instead of waiting. Ask again shortly: the answer
		// is then "duplicate" once that one is stored, or this one is
		// stored if that one failed.
		case inProcess(err) && time.Now().Before(deadline):
			select {
			case <-ctx.Done():
				return false, fmt.Errorf("publish %s command for %s: %w", c.Verb, c.User, ctx.Err())
			case <-time.After(min(time.Duration(attempt)*20*time.Millisecond, maxSettlePause)):
			}
		default:
			return false, fmt.Errorf("publish %s command for %s: %w", c.Verb, c.User, err)
		}
	}
}

// errCodeInProcess is JetStream's "duplicate message id is in process".
const errCodeInProcess jetstream.ErrorCode = 10158

// minSettle is how long Command asks about a copy of its command another
// publisher is storing, on a connection that does not ride out elections;
// maxSettlePause is the longest pause between two asks.
const (
	minSettle      = time.Second
	maxSettlePause = 250 * time.Millisecond
)

func inProcess(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeInProcess
}

// Beacon publishes b without waiting for the acknowledgement. It returns the
// future so callers that need the stream sequence (tests, a first beacon
// after quiet) can wait for it.
func (p *Publisher) Beacon(b Beacon) (jetstream.PubAckFuture, error) {
	b.V = SchemaVersion
	if b.Edge == "" {
		b.Edge = p.source
	}
	data, err := json.Marshal(b)
	if err != nil {
		return nil, fmt.Errorf("publish beacon: %w", err)
	}
	f, err := p.js.PublishMsgAsync(&nats.Msg{Subject: b.Subject(), Data: data})
	if err != nil {
		return nil, fmt.Errorf("publish beacon for %s: %w", b.User, err)
	}
	return f, nil
}

// Usage publishes the record of one model call and waits until the stream
// has stored it. The call's id is its Nats-Msg-Id, so a record published
// again (its acknowledgement lost, or held by a broker while NATS was
// unreachable) is stored once.
func (p *Publisher) Usage(ctx context.Context, e UsageEvent) error {
	e.V = SchemaVersion
	if e.Broker == "" {
		e.Broker = p.source
	}
	if e.ID == "" || e.User == "" {
		return fmt.Errorf("publish usage: the call has no id or no user")
	}
	data, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("publish usage: %w", err)
	}
	if _, err := p.js.PublishMsg(ctx, &nats.Msg{Subject: e.Subject(), Data: data}, jetstream.WithMsgID(e.ID)); err != nil {
		return fmt.Errorf("publish usage of call %s: %w", e.ID, err)
	}
	return nil
}

// Audit records e. It does not block the caller; a failure to record is
// logged (without the event's detail, which is for the audit trail only).
func (p *Publisher) Audit(e AuditEvent) {
	e.V = SchemaVersion
	if e.At.IsZero() {
		e.At = time.Now().UTC()
	}
	if e.Source == "" {
		e.Source = p.source
	}
	data, err := json.Marshal(e)
	if err != nil {
		p.log.Error("encode audit event", "kind", e.Kind, "err", err)
		return
	}
	f, err := p.js.PublishMsgAsync(&nats.Msg{Subject: e.Subject(), Data: data})
	if err != nil {
		p.log.Warn("audit event not recorded", "kind", e.Kind, "user", e.User, "err", err)
		return
	}
	go func() {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			p.log.Warn("audit event not recorded", "kind", e.Kind, "user", e.User, "err", err)
		}
	}()
}
