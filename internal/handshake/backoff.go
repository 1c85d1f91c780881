package handshake

import (
	"sync"
	"time"
)

// Backoff paces handshakes asked for again for one key (a user's pod as
// seen from one host). A DSH that refuses every cookie would otherwise turn
// each request into a handshake: a pod-log read, a command and an audit
// event. The first go is at once; while they keep coming, each waits
// twice as long after the one before as that one did, up to a maximum.
// A key left alone for that maximum after its wait ran out starts afresh, so a
// legitimate refresh (DSH restarted and rotated its token) is never held.
// It lives in one process: the edge paces its own refreshes, lifecycle
// every edge's.
type Backoff struct {
	min, max time.Duration

	mu   sync.Mutex
	keys map[string]backoffState
}

type backoffState struct {
	at   time.Time     // the last go
	wait time.Duration // how long after at the next may go
}

// maxBackoffKeys bounds the keys a Backoff remembers; past it, keys whose
// pacing is over are forgotten, and if that is not enough, all of them.
const maxBackoffKeys = 1 << 16

// NewBackoff paces from min up to max.
func NewBackoff(min, max time.Duration) *Backoff { return &Backoff{min: min, max: max} }

// EdgeRefreshes is an edge's pacing of the refreshes it asks for after DSH
// refused a cookie: at once, then 2 s, 4 s, … up to a minute apart.
func EdgeRefreshes() *Backoff { return NewBackoff(2*time.Second, time.Minute) }

// LifecycleRefreshes is lifecycle's pacing of the handshakes it is asked
// to redo, whichever edge asks: half the edge's, so that one edge pacing
// itself is never refused for a few milliseconds of command latency, while
// many edges together get no more than this.
func LifecycleRefreshes() *Backoff { return NewBackoff(time.Second, 30*time.Second) }

// Next reports how long before a handshake for key may go. Zero means
// now, and the go is recorded; otherwise nothing changes.
func (b *Backoff) Next(key string, now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.keys[key]
	if ok {
		if next := s.at.Add(s.wait); now.Before(next) {
			return next.Sub(now)
		}
		ok = !b.over(s, now)
	}
	if ok {
		s.wait = min(2*s.wait, b.max)
	} else {
		s.wait = b.min
	}
	s.at = now
	if b.keys == nil {
		b.keys = map[string]backoffState{}
	}
	if _, known := b.keys[key]; !known && len(b.keys) >= maxBackoffKeys {
		for k, old := range b.keys {
			if b.over(old, now) {
				delete(b.keys, k)
			}
		}
		if len(b.keys) >= maxBackoffKeys {
			clear(b.keys)
		}
	}
	b.keys[key] = s
	return 0
}

// over reports whether s's key has been left alone long enough to start
// afresh.
func (b *Backoff) over(s backoffState, now time.Time) bool {
	return now.Sub(s.at) >= s.wait+b.max
}
