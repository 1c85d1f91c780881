package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// permanentError marks a handler failure that no retry can fix.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: the message is terminated and
// recorded instead of redelivered.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// IsPermanent reports whether err was marked Permanent.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// laterError asks for the message back after a delay without it being the
// handler's failure: the work belongs to another moment or another replica.
type laterError struct {
	err   error
	delay time.Duration
}

func (e laterError) Error() string { return e.err.Error() }
func (e laterError) Unwrap() error { return e.err }

// Later returns the message to the queue, redelivered after delay. Use it
// when this worker should not handle the message now: another command of
// the same user is running, or the message is of a newer schema that a
// newer replica understands. It still counts as a delivery.
func Later(err error, delay time.Duration) error { return laterError{err, delay} }

// IsLater reports whether err was made by Later.
func IsLater(err error) bool { return errors.As(err, new(laterError)) }

// ConsumerConfig describes a durable, explicitly acknowledged consumer.
type ConsumerConfig struct {
	Stream         string
	Durable        string
	FilterSubjects []string
	// MaxDeliver bounds deliveries; the last failed one is recorded.
	MaxDeliver int
	// AckWait is how long a worker may hold a message without progress
	// before the server hands it to another worker. Long handlers keep it
	// alive with progress signals.
	AckWait time.Duration
	// Backoff is the delay before redelivery after the nth failure (the last
	// value repeats), applied with a delayed nak. It is deliberately not the
	// consumer's server-side BackOff: that would also replace AckWait for
	// messages still being worked on, and redeliver long handlers early.
	Backoff []time.Duration
	// Workers handle messages concurrently.
	Workers int
}

func (c ConsumerConfig) withDefaults() ConsumerConfig {
	if c.MaxDeliver <= 0 {
		c.MaxDeliver = 5
	}
	if c.AckWait <= 0 {
		c.AckWait = 30 * time.Second
	}
	if len(c.Backoff) == 0 {
		c.Backoff = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second}
	}
	if c.Workers <= 0 {
		c.Workers = 1
	}
	return c
}

func (c ConsumerConfig) backoff(delivered uint64) time.Duration {
	i := int(delivered) - 1
	if i >= len(c.Backoff) {
		i = len(c.Backoff) - 1
	}
	if i < 0 {
		i = 0
	}
	return c.Backoff[i]
}

// Delivery is one message handed to a Handler.
type Delivery struct {
	Subject   string
	Data      []byte
	Delivered uint64 // 1 on first delivery
	StreamSeq uint64
	Last      bool // this is the final delivery MaxDeliver allows
}

// Handler processes one delivery. nil acknowledges it; an error marked
// Permanent terminates it; any other error retries it with backoff.
type Handler func(ctx context.Context, d Delivery) error

// Exhausted is told about a message that will never be handled: its last
// delivery failed or its failure was permanent.
type Exhausted func(d Delivery, err error)

// CommandConsumer is the durable consumer of the command stream that every
// lifecycle replica pulls from; setup creates it.
const CommandConsumer = "lifecycle"

// CommandConsumerConfig is that consumer: every command, MaxDeliver
// deliveries, AckWait without progress before another replica gets it, and
// up to 4 × workers commands outstanding per replica.
func CommandConsumerConfig(workers, maxDeliver int, ackWait time.Duration) ConsumerConfig {
	return ConsumerConfig{
		Stream: StreamCommands, Durable: CommandConsumer, FilterSubjects: []string{CommandSubjectsAll},
		MaxDeliver: maxDeliver, Workers: workers, AckWait: ackWait,
		Backoff: []time.Duration{500 * time.Millisecond, 2 * time.Second, 10 * time.Second, 30 * time.Second},
	}
}

// EnsureConsumer creates or updates the durable consumer (setup's job).
func EnsureConsumer(ctx context.Context, js jetstream.JetStream, c ConsumerConfig) (jetstream.Consumer, error) {
	c = c.withDefaults()
	cons, err := js.CreateOrUpdateConsumer(ctx, c.Stream, jetstream.ConsumerConfig{
		Durable:        c.Durable,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        c.AckWait,
		MaxDeliver:     c.MaxDeliver,
		FilterSubjects: c.FilterSubjects,
		MaxAckPending:  c.Workers * 4,
	})
	if err != nil {
		return nil, fmt.Errorf("ensure consumer %s on %s: %w", c.Durable, c.Stream, err)
	}
	return cons, nil
}

// Consume runs handler on the messages of the durable consumer c (which
// must exist: EnsureConsumer) with c.Workers workers until ctx ends. Each
// message is acknowledged only after handler returns nil, and while handler
// runs the server is told it is still in progress, so a slow handler is not
// mistaken for a dead one. A message that fails on its last delivery, or
// permanently, goes to exhausted and is then terminated: nothing
// disappears without a record.
//
// Messages are pulled only for idle workers, as many as are idle: none
// waits in a client-side buffer, unwatched, while its AckWait runs out
// behind busy workers (it would be redelivered to another replica and
// then handled here as well), and each pull is a request of its own that
// expires, so a lost one costs a fetchWait, not the consumer.
func Consume(ctx context.Context, js jetstream.JetStream, c ConsumerConfig, handler Handler, exhausted Exhausted, log *slog.Logger) error {
	c = c.withDefaults()
	cons, err := js.Consumer(ctx, c.Stream, c.Durable)
	if err != nil {
		return fmt.Errorf("consumer %s on %s (setup creates it): %w", c.Durable, c.Stream, err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	idle := make(chan struct{}, c.Workers)
	for range c.Workers {
		idle <- struct{}{}
	}
	for {
		select {
		case <-idle:
		case <-ctx.Done():
			return nil
		}
		n := 1
		for n < c.Workers && take(idle) {
			n++
		}
		got := fetch(ctx, cons, n, log, func(msg jetstream.Msg) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { idle <- struct{}{} }()
				handleOne(ctx, c, msg, handler, exhausted, log)
			}()
		})
		for ; got < n; got++ {
			idle <- struct{}{}
		}
		if ctx.Err() != nil {
			return nil
		}
	}
}

// fetchWait bounds one pull request: a request that idle workers wait on
// is renewed this often, and one the server never answered (lost in a
// reconnect or a leader change) costs no more.
const fetchWait = 5 * time.Second

// fetch pulls up to n messages, handing each to start as it arrives, and
// returns how many it handed over.
func fetch(ctx context.Context, cons jetstream.Consumer, n int, log *slog.Logger, start func(jetstream.Msg)) int {
	fctx, cancel := context.WithTimeout(ctx, fetchWait)
	defer cancel()
	batch, err := cons.Fetch(n, jetstream.FetchContext(fctx))
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("consumer fetch failed", "err", err)
			// Not at once again: the connection may be down for a while.
			<-fctx.Done()
		}
		return 0
	}
	got := 0
	for msg := range batch.Messages() {
		start(msg)
		got++
	}
	if err := batch.Error(); err != nil && ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
		log.Warn("consumer fetch failed", "err", err)
	}
	return got
}

// take takes a token from ch if one is there.
func take(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func handleOne(ctx context.Context, c ConsumerConfig, msg jetstream.Msg, handler Handler, exhausted Exhausted, log *slog.Logger) {
	meta, err := msg.Metadata()
	if err != nil {
		log.Error("message without metadata", "subject", msg.Subject(), "err", err)
		_ = msg.Term()
		return
	}
	d := Delivery{
		Subject:   msg.Subject(),
		Data:      msg.Data(),
		Delivered: meta.NumDelivered,
		StreamSeq: meta.Sequence.Stream,
		Last:      int(meta.NumDelivered) >= c.MaxDeliver,
	}

	hctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(c.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				_ = msg.InProgress()
			}
		}
	}()
	err = safely(hctx, handler, d, log)
	close(done)
	cancel()

	switch {
	case err == nil:
		// DoubleAck waits for the server to confirm, so "acked" means the
		// command will not come back.
		actx, acancel := context.WithTimeout(context.Background(), 5*time.Second)
		if aerr := msg.DoubleAck(actx); aerr != nil {
			log.Warn("ack not confirmed; the command may be redelivered", "subject", d.Subject, "seq", d.StreamSeq, "err", aerr)
		}
		acancel()
	case ctx.Err() != nil:
		// Shutting down: leave it for another worker without counting a
		// failure against it beyond this delivery.
		_ = msg.Nak()
	case IsPermanent(err) || d.Last:
		exhausted(d, err)
		_ = msg.TermWithReason(truncate(err.Error(), 200))
	case IsLater(err):
		var later laterError
		errors.As(err, &later)
		log.Debug("command handed back", "subject", d.Subject, "delivered", d.Delivered, "retry_in", later.delay, "why", err)
		_ = msg.NakWithDelay(later.delay)
	default:
		delay := c.backoff(d.Delivered)
		log.Info("command will be retried", "subject", d.Subject, "delivered", d.Delivered, "retry_in", delay, "err", err)
		_ = msg.NakWithDelay(delay)
	}
}

// safely runs handler, turning a panic into an error: the delivery is
// retried like any failure, and the worker, and the process, carry on.
func safely(ctx context.Context, handler Handler, d Delivery, log *slog.Logger) (err error) {
	defer func() {
		if r := recover(); r != nil {
			log.Error("handler panic", "subject", d.Subject, "seq", d.StreamSeq, "delivered", d.Delivered, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			err = fmt.Errorf("handler panic: %v", r)
		}
	}()
	return handler(ctx, d)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
