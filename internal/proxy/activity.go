package proxy

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aaas-project/aaas/internal/events"
)

// tracker turns request starts and ends, streams and browser input into
// activity beacons (the rule they feed is idle's): at most about one per
// user per second, one at once on the first request after a quiet spell
// (so a pending suspend sees it), and heartbeats while anything is in
// flight. A stream (WebSocket, streamed response) counts as work in
// flight only while the browser has sent something on it within
// idleConnected; past that it is reported apart (Beacon.IdleStreams), so a
// forgotten tab does not pin its sandbox. The request path only touches
// atomics; publishing happens in the tracker's own goroutine.
type tracker struct {
	pub           *events.Publisher
	edge          string
	interval      time.Duration
	ttl           time.Duration
	idleConnected time.Duration
	log           *slog.Logger

	users  sync.Map // user -> *userActivity
	urgent chan string
}

type userActivity struct {
	requests atomic.Int64
	last     atomic.Int64 // unix nanos of the last start, end or input
	sent     atomic.Int64 // unix nanos of the last beacon
	dirty    atomic.Bool

	// streams are the user's open streams; live and idle count them as
	// the last sweep (or open, close, input) found them.
	mu         sync.Mutex
	streams    map[*stream]struct{}
	live, idle int
	liveNow    atomic.Int64 // live, for the request path
}

// stream is one open stream of a user: when the browser last sent on it.
type stream struct {
	a     *userActivity
	t     *tracker
	user  string
	input atomic.Int64
	stale atomic.Bool
}

func newTracker(pub *events.Publisher, edge string, interval, ttl, idleConnected time.Duration, log *slog.Logger) *tracker {
	return &tracker{pub: pub, edge: edge, interval: interval, ttl: ttl, idleConnected: idleConnected, log: log, urgent: make(chan string, 1024)}
}

func (t *tracker) get(user string) *userActivity {
	if a, ok := t.users.Load(user); ok {
		return a.(*userActivity)
	}
	a, _ := t.users.LoadOrStore(user, &userActivity{streams: map[*stream]struct{}{}})
	return a.(*userActivity)
}

// activeNow records activity at now and, after a quiet spell, has a beacon
// sent at once.
func (t *tracker) activeNow(user string, a *userActivity) {
	now := time.Now().UnixNano()
	a.last.Store(now)
	a.dirty.Store(true)
	if sent := a.sent.Load(); now-sent > int64(t.interval) && a.sent.CompareAndSwap(sent, now) {
		select {
		case t.urgent <- user:
		default: // the tick will send it
		}
	}
}

// begin records the start of a request.
func (t *tracker) begin(user string) {
	a := t.get(user)
	a.requests.Add(1)
	t.activeNow(user, a)
}

// end records the end of a request.
func (t *tracker) end(user string) {
	a := t.get(user)
	a.requests.Add(-1)
	a.last.Store(time.Now().UnixNano())
	a.dirty.Store(true)
}

// touch records activity of a request (its answer written).
func (t *tracker) touch(user string) {
	a := t.get(user)
	a.last.Store(time.Now().UnixNano())
	a.dirty.Store(true)
}

// open records the start of a stream: browser input, as it asked for it.
func (t *tracker) open(user string) *stream {
	a := t.get(user)
	s := &stream{a: a, t: t, user: user}
	s.input.Store(time.Now().UnixNano())
	a.mu.Lock()
	a.streams[s] = struct{}{}
	a.live++
	a.liveNow.Store(int64(a.live))
	a.mu.Unlock()
	t.activeNow(user, a)
	return s
}

// promote turns a request in flight into a stream (its response became
// one), with no moment in between when the user has nothing in flight.
func (t *tracker) promote(user string) *stream {
	s := t.open(user)
	t.end(user)
	return s
}

// browserInput records something the browser sent on the stream. A stream
// that had gone stale counts again at once.
func (s *stream) browserInput() {
	s.input.Store(time.Now().UnixNano())
	if s.stale.Load() {
		s.a.mu.Lock()
		if s.stale.Load() {
			s.stale.Store(false)
			s.a.idle--
			s.a.live++
			s.a.liveNow.Store(int64(s.a.live))
		}
		s.a.mu.Unlock()
	}
	s.t.activeNow(s.user, s.a)
}

// close records the end of the stream. Ending a live stream is activity
// (it counted until now); ending a stale one is not: the edge closing a
// forgotten tab must not move the clock it was closed by.
func (s *stream) close() {
	a := s.a
	a.mu.Lock()
	if _, ok := a.streams[s]; !ok {
		a.mu.Unlock()
		return
	}
	delete(a.streams, s)
	if s.stale.Load() {
		a.idle--
	} else {
		a.live--
		a.last.Store(time.Now().UnixNano())
	}
	a.liveNow.Store(int64(a.live))
	a.mu.Unlock()
	a.dirty.Store(true)
}

// age marks the streams without browser input for idleConnected stale,
// moving the user's last activity to when each stopped counting.
func (t *tracker) age(a *userActivity, now int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for s := range a.streams {
		if in := s.input.Load(); !s.stale.Load() && now-in >= int64(t.idleConnected) {
			s.stale.Store(true)
			a.live--
			a.idle++
			if until := in + int64(t.idleConnected); until > a.last.Load() {
				a.last.Store(until)
			}
			a.dirty.Store(true)
		}
	}
	a.liveNow.Store(int64(a.live))
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
		t.age(a, now)
		busy := a.requests.Load()+a.liveNow.Load() > 0
		a.mu.Lock()
		open := len(a.streams) > 0
		a.mu.Unlock()
		switch {
		case a.dirty.Load() && now-a.sent.Load() >= int64(time.Second)/2:
			t.send(user, a)
		// Open streams, idle ones too, are beaconed every interval: a
		// beacon lives BEACON_TTL, and a tab left open must still count as
		// open when its sandbox falls due (reason idle_connected, which
		// the page's reconnect obeys), not only in the one beacon sent
		// when it went idle.
		case (busy || open) && now-a.sent.Load() >= int64(t.interval):
			t.send(user, a)
		case !busy && !open && now-a.last.Load() > int64(forget):
			t.users.Delete(user)
		}
		return true
	})
}

func (t *tracker) send(user string, a *userActivity) {
	a.dirty.Store(false)
	now := time.Now()
	a.sent.Store(now.UnixNano())
	a.mu.Lock()
	live, idle := a.live, a.idle
	a.mu.Unlock()
	b := events.Beacon{
		User: user, Edge: t.edge, InFlight: int(max(a.requests.Load(), 0)) + live, IdleStreams: idle,
		LastActive: time.Unix(0, a.last.Load()).UTC(), SentAt: now.UTC(), TTL: t.ttl,
	}
	if _, err := t.pub.Beacon(b); err != nil {
		a.dirty.Store(true) // try again on the next tick
		t.log.Debug("beacon not sent", "user", user, "err", err)
	}
}
