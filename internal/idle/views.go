package idle

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
)

// Views reads users' idle clocks from the activity stream when asked,
// for an edge's pages (the user's own, the admin view): the newest beacon
// of each sender for each user, in one batched read of the stream's
// index of subjects. An edge holds no table and follows no stream, so
// what it costs grows with the users it shows, not with everyone active;
// the sweeper, which decides, keeps the whole table (Clocks). A user's
// beacons, once read, answer for Fresh: a status stream asks twice a
// second, and a page shows times to the second.
type Views struct {
	NC *nats.Conn
	// Fresh is how long what was read of a user stands (0: a second).
	Fresh time.Duration

	mu      sync.Mutex
	read    map[string]readClock
	pruneAt int
}

type readClock struct {
	c  *clock // nil: no beacon
	at time.Time
}

// defaultFresh is Views.Fresh's default.
const defaultFresh = time.Second

// minPrune is how many users' reads are kept before the stale ones are
// dropped (and the bound doubles with what is still fresh).
const minPrune = 4096

// viewsPerRead is how many users one read asks for: each has a beacon
// per sender (every edge and broker), and one read answers at most
// kv.MaxLastOf.
const viewsPerRead = 16

// Of is each of users' view at now (a user without a beacon has the zero
// view), as Clocks.View would say it after following the stream.
func (v *Views) Of(ctx context.Context, users []string, now time.Time) (map[string]View, error) {
	held := NewClocks()
	var stale []string
	fresh := cmp.Or(v.Fresh, defaultFresh)
	v.mu.Lock()
	for _, u := range users {
		if r, ok := v.read[u]; ok && time.Since(r.at) < fresh {
			if r.c != nil {
				held.users[u] = r.c
			}
		} else {
			stale = append(stale, u)
		}
	}
	v.mu.Unlock()
	got := NewClocks()
	for batch := range slices.Chunk(stale, viewsPerRead) {
		subjects := make([]string, len(batch))
		for i, u := range batch {
			subjects[i] = events.ActivitySubjectUser(u)
		}
		msgs, err := kv.LastMsgs(ctx, v.NC, events.StreamActivity, subjects...)
		if err != nil {
			return nil, fmt.Errorf("activity of %d users: %w", len(batch), err)
		}
		for _, m := range msgs {
			observeRaw(got, m)
		}
	}
	v.remember(stale, got, fresh)
	for u, c := range got.users {
		held.users[u] = c
	}
	out := make(map[string]View, len(held.users))
	for u := range held.users {
		out[u] = held.View(u, now)
	}
	return out, nil
}

// remember keeps what was read of users (got, by user; none for a user
// without a beacon) for fresh. The clocks kept are never changed after,
// so readers share them.
func (v *Views) remember(users []string, got *Clocks, fresh time.Duration) {
	at := time.Now()
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.read == nil {
		v.read = map[string]readClock{}
	}
	for _, u := range users {
		v.read[u] = readClock{got.users[u], at}
	}
	if len(v.read) <= max(v.pruneAt, minPrune) {
		return
	}
	for u, r := range v.read {
		if at.Sub(r.at) >= fresh {
			delete(v.read, u)
		}
	}
	v.pruneAt = 2 * len(v.read)
}

// One is user's view at now.
func (v *Views) One(ctx context.Context, user string, now time.Time) (View, error) {
	views, err := v.Of(ctx, []string{user}, now)
	return views[user], err
}

// observeRaw observes a direct get's beacon, as the stream stored it. A
// beacon is counted for the user its subject names only: the subject is
// what the read asked for.
func observeRaw(c *Clocks, m *nats.Msg) {
	subject := m.Header.Get(jetstream.SubjectHeader)
	seq, err := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
	if err != nil {
		return
	}
	stamped, err := time.Parse(time.RFC3339Nano, m.Header.Get(jetstream.TimeStampHeaer))
	if err != nil {
		return
	}
	b, err := events.Decode[events.Beacon](m.Data)
	if err != nil || !strings.HasPrefix(subject, events.ActivitySubject(b.User, "")) {
		return
	}
	c.Observe(b, seq, stamped)
}
