package natsauth_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/backup"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
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
	// A dormant account's deletion (DORMANT_DELETE_AFTER).
	sweeper.allowed(t, "sweeper publishes a delete", publish(sweeper.js, events.CommandSubject(events.VerbDelete, "ann"), events.Command{V: 1, ID: "d1", Verb: events.VerbDelete, User: "ann"}))
	for _, v := range []events.Verb{events.VerbRecreate, events.VerbClaim, events.VerbWake, events.VerbHandshake} {
		sweeper.refused(t, "sweeper publishes "+string(v), regexp.QuoteMeta(events.CommandSubject(v, "ann")), publish(sweeper.js, events.CommandSubject(v, "ann"), map[string]string{}))
	}
	sweeper.refused(t, "sweeper writes sandboxes", regexp.QuoteMeta("$KV.sandboxes.ann"), put(sweeper.js, state.BucketSandboxes, "ann"))
	sweeper.refused(t, "sweeper writes a keep-awake", regexp.QuoteMeta("$KV.keepawake.ann"), put(sweeper.js, state.BucketKeepAwake, "ann"))

	lc := b.as(natsauth.Lifecycle)
	lc.allowed(t, "lifecycle writes sandboxes", put(lc.js, state.BucketSandboxes, "ann"))
	// A rollout's canary by SSO group (ROLLOUT_GROUPS) reads them; the
	// edges write them.
	lc.allowed(t, "lifecycle reads a user's groups", get(lc.js, state.BucketUserGroups, "ann"))
	lc.refused(t, "lifecycle writes a user's groups", regexp.QuoteMeta("$KV."+state.BucketUserGroups+".ann"), put(lc.js, state.BucketUserGroups, "ann"))
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

// The sweeper may write no session (security review S4): NATS cannot tell
// a purge from a put on a key's subject, so an identity allowed to prune
// sessions could mint one, sessions/<admin>.<sha256(sid)>, and sign in as
// anyone. Pruning is lifecycle's, which may write and purge them.
func TestTheSweeperCannotWriteASession(t *testing.T) {
	b := newBus(t)
	sum := sha256.Sum256([]byte("a session id the forger picked"))
	key := state.SessionKey("ops", hex.EncodeToString(sum[:]))
	forged := state.Session{User: "ops", Created: time.Now(), Expires: time.Now().Add(time.Hour), Via: "login"}

	lc := b.as(natsauth.Lifecycle)
	lc.allowed(t, "lifecycle writes a session", put(lc.js, state.BucketSessions, key))
	lc.allowed(t, "lifecycle purges it", func(ctx context.Context) error {
		s, err := kv.Open[state.Session](ctx, lc.js, state.BucketSessions)
		if err != nil {
			return err
		}
		return s.Purge(ctx, key)
	})

	sweeper := b.as(natsauth.Sweeper)
	// Through the KV client (refused at opening the bucket already, or at
	// the key), and as a forger would: a bare publish on the key's subject.
	sweeper.refused(t, "sweeper writes a session", `\$KV\.sessions\.|KV_sessions"`, put(sweeper.js, state.BucketSessions, key))
	sweeper.refused(t, "sweeper publishes a session on its key's subject", regexp.QuoteMeta("$KV.sessions."+key), publish(sweeper.js, "$KV.sessions."+key, forged))

	// Nothing of the sweeper's landed: the key holds lifecycle's purge.
	admin := b.as(natsauth.Admin)
	ctx := natstest.Context(t, 10*time.Second)
	sessions, err := kv.Open[state.Session](ctx, admin.js, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	if e, err := sessions.Get(ctx, key); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("the forged session is there: %+v %v", e, err)
	}
}

// Sign-in codes are the edge's alone (subdomain mode): a code whoever
// writes it becomes a sandbox session for its user, so no other identity
// may write one, nor read one (a code waiting to be traded is as good as
// the session it makes).
func TestOnlyTheEdgeTouchesSigninCodes(t *testing.T) {
	b := newBus(t)
	code := state.SigninCode{User: "ann", Host: "ann.sbx.example", Parent: strings.Repeat("ab", 32), Expires: time.Now().Add(time.Minute)}
	key := strings.Repeat("cd", 32)

	edge := b.as(natsauth.Edge)
	edge.allowed(t, "edge mints a code", func(ctx context.Context) error {
		codes, err := kv.Open[state.SigninCode](ctx, edge.js, state.BucketSigninCodes)
		if err != nil {
			return err
		}
		_, err = codes.Create(ctx, key, code)
		return err
	})
	for _, role := range []natsauth.Role{natsauth.Lifecycle, natsauth.Sweeper} {
		c := b.as(role)
		c.refused(t, string(role)+" writes a code", `\$KV\.signin_codes\.|KV_signin_codes"`, put(c.js, state.BucketSigninCodes, strings.Repeat("ef", 32)))
		c.refused(t, string(role)+" publishes a code on its key's subject", regexp.QuoteMeta("$KV.signin_codes."+key), publish(c.js, "$KV.signin_codes."+key, code))
		c.refused(t, string(role)+" reads a code", `KV_signin_codes`, func(ctx context.Context) error {
			codes, err := kv.Open[state.SigninCode](ctx, c.js, state.BucketSigninCodes)
			if err != nil {
				return err
			}
			_, err = codes.Get(ctx, key)
			return err
		})
	}
	setup := b.as(natsauth.Setup)
	setup.refused(t, "setup writes a code", regexp.QuoteMeta("$KV.signin_codes.x"), func(ctx context.Context) error {
		_, err := setup.js.Conn().Request("$KV.signin_codes.x", []byte("{}"), time.Second)
		return err
	})
	edge.allowed(t, "edge takes the code", func(ctx context.Context) error {
		codes, err := kv.Open[state.SigninCode](ctx, edge.js, state.BucketSigninCodes)
		if err != nil {
			return err
		}
		e, err := codes.Get(ctx, key)
		if err != nil {
			return err
		}
		if v := e.Value; v.User != code.User || v.Host != code.Host || v.Parent != code.Parent || !v.Expires.Equal(code.Expires) {
			return errors.New("the code was changed")
		}
		return codes.Delete(ctx, key, e.Revision)
	})
}

func get(js jetstream.JetStream, bucket, key string) func(context.Context) error {
	return func(ctx context.Context) error {
		b, err := kv.Open[map[string]any](ctx, js, bucket)
		if err != nil {
			return err
		}
		if _, err = b.Get(ctx, key); errors.Is(err, kv.ErrNotFound) {
			return nil // read and found nothing: allowed
		}
		return err
	}
}

// The broker (issue 23) attributes calls from sandboxes, applies budgets
// and users' own keys, and meters: it writes what calls spent and the
// calls in flight, publishes their records and their users' activity, and
// nothing else. A broker that a tenant's call subverted can neither
// create, wake or delete a sandbox, forge a session or a budget, read a
// DSH cookie or a session, nor write the audit trail.
func TestTheBrokerIsRefusedWhatIsNotItsJob(t *testing.T) {
	b := newBus(t)
	br := b.as(natsauth.Broker)
	// Its own work is allowed, so the refusals below are not a dead line.
	for _, bucket := range []string{state.BucketUsage, state.BucketModelCalls} {
		br.allowed(t, "broker writes "+bucket, put(br.js, bucket, "ann.x"))
	}
	for _, bucket := range []string{state.BucketSandboxes, state.BucketBudgets, state.BucketUserGroups, state.BucketCredentials} {
		br.allowed(t, "broker reads "+bucket, get(br.js, bucket, "ann"))
	}
	br.allowed(t, "broker publishes a call's usage", publish(br.js, events.UsageSubject("ann"), events.UsageEvent{V: 1, ID: "c1", User: "ann"}))
	br.allowed(t, "broker publishes ann's activity", publish(br.js, events.ActivitySubject("ann", "broker-a"), events.Beacon{V: 1, User: "ann", Edge: "broker-a", InFlight: 1}))

	for _, bucket := range []string{state.BucketSandboxes, state.BucketUsers, state.BucketSessions, state.BucketBudgets, state.BucketCredentials, state.BucketUserGroups, state.BucketSigninCodes, state.BucketLocks, state.BucketQueue} {
		br.refused(t, "broker writes "+bucket, `\$KV\.`+bucket+`\.ann|KV_`+bucket+`"`, put(br.js, bucket, "ann"))
	}
	// A raw publish on a budget's key subject, as a forger would: a
	// broker cannot raise anyone's budget.
	br.refused(t, "broker publishes a budget on its key's subject", regexp.QuoteMeta("$KV.budgets."+state.BudgetKey(state.BudgetUser, "ann")),
		publish(br.js, "$KV.budgets."+state.BudgetKey(state.BudgetUser, "ann"), state.Budget{Scope: state.BudgetUser, Name: "ann", Unlimited: true}))
	for _, bucket := range []string{state.BucketHandshakes, state.BucketSessions, state.BucketSigninCodes, state.BucketUsers, state.BucketRequests} {
		br.refused(t, "broker reads "+bucket, `KV_`+bucket, get(br.js, bucket, "ann"))
	}
	for _, v := range []events.Verb{events.VerbClaim, events.VerbWake, events.VerbSuspend, events.VerbDelete, events.VerbRecreate, events.VerbHandshake} {
		br.refused(t, "broker publishes "+string(v), regexp.QuoteMeta(events.CommandSubject(v, "ann")), publish(br.js, events.CommandSubject(v, "ann"), events.Command{V: 1, ID: "b-" + string(v), Verb: v, User: "ann"}))
	}
	br.refused(t, "broker writes the audit trail", regexp.QuoteMeta("aaas.audit."), publish(br.js, "aaas.audit.admin.ann", events.AuditEvent{V: 1, Kind: events.AuditAdmin, User: "ann"}))
	br.refused(t, "broker reads the usage stream", regexp.QuoteMeta("$JS.API.CONSUMER.CREATE."+events.StreamUsage), func(ctx context.Context) error {
		_, err := br.js.OrderedConsumer(ctx, events.StreamUsage, jetstream.OrderedConsumerConfig{})
		return err
	})
	br.refused(t, "broker consumes commands", regexp.QuoteMeta("$JS.API.CONSUMER.INFO."+events.StreamCommands+"."+events.CommandConsumer), func(ctx context.Context) error {
		_, err := br.js.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
		return err
	})
	br.refused(t, "broker deletes the usage stream", regexp.QuoteMeta("$JS.API.STREAM.DELETE."+events.StreamUsage), func(ctx context.Context) error {
		return br.js.DeleteStream(ctx, events.StreamUsage)
	})
	br.refused(t, "broker reads the edge's replies", regexp.QuoteMeta("_INBOX_edge.>"), subscribe(br.js, "_INBOX_edge.>"))
}

// The edge sets budgets (admin page), stores the keys users bring and the
// SSO groups they sign in with, and shows the month's spend; it cannot
// write a spend (only a broker meters) nor hold a model-call slot.
func TestTheEdgeSetsBudgetsButNeverMeters(t *testing.T) {
	b := newBus(t)
	edge := b.as(natsauth.Edge)
	for _, bucket := range []string{state.BucketBudgets, state.BucketCredentials, state.BucketUserGroups} {
		edge.allowed(t, "edge writes "+bucket, put(edge.js, bucket, "ann"))
	}
	edge.allowed(t, "edge reads usage", get(edge.js, state.BucketUsage, state.UsageKey("ann", "2026-12")))
	for _, bucket := range []string{state.BucketUsage, state.BucketModelCalls} {
		edge.refused(t, "edge writes "+bucket, `\$KV\.`+bucket+`\.ann|KV_`+bucket+`"`, put(edge.js, bucket, "ann"))
	}
	edge.refused(t, "edge publishes a call's usage", regexp.QuoteMeta(events.UsageSubject("ann")), publish(edge.js, events.UsageSubject("ann"), events.UsageEvent{V: 1, ID: "forged", User: "ann"}))
	for _, role := range []natsauth.Role{natsauth.Lifecycle, natsauth.Sweeper} {
		c := b.as(role)
		c.refused(t, string(role)+" writes budgets", `\$KV\.budgets\.|KV_budgets"`, put(c.js, state.BucketBudgets, "user.ann"))
		c.refused(t, string(role)+" reads credentials", `KV_credentials`, get(c.js, state.BucketCredentials, "ann.openai"))
	}
}

// The backup identity copies every stream and bucket through snapshots,
// and can change nothing: no write, no publish, no deletion, no restore,
// no consumer, no one else's replies.
func TestTheBackupIdentityCopiesAndChangesNothing(t *testing.T) {
	b := newBus(t)
	bk := b.as(natsauth.Backup)
	bk.allowed(t, "backup copies every stream and bucket", func(ctx context.Context) error {
		m, err := backup.Backup(ctx, bk.js.Conn(), filepath.Join(t.TempDir(), "b"), backup.Options{Streams: natsauth.Streams(), Inbox: natsauth.Backup.InboxPrefix()})
		if err == nil && len(m.Streams) != len(natsauth.Streams()) {
			err = fmt.Errorf("copied %d streams of %d", len(m.Streams), len(natsauth.Streams()))
		}
		return err
	})
	for _, bucket := range []string{state.BucketUsers, state.BucketSessions, state.BucketUsage} {
		bk.refused(t, "backup writes "+bucket, `\$KV\.`+bucket+`\.ann|KV_`+bucket+`"`, put(bk.js, bucket, "ann"))
	}
	bk.refused(t, "backup reads a session by key", `KV_`+state.BucketSessions, get(bk.js, state.BucketSessions, "ann"))
	bk.refused(t, "backup writes the audit trail", regexp.QuoteMeta("aaas.audit."), publish(bk.js, "aaas.audit.admin.ann", events.AuditEvent{V: 1, Kind: events.AuditAdmin, User: "ann"}))
	bk.refused(t, "backup deletes a stream", regexp.QuoteMeta("$JS.API.STREAM.DELETE."+events.StreamAudit), func(ctx context.Context) error {
		return bk.js.DeleteStream(ctx, events.StreamAudit)
	})
	bk.refused(t, "backup restores a stream", regexp.QuoteMeta("$JS.API.STREAM.RESTORE."+events.StreamAudit), func(ctx context.Context) error {
		_, err := bk.js.Conn().RequestWithContext(ctx, "$JS.API.STREAM.RESTORE."+events.StreamAudit, []byte(`{"config":{"name":"AAAS_AUDIT"}}`))
		return err
	})
	bk.refused(t, "backup takes commands", regexp.QuoteMeta("$JS.API.CONSUMER.INFO."+events.StreamCommands+"."+events.CommandConsumer), func(ctx context.Context) error {
		_, err := bk.js.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
		return err
	})
	bk.refused(t, "backup reads the edge's replies", regexp.QuoteMeta("_INBOX_edge.>"), subscribe(bk.js, "_INBOX_edge.>"))
}

// subscribe is a subscription to subject that counts as made only once the
// server has not refused it within the caller's deadline.
func subscribe(js jetstream.JetStream, subject string) func(context.Context) error {
	return func(ctx context.Context) error {
		sub, err := js.Conn().SubscribeSync(subject)
		if err != nil {
			return err
		}
		defer sub.Unsubscribe()
		_, err = sub.NextMsgWithContext(ctx)
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			return errors.New("subscribed")
		}
		return err
	}
}

// An admin page counts its rows' sessions with one batched direct get
// (kv.Bucket.LastOf) under the edge's own identity, reading its answers
// on the edge's inbox; the broker, which may read no session, is refused
// the same read.
func TestTheEdgeCountsSessionsInOneRead(t *testing.T) {
	b := newBus(t)
	edge := b.as(natsauth.Edge)
	lastOf := func(c *client) func(context.Context) error {
		return func(ctx context.Context) error {
			sessions, err := kv.Open[state.Session](ctx, c.js, state.BucketSessions)
			if err != nil {
				return err
			}
			if _, err := sessions.Put(ctx, "ann."+strings.Repeat("ab", 32), state.Session{User: "ann", Via: "login"}); err != nil && c == edge {
				return err
			}
			got, err := sessions.LastOf(ctx, "ann.*", "bob.*")
			if err == nil && len(got) != 1 {
				return fmt.Errorf("read %d sessions, want ann's one", len(got))
			}
			return err
		}
	}
	edge.allowed(t, "edge reads two users' sessions at once", lastOf(edge))
	broker := b.as(natsauth.Broker)
	broker.refused(t, "broker reads sessions", `KV_sessions`, lastOf(broker))
}
