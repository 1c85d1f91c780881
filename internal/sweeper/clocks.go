// Package sweeper decides when sandboxes are idle: it keeps an idle clock
// per user from the activity stream (whose last message per subject is
// every edge's latest beacon, so a restarted sweeper rebuilds the clocks
// from it), and, while it holds the sweeper lease, asks lifecycle to
// suspend sandboxes nobody has used for IDLE_TIMEOUT. It holds no
// Kubernetes credentials; lifecycle re-checks each decision before acting.
package sweeper

import (
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/events"
)

// clocks is the table of idle clocks: per user, the newest beacon of
// each edge and the highest stream sequence seen.
type clocks struct {
	mu    sync.Mutex
	users map[string]*clock
}

type clock struct {
	edges map[string]beacon
	seq   uint64
}

type beacon struct {
	inFlight   int
	lastActive time.Time
	sentAt     time.Time
	ttl        time.Duration
}

func newClocks() *clocks { return &clocks{users: map[string]*clock{}} }

// observe records a beacon the stream stored at sequence seq, time
// stamped. Times are the stream's, not the edge's (events.Beacon.At), so an
// edge whose clock is off by any amount changes nothing. Per edge the clock
// only moves forward, so a beacon claiming less than was already seen (a
// forgery under another edge's name: edges share one NATS identity) can
// keep a sandbox awake but never make a busy one look idle sooner.
func (c *clocks) observe(b events.Beacon, seq uint64, stamped time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := c.users[b.User]
	if u == nil {
		u = &clock{edges: map[string]beacon{}}
		c.users[b.User] = u
	}
	last, ttl := b.At(stamped)
	next := beacon{inFlight: b.InFlight, lastActive: last, sentAt: stamped, ttl: ttl}
	if prev, ok := u.edges[b.Edge]; ok {
		if prev.sentAt.After(stamped) {
			return // an older beacon, delivered late
		}
		if seen := prev.seen(); seen.After(next.lastActive) {
			next.lastActive = seen
		}
	}
	u.edges[b.Edge] = next
	u.seq = max(u.seq, seq)
}

// seen is when the edge last saw the user active: its last activity, or
// the time of a beacon that reported work in flight (an open WebSocket is
// activity while it lasts).
func (b beacon) seen() time.Time {
	if b.inFlight > 0 && b.sentAt.After(b.lastActive) {
		return b.sentAt
	}
	return b.lastActive
}

// view is what the sweeper knows about one user at a moment.
type view struct {
	// last is when the user was last seen active: the newest LastActive,
	// or, for an edge that reported work in flight, the time of that
	// report (an open WebSocket is activity while it lasts).
	last time.Time
	// busy means some edge has work in flight per a beacon still within
	// its TTL; a dead edge stops counting once its beacons expire.
	busy bool
	seq  uint64
}

func (c *clocks) view(user string, now time.Time) view {
	c.mu.Lock()
	defer c.mu.Unlock()
	var v view
	u := c.users[user]
	if u == nil {
		return v
	}
	v.seq = u.seq
	for _, b := range u.edges {
		if seen := b.seen(); seen.After(v.last) {
			v.last = seen
		}
		if b.inFlight > 0 && now.Sub(b.sentAt) < b.ttl {
			v.busy = true
		}
	}
	return v
}

// forget drops the clocks of users gone says have no sandbox, once no
// beacon of theirs can change a decision any more: each is older than its
// TTL (it pins nothing) and than keep, the idle timeout (its last activity
// would not keep a sandbox awake). A beacon is read before the sandbox it
// is about, more often than not: the activity stream and the sandboxes
// bucket are read apart, and either can lag. Forgetting such a clock at
// once would let its sandbox, when it shows up, be judged by its Ready
// time alone, and a busy one suspended.
func (c *clocks) forget(gone func(user string) bool, now time.Time, keep time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for u, cl := range c.users {
		if gone(u) && cl.spent(now, keep) {
			delete(c.users, u)
		}
	}
}

// spent reports whether every beacon of the clock is older, at now, than
// its TTL and than keep.
func (cl *clock) spent(now time.Time, keep time.Duration) bool {
	for _, b := range cl.edges {
		if now.Sub(b.sentAt) < max(b.ttl, keep) {
			return false
		}
	}
	return true
}

func (c *clocks) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.users)
}
