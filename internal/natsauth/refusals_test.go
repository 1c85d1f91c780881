package natsauth_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/embednats/natstest"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natsconn"
	"github.com/aaas-project/aaas/internal/state"
)

// bus is a real NATS server with the production identities, provisioned
// by the setup identity.
type bus struct {
	t   *testing.T
	s   *embednats.Server
	ids *natsauth.Identities
}

func newBus(t *testing.T) *bus {
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	b := &bus{t: t, s: natstest.StartWith(t, embednats.Options{Users: ids.Users()}), ids: ids}
	setup := b.as(natsauth.Setup)
	ctx := natstest.Context(t, time.Minute)
	if err := natsconn.Provision(ctx, setup.js, events.DefaultStreamsConfig(), state.DefaultBucketsConfig(),
		events.CommandConsumerConfig(1, 5, 30*time.Second), slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	return b
}

// client is a connection as one identity that remembers the permission
// violations the server reports to it.
type client struct {
	js jetstream.JetStream
	mu sync.Mutex
	// violations are the server's "Permissions Violation" errors.
	violations []string
}

func (b *bus) as(role natsauth.Role) *client {
	b.t.Helper()
	c := &client{}
	_, js := natstest.Connect(b.t, b.s.URL(), natstest.As(b.t, b.ids, role), nats.CustomInboxPrefix(role.InboxPrefix()),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.violations = append(c.violations, err.Error())
		}))
	c.js = js
	return c
}

// refused runs op and checks that the server refused it as a permission
// violation on a subject matching subject (a regular expression).
func (c *client) refused(t *testing.T, what, subject string, op func(ctx context.Context) error) {
	t.Helper()
	re := regexp.MustCompile(subject)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := op(ctx); err == nil {
		t.Errorf("%s: allowed", what)
		return
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		c.mu.Lock()
		found := false
		for _, v := range c.violations {
			if strings.Contains(strings.ToLower(v), "permissions violation") && re.MatchString(v) {
				found = true
			}
		}
		c.mu.Unlock()
		if found {
			t.Logf("refused: %s (%s)", what, subject)
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s failed, but not as a permission violation on %s: %v", what, subject, c.violations)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *client) allowed(t *testing.T, what string, op func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := op(ctx); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func put(js jetstream.JetStream, bucket, key string) func(context.Context) error {
	return func(ctx context.Context) error {
		b, err := kv.Open[map[string]string](ctx, js, bucket)
		if err != nil {
			return err
		}
		_, err = b.Put(ctx, key, map[string]string{"forged": "yes"})
		return err
	}
}

func publish(js jetstream.JetStream, subject string, v any) func(context.Context) error {
	return func(ctx context.Context) error {
		data, _ := json.Marshal(v)
		_, err := js.Publish(ctx, subject, data)
		return err
	}
}

func TestAnonymousAndUnknownClientsAreRefused(t *testing.T) {
	b := newBus(t)
	if _, err := nats.Connect(b.s.URL(), nats.MaxReconnects(0)); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("anonymous connect: %v", err)
	}
	// A tenant with a key of its own making is nobody to the server.
	other, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	opt, err := nats.NkeyOptionFromSeed(other.SeedFile(natsauth.Edge))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nats.Connect(b.s.URL(), opt, nats.MaxReconnects(0)); err == nil {
		t.Fatal("a key the server does not know was admitted")
	}
}

func TestEachIdentityIsRefusedWhatIsNotItsJob(t *testing.T) {
	b := newBus(t)
	edge := b.as(natsauth.Edge)
	// Its own work is allowed, so the refusals below are not a dead line.
	edge.allowed(t, "edge writes a session", put(edge.js, state.BucketSessions, "ann.x"))
	edge.allowed(t, "edge publishes a wake", publish(edge.js, events.CommandSubject(events.VerbWake, "ann"), events.Command{V: 1, ID: "w1", Verb: events.VerbWake, User: "ann"}))

	for _, bucket := range []string{state.BucketSandboxes, state.BucketUsers, state.BucketHandshakes, state.BucketLocks, state.BucketRequests} {
		// Refused at writing the key, or already at opening the bucket.
		edge.refused(t, "edge writes "+bucket, `\$KV\.`+bucket+`\.ann|KV_`+bucket+`"`, put(edge.js, bucket, "ann"))
	}
	edge.refused(t, "edge consumes commands", regexp.QuoteMeta("$JS.API.CONSUMER.INFO."+events.StreamCommands+"."+events.CommandConsumer), func(ctx context.Context) error {
		_, err := edge.js.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
		return err
	})
	edge.refused(t, "edge creates a consumer on the commands", regexp.QuoteMeta("$JS.API.CONSUMER.CREATE."+events.StreamCommands), func(ctx context.Context) error {
		_, err := edge.js.CreateConsumer(ctx, events.StreamCommands, jetstream.ConsumerConfig{Durable: "thief", AckPolicy: jetstream.AckExplicitPolicy})
		return err
	})
	edge.refused(t, "edge creates a stream", regexp.QuoteMeta("$JS.API.STREAM.CREATE.EVIL"), func(ctx context.Context) error {
		_, err := edge.js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVIL", Subjects: []string{"evil.>"}})
		return err
	})
	edge.refused(t, "edge deletes the audit stream", regexp.QuoteMeta("$JS.API.STREAM.DELETE."+events.StreamAudit), func(ctx context.Context) error {
		return edge.js.DeleteStream(ctx, events.StreamAudit)
	})
	edge.refused(t, "edge reads another identity's replies", regexp.QuoteMeta("_INBOX_lifecycle.>"), func(ctx context.Context) error {
		nc := edge.js.Conn()
		sub, err := nc.SubscribeSync("_INBOX_lifecycle.>")
		if err != nil {
			return err
		}
		defer sub.Unsubscribe()
		_, err = sub.NextMsgWithContext(ctx)
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			return errors.New("subscribed")
		}
		return err
	})

	sweeper := b.as(natsauth.Sweeper)
	sweeper.allowed(t, "sweeper publishes a suspend", publish(sweeper.js, events.CommandSubject(events.VerbSuspend, "ann"), events.Command{V: 1, ID: "s1", Verb: events.VerbSuspend, User: "ann"}))
	for _, v := range []events.Verb{events.VerbDelete, events.VerbRecreate, events.VerbClaim, events.VerbWake, events.VerbHandshake} {
		sweeper.refused(t, "sweeper publishes "+string(v), regexp.QuoteMeta(events.CommandSubject(v, "ann")), publish(sweeper.js, events.CommandSubject(v, "ann"), map[string]string{}))
	}
	sweeper.refused(t, "sweeper writes sandboxes", regexp.QuoteMeta("$KV.sandboxes.ann"), put(sweeper.js, state.BucketSandboxes, "ann"))

	lc := b.as(natsauth.Lifecycle)
	lc.allowed(t, "lifecycle writes sandboxes", put(lc.js, state.BucketSandboxes, "ann"))
	lc.refused(t, "lifecycle publishes a command", regexp.QuoteMeta(events.CommandSubject(events.VerbDelete, "ann")), publish(lc.js, events.CommandSubject(events.VerbDelete, "ann"), map[string]string{}))
	lc.refused(t, "lifecycle changes a stream", regexp.QuoteMeta("$JS.API.STREAM.UPDATE."+events.StreamCommands), func(ctx context.Context) error {
		_, err := lc.js.UpdateStream(ctx, jetstream.StreamConfig{Name: events.StreamCommands, Subjects: []string{"aaas.cmd.>"}, Retention: jetstream.WorkQueuePolicy})
		return err
	})

	setup := b.as(natsauth.Setup)
	setup.refused(t, "setup writes a session", regexp.QuoteMeta("$KV.sessions.ann"), func(ctx context.Context) error {
		_, err := setup.js.Conn().Request("$KV.sessions.ann", []byte("{}"), time.Second)
		return err
	})
}
