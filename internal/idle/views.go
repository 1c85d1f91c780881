package idle

import (
	"context"
	"fmt"
	"strconv"
	"strings"
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
// the sweeper, which decides, keeps the whole table (Clocks).
type Views struct {
	NC *nats.Conn
}

// viewsPerRead is how many users one read asks for: each has a beacon
// per sender (every edge and broker), and one read answers at most
// kv.MaxLastOf.
const viewsPerRead = 16

// Of is each of users' view at now (a user without a beacon has the zero
// view), as Clocks.View would say it after following the stream.
func (v Views) Of(ctx context.Context, users []string, now time.Time) (map[string]View, error) {
	c := NewClocks()
	for len(users) > 0 {
		batch := users[:min(len(users), viewsPerRead)]
		users = users[len(batch):]
		subjects := make([]string, len(batch))
		for i, u := range batch {
			subjects[i] = events.ActivitySubjectUser(u)
		}
		msgs, err := kv.LastMsgs(ctx, v.NC, events.StreamActivity, subjects...)
		if err != nil {
			return nil, fmt.Errorf("activity of %d users: %w", len(batch), err)
		}
		for _, m := range msgs {
			observeRaw(c, m)
		}
	}
	out := make(map[string]View, len(c.users))
	for u := range c.users {
		out[u] = c.View(u, now)
	}
	return out, nil
}

// One is user's view at now.
func (v Views) One(ctx context.Context, user string, now time.Time) (View, error) {
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
