package admin

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/events"
)

// Activity is every edge's newest beacon per user, from the activity
// stream: what the admin view shows as last activity and work in flight
// per edge. Times are the stream's, never an edge's clock.
type Activity struct {
	mu    sync.RWMutex
	users map[string]map[string]seen // user → edge → newest beacon
}

type seen struct {
	inFlight   int
	lastActive time.Time
	sentAt     time.Time
	ttl        time.Duration
}

// EdgeLoad is one edge's work in flight for a user (requests and
// WebSockets), as of its newest beacon.
type EdgeLoad struct {
	Edge     string    `json:"edge"`
	InFlight int       `json:"in_flight"`
	At       time.Time `json:"at"`
}

// NewActivity returns an empty table; Follow fills it.
func NewActivity() *Activity { return &Activity{users: map[string]map[string]seen{}} }

// Follow reads the activity stream into the table until ctx ends. The
// admin view is no reason for an edge to stop: a stream it cannot follow
// yet (the bus away at start) is asked again every few seconds.
func (a *Activity) Follow(ctx context.Context, js jetstream.JetStream, log *slog.Logger) {
	for {
		err := events.FollowActivity(ctx, js, log, a.observe, func() {})
		if err == nil {
			return
		}
		log.Warn("admin view: activity not followed yet", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

// observe keeps the newest beacon per (user, edge), read by the stream's
// clock (events.Beacon.At), so an edge whose clock is off shows right.
func (a *Activity) observe(b events.Beacon, _ uint64, stamped time.Time) {
	last, ttl := b.At(stamped)
	next := seen{inFlight: max(b.InFlight, 0), lastActive: last, sentAt: stamped, ttl: ttl}
	a.mu.Lock()
	defer a.mu.Unlock()
	edges := a.users[b.User]
	if edges == nil {
		edges = map[string]seen{}
		a.users[b.User] = edges
	}
	if prev, ok := edges[b.Edge]; ok && prev.sentAt.After(stamped) {
		return
	}
	edges[b.Edge] = next
}

// Of is user's last activity on any edge and the work in flight on each
// edge whose beacon has not outlived its TTL at now, by edge name.
func (a *Activity) Of(user string, now time.Time) (last time.Time, load []EdgeLoad) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	for edge, s := range a.users[user] {
		if s.lastActive.After(last) {
			last = s.lastActive
		}
		if s.inFlight > 0 && now.Sub(s.sentAt) <= s.ttl {
			load = append(load, EdgeLoad{Edge: edge, InFlight: s.inFlight, At: s.sentAt})
		}
	}
	slices.SortFunc(load, func(x, y EdgeLoad) int { return strings.Compare(x.Edge, y.Edge) })
	return last, load
}
