package idle_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/idle"
)

// An edge's views, read from the stream when shown, say what the table
// a follower keeps says, for each user asked about and for them alone,
// over more users than one read takes; a beacon published under one
// user's subject naming another counts for neither.
func TestViewsReadWhatTheClocksFollow(t *testing.T) {
	s := natstest.Start(t)
	nc, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 30*time.Second)
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	pub := events.NewPublisher(js, "edge-a", slog.New(slog.DiscardHandler))
	var users []string
	for i := range 40 { // more than one read's worth
		user := fmt.Sprintf("user-%02d", i)
		users = append(users, user)
		for _, edge := range []string{"edge-a", "edge-b", "broker-1"} {
			f, err := pub.Beacon(events.Beacon{User: user, Edge: edge, InFlight: i % 3, LastActive: now.Add(-time.Duration(i) * time.Second), SentAt: now, TTL: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			<-f.Ok()
		}
	}
	// A forgery: ann's subject, bob's name, work in flight.
	forged, _ := json.Marshal(events.Beacon{V: events.SchemaVersion, User: "bob", Edge: "edge-x", InFlight: 5, LastActive: now, SentAt: now, TTL: time.Minute})
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: events.ActivitySubject("ann", "edge-x"), Data: forged}); err != nil {
		t.Fatal(err)
	}

	followed := idle.NewClocks()
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = events.FollowActivity(fctx, js, slog.New(slog.DiscardHandler), followed.Observe, func() {})
	}()
	testutil.Eventually(t, 10*time.Second, func() error {
		if followed.Len() < len(users) {
			return fmt.Errorf("%d clocks followed", followed.Len())
		}
		return nil
	})

	views, err := (&idle.Views{NC: nc}).Of(ctx, append(users, "ann", "bob", "nobody"), now)
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range users {
		got, want := views[u], followed.View(u, now)
		if !got.Last.Equal(want.Last) || got.Busy != want.Busy || len(got.Load) != len(want.Load) || got.Seq != want.Seq {
			t.Errorf("%s: read %+v, followed %+v", u, got, want)
		}
	}
	if v := views["user-01"]; !v.Busy || len(v.Load) != 3 {
		t.Errorf("user-01, busy on three senders: %+v", v)
	}
	for _, u := range []string{"ann", "bob", "nobody"} {
		if v, ok := views[u]; ok && (v.Busy || !v.Last.IsZero()) {
			t.Errorf("%s: %+v from a forged beacon or none", u, v)
		}
	}
	one, err := (&idle.Views{NC: nc}).One(ctx, "user-07", now)
	if err != nil || !one.Last.Equal(followed.View("user-07", now).Last) {
		t.Fatalf("one user's view: %+v %v", one, err)
	}
}

// What was read of a user answers again without a read while it is
// fresh: the status stream asks twice a second. Reads are counted where
// the server gets them (a subscriber on the direct get's subject), and a
// user not read yet is read (the positive control).
func TestViewsReadAUserOncePerFreshness(t *testing.T) {
	s := natstest.Start(t)
	nc, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 30*time.Second)
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	pub := events.NewPublisher(js, "edge-a", slog.New(slog.DiscardHandler))
	now := time.Now().UTC()
	f, err := pub.Beacon(events.Beacon{User: "ann", InFlight: 1, LastActive: now, SentAt: now, TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	<-f.Ok()
	reads, err := nc.SubscribeSync("$JS.API.DIRECT.GET." + events.StreamActivity)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	count := func() int {
		n, _, err := reads.Pending()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	v := &idle.Views{NC: nc, Fresh: time.Hour}
	for range 3 {
		if got, err := v.One(ctx, "ann", now); err != nil || !got.Busy {
			t.Fatalf("ann's view: %+v %v", got, err)
		}
	}
	if _, err := v.One(ctx, "bob", now); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := count(); n != 2 {
			return fmt.Errorf("%d reads, want 2 (ann once, bob once)", n)
		}
		return nil
	})
}
