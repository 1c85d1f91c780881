package admin

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/nats-io/nats.go"
)

// The audit and usage views read through whichever NATS node the edge is
// connected to; the ordered consumer lives on one node of the cluster,
// and a pull through another that has not yet heard of it met no
// responders (the audit view failed on two of the real node's three NATS
// pods). Every read through every node, with and without wildcards in
// the filter, returns every event.
func TestReadThroughEveryNodeOfACluster(t *testing.T) {
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c := natstest.StartCluster(t, 3, embednats.Options{Users: ids.Users()})
	_, admin := natstest.Connect(t, c.URLs(), natstest.As(t, ids, natsauth.Admin))
	ctx := natstest.Context(t, 5*time.Minute)
	if err := events.EnsureStreams(ctx, admin, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	// A stream just made in a cluster just formed answers once it has
	// elected its leader (CI once published before: no response).
	testutil.Eventually(t, time.Minute, func() error {
		s, err := admin.Stream(ctx, events.StreamAudit)
		if err != nil {
			return err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.Cluster == nil || info.Cluster.Leader == "" {
			return errors.New("the audit stream has no leader yet")
		}
		return nil
	})
	const n = 30
	for i := range n {
		e := events.AuditEvent{V: events.SchemaVersion, Kind: events.AuditLogin, User: "ann", Outcome: "ok", At: time.Now().Add(time.Duration(i))}
		data, _ := json.Marshal(e)
		if _, err := admin.Publish(ctx, e.Subject(), data); err != nil {
			t.Fatal(err)
		}
	}
	for i, node := range c.Nodes {
		_, js := natstest.Connect(t, node.URL(), natstest.As(t, ids, natsauth.Edge), nats.CustomInboxPrefix(natsauth.Edge.InboxPrefix()))
		for range 5 {
			for _, f := range []string{events.AuditFilter(events.AuditLogin, "ann"), events.AuditFilter("", "ann"), events.AuditFilter("", "")} {
				evs, _, err := read(ctx, js, events.StreamAudit, f, time.Now().Add(-time.Hour), time.Now(), MaxAuditRows, func(events.AuditEvent) bool { return true })
				if err != nil || len(evs) != n {
					t.Fatalf("through node %d, %s: %d events, %v", i, f, len(evs), err)
				}
			}
		}
	}
}
