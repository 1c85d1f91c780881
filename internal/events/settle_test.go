package events_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/natsconn"
)

// TestACopyInProcessForLongerThanASecond holds a command uncommitted on
// its stream's leader (both followers down, so no quorum commits it) while
// an edge publishes the same command: the stream answers the edge "in
// process" until the followers are back. On a loaded cluster whose leader
// was just elected that lasts seconds (a clean-clone CI's fault test saw
// wakes answered 503 there); the edge must wait for the copy, as long as it
// would ride out the election itself, and end with a duplicate, not an
// error.
func TestACopyInProcessForLongerThanASecond(t *testing.T) {
	c := natstest.StartCluster(t, 3, embednats.Options{})
	_, admin := natstest.Connect(t, c.URLs())
	ctx := natstest.Context(t, 90*time.Second)
	cfg := events.DefaultStreamsConfig()
	cfg.Replicas = 3
	natstest.Provision(t, ctx, func(ctx context.Context) error { return events.EnsureStreams(ctx, admin, cfg) })
	name := commandsLeader(t, ctx, admin)
	leader := slices.IndexFunc(c.Nodes, func(n *embednats.Server) bool { return n.Name() == name })
	if leader < 0 {
		t.Fatalf("leader %q is none of the nodes", name)
	}
	url := c.Nodes[leader].URL()
	_, raw := natstest.Connect(t, url)
	nc, edge, err := natsconn.Connect(ctx, natsconn.Options{URL: url, Name: "edge", FailoverWait: 20 * time.Second}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)

	cmd := events.NewWake("bob", 7)
	data, err := json.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	publish := func(ctx context.Context) error {
		_, err := raw.PublishMsg(ctx, &nats.Msg{Subject: cmd.Subject(), Data: data}, jetstream.WithMsgID(cmd.ID))
		return err
	}
	var followers []int
	for i := range c.Nodes {
		if i != leader {
			followers = append(followers, i)
			c.Kill(i)
		}
	}
	// The first copy: proposed, never committed while the followers are down.
	first := make(chan error, 1)
	go func() {
		pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		first <- publish(pctx)
	}()
	// The positive control: the stream says the command is in process.
	testutil.Eventually(t, 10*time.Second, func() error {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		var apiErr *jetstream.APIError
		if err := publish(pctx); !errors.As(err, &apiErr) || apiErr.ErrorCode != 10158 {
			return fmt.Errorf("a second copy was answered %v, want \"in process\"", err)
		}
		return nil
	})
	type outcome struct {
		dup bool
		err error
	}
	got := make(chan outcome, 1)
	asked := time.Now()
	go func() {
		dup, err := events.NewPublisher(edge, "edge", quiet).Command(ctx, cmd)
		got <- outcome{dup, err}
	}()
	// Longer than a second in process, then the quorum is back.
	select {
	case o := <-got:
		t.Fatalf("the edge's command ended after %s with the copy still in process: duplicate %v, %v", time.Since(asked), o.dup, o.err)
	case <-time.After(2 * time.Second):
	}
	if err := c.Restart(followers...); err != nil {
		t.Fatal(err)
	}
	o := <-got
	if o.err != nil {
		t.Fatalf("the edge's command failed after %s: %v", time.Since(asked), o.err)
	}
	// Whichever copy was proposed first, the stream stores one.
	t.Logf("the first raw copy's publisher saw %v", <-first)
	if !o.dup {
		t.Fatalf("the edge's command was stored again after %s, want a duplicate of the copy in process", time.Since(asked))
	}
	s, err := admin.Stream(ctx, events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("the stream holds %d commands, want the one", info.State.Msgs)
	}
	t.Logf("the edge's command ended as a duplicate after %s", time.Since(asked))
}
