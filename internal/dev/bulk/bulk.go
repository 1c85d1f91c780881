// Package bulk fills JetStream quickly for benchmarks and tests: many
// messages published at once, a bounded number in flight, the first
// failure kept.
package bulk

import (
	"context"
	"sync"

	"github.com/nats-io/nats.go/jetstream"
)

// inFlight stays under the client's 4000 async publishes in flight, past
// which it stalls.
const inFlight = 2000

// Writer publishes messages asynchronously.
type Writer struct {
	js    jetstream.JetStream
	slots chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	err   error
}

// New is a Writer publishing through js.
func New(js jetstream.JetStream) *Writer {
	return &Writer{js: js, slots: make(chan struct{}, inFlight)}
}

// Put publishes data on subject, waiting while inFlight are unanswered.
func (w *Writer) Put(subject string, data []byte) {
	f, err := w.js.PublishAsync(subject, data)
	if err != nil {
		w.fail(err)
		return
	}
	w.slots <- struct{}{}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		defer func() { <-w.slots }()
		select {
		case <-f.Ok():
		case err := <-f.Err():
			w.fail(err)
		}
	}()
}

func (w *Writer) fail(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = err
	}
}

// Wait returns once every message put is answered, with the first
// failure.
func (w *Writer) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { w.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return ctx.Err()
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}
