package idle

import (
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/events"
)

// Clocks is the table of idle clocks, kept from the activity stream
// (events.FollowActivity): per user, the newest beacon of each sender (an
// edge's requests and streams, a broker's model calls) and the highest
// stream sequence seen. The sweeper decides by it; an edge shows what
// Views reads of it for the users it shows.
type Clocks struct {
	mu    sync.Mutex
	users map[string]*clock
}

type clock struct {
	edges map[string]beacon
	seq   uint64
}

type beacon struct {
	inFlight   int
	idle       int
	lastActive time.Time
	sentAt     time.Time
	ttl        time.Duration
}

// NewClocks returns an empty table.
func NewClocks() *Clocks { return &Clocks{users: map[string]*clock{}} }

// Observe records a beacon the stream stored at sequence seq, time
// stamped. Times are the stream's, not the sender's (events.Beacon.At), so
// a sender whose clock is off by any amount changes nothing. Per sender
// the clock only moves forward, so a beacon claiming less than was already
// seen (a forgery under another edge's name: edges share one NATS
// identity) can keep a sandbox awake but never make a busy one look idle
// sooner.
func (c *Clocks) Observe(b events.Beacon, seq uint64, stamped time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := c.users[b.User]
	if u == nil {
		u = &clock{edges: map[string]beacon{}}
		c.users[b.User] = u
	}
	last, ttl := b.At(stamped)
	next := beacon{inFlight: max(b.InFlight, 0), idle: max(b.IdleStreams, 0), lastActive: last, sentAt: stamped, ttl: ttl}
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

// seen is when the sender last saw the user active: its last activity, or
// the time of a beacon that reported work in flight (work counts as
// activity while it lasts).
func (b beacon) seen() time.Time {
	if b.inFlight > 0 && b.sentAt.After(b.lastActive) {
		return b.sentAt
	}
	return b.lastActive
}

// Load is one sender's work in flight for a user as of its newest beacon.
type Load struct {
	Edge     string    `json:"edge"`
	InFlight int       `json:"in_flight"`
	At       time.Time `json:"at"`
}

// View is what the clocks say about one user at a moment.
type View struct {
	// Last is when the user was last seen active: the newest LastActive,
	// or, for a sender that reported work in flight, the time of that
	// report.
	Last time.Time
	// Busy means some sender has work in flight per a beacon still within
	// its TTL; a dead sender stops counting once its beacons expire.
	Busy bool
	// IdleStreams counts the streams open on live senders that no longer
	// count as activity (IDLE_CONNECTED_TIMEOUT without browser input).
	IdleStreams int
	// BusyUntil, while Busy, is when the newest beacon reporting work in
	// flight expires: Busy holds at least until then, and after it only
	// if a newer beacon says so.
	BusyUntil time.Time
	// Load is the work in flight per sender, by name.
	Load []Load
	// Seq is the highest activity-stream sequence seen for the user.
	Seq uint64
}

// View returns user's view at now.
func (c *Clocks) View(user string, now time.Time) View {
	c.mu.Lock()
	defer c.mu.Unlock()
	var v View
	u := c.users[user]
	if u == nil {
		return v
	}
	v.Seq = u.seq
	for edge, b := range u.edges {
		if seen := b.seen(); seen.After(v.Last) {
			v.Last = seen
		}
		if now.Sub(b.sentAt) >= b.ttl {
			continue
		}
		if b.inFlight > 0 {
			v.Busy = true
			if until := b.sentAt.Add(b.ttl); until.After(v.BusyUntil) {
				v.BusyUntil = until
			}
			v.Load = append(v.Load, Load{Edge: edge, InFlight: b.inFlight, At: b.sentAt})
		}
		v.IdleStreams += b.idle
	}
	slices.SortFunc(v.Load, func(x, y Load) int { return strings.Compare(x.Edge, y.Edge) })
	return v
}

// Forget drops the clocks of users gone says have no sandbox, once no
// beacon of theirs can change a decision any more: each is older than its
// TTL (it pins nothing) and than keep, the idle timeout (its last activity
// would not keep a sandbox awake). A beacon is read before the sandbox it
// is about, more often than not: the activity stream and the sandboxes
// bucket are read apart, and either can lag. Forgetting such a clock at
// once would let its sandbox, when it shows up, be judged by its Ready
// time alone, and a busy one suspended.
func (c *Clocks) Forget(gone func(user string) bool, now time.Time, keep time.Duration) {
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

// Len is how many users have a clock.
func (c *Clocks) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.users)
}
