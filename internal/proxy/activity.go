package proxy

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aaas-project/aaas/internal/events"
)

// tracker turns request starts and ends into activity beacons: at most
// about one per user per second, one at once on the first request after a
// quiet spell (so a pending suspend sees it), and heartbeats while anything
// is in flight. The request path only touches atomics; publishing happens
// in the tracker's own goroutine.
type tracker struct {
	pub      *events.Publisher
	edge     string
	interval time.Duration
	ttl      time.Duration
	log      *slog.Logger

	users  sync.Map // user -> *userActivity
	urgent chan string
}

type userActivity struct {
	inFlight atomic.Int64
	last     atomic.Int64 // unix nanos of the last start, end or message
	sent     atomic.Int64 // unix nanos of the last beacon
	dirty    atomic.Bool
}

func newTracker(pub *events.Publisher, edge string, interval, ttl time.Duration, log *slog.Logger) *tracker {
	return &tracker{pub: pub, edge: edge, interval: interval, ttl: ttl, log: log, urgent: make(chan string, 1024)}
}

func (t *tracker) get(user string) *userActivity {
	if a, ok := t.users.Load(user); ok {
		return a.(*userActivity)
	}
	a, _ := t.users.LoadOrStore(user, &userActivity{})
	return a.(*userActivity)
}

// begin records the start of a request or WebSocket.
func (t *tracker) begin(user string) {
	a := t.get(user)
	now := time.Now().UnixNano()
	a.inFlight.Add(1)
	a.last.Store(now)
	a.dirty.Store(true)
	if sent := a.sent.Load(); now-sent > int64(t.interval) && a.sent.CompareAndSwap(sent, now) {
		select {
		case t.urgent <- user:
		default: // the tick will send it
		}
	}
}

// end records the end of a request or WebSocket.
func (t *tracker) end(user string) {
	a := t.get(user)
	a.inFlight.Add(-1)
	a.last.Store(time.Now().UnixNano())
	a.dirty.Store(true)
}

// touch records activity inside a long-lived connection.
func (t *tracker) touch(user string) {
	a := t.get(user)
	a.last.Store(time.Now().UnixNano())
	a.dirty.Store(true)
}

// run publishes until ctx ends.
func (t *tracker) run(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case user := <-t.urgent:
			t.send(user, t.get(user))
		case <-tick.C:
			t.sweep()
		}
	}
}

// forget is how long a quiet user's entry is kept.
const forget = 10 * time.Minute

func (t *tracker) sweep() {
	now := time.Now().UnixNano()
	t.users.Range(func(k, v any) bool {
		user, a := k.(string), v.(*userActivity)
		busy := a.inFlight.Load() > 0
		switch {
		case a.dirty.Load() && now-a.sent.Load() >= int64(time.Second)/2:
			t.send(user, a)
		case busy && now-a.sent.Load() >= int64(t.interval):
			t.send(user, a)
		case !busy && now-a.last.Load() > int64(forget):
			t.users.Delete(user)
		}
		return true
	})
}

func (t *tracker) send(user string, a *userActivity) {
	a.dirty.Store(false)
	now := time.Now()
	a.sent.Store(now.UnixNano())
	b := events.Beacon{
		User: user, Edge: t.edge, InFlight: int(max(a.inFlight.Load(), 0)),
		LastActive: time.Unix(0, a.last.Load()).UTC(), SentAt: now.UTC(), TTL: t.ttl,
	}
	if _, err := t.pub.Beacon(b); err != nil {
		a.dirty.Store(true) // try again on the next tick
		t.log.Debug("beacon not sent", "user", user, "err", err)
	}
}
