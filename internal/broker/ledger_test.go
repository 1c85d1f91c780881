package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	tu "github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natsconn"
	"github.com/aaas-project/aaas/internal/state"
)

var quiet = slog.New(slog.DiscardHandler)

// ledgerBus is a real NATS server with the production identities,
// provisioned by setup; ledgers run as the broker identity, so every test
// here also shows the broker's grants (internal/natsauth) suffice.
type ledgerBus struct {
	t     testing.TB
	s     *embednats.Server
	ids   *natsauth.Identities
	admin jetstream.JetStream
}

func newLedgerBus(t testing.TB) *ledgerBus {
	t.Helper()
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	b := &ledgerBus{t: t, s: natstest.StartWith(t, embednats.Options{Users: ids.Users()}), ids: ids}
	_, setup := natstest.Connect(t, b.s.URL(), natstest.As(t, ids, natsauth.Setup), nats.CustomInboxPrefix(natsauth.Setup.InboxPrefix()))
	if err := natsconn.Provision(natstest.Context(t, time.Minute), setup, events.DefaultStreamsConfig(), state.DefaultBucketsConfig(),
		events.CommandConsumerConfig(1, 5, 30*time.Second), quiet); err != nil {
		t.Fatal(err)
	}
	_, b.admin = natstest.Connect(t, b.s.URL(), natstest.As(t, ids, natsauth.Admin))
	return b
}

// ledger starts a ledger as the broker identity; the test fails if the
// server refused it any subject.
func (b *ledgerBus) ledger(instance string, mutate func(*LedgerOptions)) (*NATSLedger, *prometheus.Registry) {
	t := b.t
	t.Helper()
	var mu sync.Mutex
	var violations []string
	_, js := natstest.Connect(t, b.s.URL(), natstest.As(t, b.ids, natsauth.Broker), nats.CustomInboxPrefix(natsauth.Broker.InboxPrefix()),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
				mu.Lock()
				violations = append(violations, err.Error())
				mu.Unlock()
			}
		}))
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		if len(violations) > 0 {
			t.Errorf("the broker identity was refused: %v", violations)
		}
	})
	reg := prometheus.NewRegistry()
	o := LedgerOptions{
		JS: js, MaxConcurrent: 4, CallTimeout: time.Minute, BeaconInterval: time.Hour, BeaconTTL: 2 * time.Hour,
		Instance: instance, Log: quiet, Metrics: reg,
	}
	if mutate != nil {
		mutate(&o)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	l, err := NewLedger(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	return l, reg
}

func bucket[T any](b *ledgerBus, name string) *kv.Bucket[T] {
	b.t.Helper()
	bk, err := kv.Open[T](natstest.Context(b.t, 10*time.Second), b.admin, name)
	if err != nil {
		b.t.Fatal(err)
	}
	return bk
}

func (b *ledgerBus) putBudget(scope, name string, micros int64, unlimited bool) {
	b.t.Helper()
	if _, err := bucket[state.Budget](b, state.BucketBudgets).Put(natstest.Context(b.t, 10*time.Second), state.BudgetKey(scope, name),
		state.Budget{Scope: scope, Name: name, MonthlyMicros: micros, Unlimited: unlimited, SetBy: "ops", At: time.Now()}); err != nil {
		b.t.Fatal(err)
	}
}

func (b *ledgerBus) putGroups(user string, groups ...string) {
	b.t.Helper()
	if _, err := bucket[state.UserGroups](b, state.BucketUserGroups).Put(natstest.Context(b.t, 10*time.Second), user,
		state.UserGroups{User: user, Groups: groups, Seen: time.Now()}); err != nil {
		b.t.Fatal(err)
	}
}

func (b *ledgerBus) putSpent(user string, micros int64) {
	b.t.Helper()
	month := state.Month(time.Now())
	if _, err := bucket[state.Usage](b, state.BucketUsage).Put(natstest.Context(b.t, 10*time.Second), state.UsageKey(user, month),
		state.Usage{User: user, Month: month, CostMicros: micros}); err != nil {
		b.t.Fatal(err)
	}
}

func (b *ledgerBus) usageOf(user string) state.Usage {
	b.t.Helper()
	e, err := bucket[state.Usage](b, state.BucketUsage).Get(natstest.Context(b.t, 10*time.Second), state.UsageKey(user, state.Month(time.Now())))
	if err != nil && !errors.Is(err, kv.ErrNotFound) {
		b.t.Fatal(err)
	}
	return e.Value
}

func liveSlots(slots map[string]time.Time, now time.Time) map[string]time.Time {
	live := state.ModelCalls{Slots: maps.Clone(slots)}
	pruneSlots(&live, now)
	return live.Slots
}

// liveSlotsOf are the user's slots in model_calls that have not lapsed.
func (b *ledgerBus) liveSlotsOf(user string) map[string]time.Time {
	b.t.Helper()
	e, err := bucket[state.ModelCalls](b, state.BucketModelCalls).Get(natstest.Context(b.t, 10*time.Second), user)
	if err != nil && !errors.Is(err, kv.ErrNotFound) {
		b.t.Fatal(err)
	}
	return liveSlots(e.Value.Slots, time.Now())
}

// records are the usage records on AAAS_USAGE, by call id.
func (b *ledgerBus) records() map[string]events.UsageEvent {
	b.t.Helper()
	ctx := natstest.Context(b.t, 10*time.Second)
	s, err := b.admin.Stream(ctx, events.StreamUsage)
	if err != nil {
		b.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		b.t.Fatal(err)
	}
	out := map[string]events.UsageEvent{}
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			b.t.Fatal(err)
		}
		e, err := events.Decode[events.UsageEvent](m.Data)
		if err != nil {
			b.t.Fatal(err)
		}
		if _, dup := out[e.ID]; dup || m.Header.Get(jetstream.MsgIDHeader) != e.ID || m.Subject != events.UsageSubject(e.User) {
			b.t.Fatalf("record %d: %s %+v (Nats-Msg-Id %q, stored before: %t)", seq, m.Subject, e, m.Header.Get(jetstream.MsgIDHeader), dup)
		}
		out[e.ID] = e
	}
	return out
}

func admit(t *testing.T, l *NATSLedger, user string, charged bool) Call {
	t.Helper()
	c, err := l.Admit(natstest.Context(t, 10*time.Second), user, charged)
	if err != nil {
		t.Fatalf("%s (charged %t) refused: %v", user, charged, err)
	}
	return c
}

// refused checks that Admit refused with status and reason.
func refused(t *testing.T, l *NATSLedger, user string, charged bool, status int, reason string) *Refusal {
	t.Helper()
	c, err := l.Admit(natstest.Context(t, 10*time.Second), user, charged)
	var r *Refusal
	if !errors.As(err, &r) || r.Status != status || r.Reason != reason {
		if c != nil {
			c.End(events.UsageEvent{})
		}
		t.Fatalf("%s (charged %t): %v (%T), want %d %s", user, charged, err, err, status, reason)
	}
	return r
}

func flush(t *testing.T, l *NATSLedger) {
	t.Helper()
	if err := l.Flush(natstest.Context(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
}

func TestRefusalsSayWhatAndUntilWhen(t *testing.T) {
	at := time.Date(2026, time.December, 2, 3, 0, 0, 0, time.UTC)
	r := overBudget(20_000_000, 20_004_999, at)
	if r.Status != 429 || r.Reason != "budget" || r.Message != "your model budget of $20.00 for December 2026 is spent ($20.00 used); it renews on 1 January 2027" ||
		r.RetryAfter != 29*24*time.Hour+21*time.Hour {
		t.Fatalf("%+v", r)
	}
}

// A user's budget is their own override, else the largest of their SSO
// groups', else the default; a call with the user's own key is not held
// to it. Budgets follow the bucket as administrators change them.
func TestBudgetIsTheUsersThenTheLargestGroupsThenTheDefault(t *testing.T) {
	b := newLedgerBus(t)
	const usd = 1_000_000
	b.putBudget(state.BudgetGroup, "eng", 5*usd, false)
	b.putBudget(state.BudgetGroup, "ops", 50*usd, false)
	b.putBudget(state.BudgetGroup, "research@example.org", 0, true)
	b.putBudget(state.BudgetUser, "cat", 1*usd, false)
	b.putBudget(state.BudgetUser, "eve", 0, false)
	b.putBudget(state.BudgetUser, "fay", 0, true)
	b.putGroups("bob", "eng", "ops")
	b.putGroups("cat", "ops")
	b.putGroups("dan", "eng", "research@example.org")
	b.putGroups("hal", "eng")
	for _, u := range []string{"ann", "bob", "cat", "dan", "eve", "fay", "hal"} {
		b.putSpent(u, 20*usd)
	}
	b.putSpent("gus", 10*usd-1)
	l, _ := b.ledger("broker-a", func(o *LedgerOptions) { o.Budget = config.Budget{DefaultMicros: 10 * usd} })

	for _, tc := range []struct {
		user    string
		charged bool
		refused bool
	}{
		{"ann", true, true},   // default $10, spent $20
		{"ann", false, false}, // her own key: not held to it
		{"bob", true, false},  // groups $5 and $50: $50
		{"cat", true, true},   // her own $1 over her group's $50
		{"dan", true, false},  // an unlimited group
		{"eve", true, true},   // a budget of nothing
		{"fay", true, false},  // her own: unlimited
		{"gus", true, false},  // a micro-dollar under the default
		{"hal", true, true},   // his group's $5, under the default
	} {
		if tc.refused {
			r := refused(t, l, tc.user, tc.charged, 429, "budget")
			if !strings.Contains(r.Message, "is spent ($20.00 used); it renews on") {
				t.Errorf("%s: %q", tc.user, r.Message)
			}
			if len(b.liveSlotsOf(tc.user)) != 0 {
				t.Errorf("%s was refused but holds a slot", tc.user)
			}
			continue
		}
		admit(t, l, tc.user, tc.charged)
	}
	now := time.Now().UTC()
	r := refused(t, l, "ann", true, 429, "budget")
	if want := fmt.Sprintf("your model budget of $10.00 for %s is spent ($20.00 used); it renews on 1 %s",
		now.Format("January 2006"), time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC).Format("January 2006")); r.Message != want {
		t.Fatalf("message %q, want %q", r.Message, want)
	}

	// An administrator raises ann's budget: the broker follows.
	b.putBudget(state.BudgetUser, "ann", 30*usd, false)
	tu.Eventually(t, 10*time.Second, func() error {
		c, err := l.Admit(natstest.Context(t, 10*time.Second), "ann", true)
		if err != nil {
			return err
		}
		c.End(events.UsageEvent{})
		return nil
	})

	// Names that are no account (they would be other keys and subjects)
	// are refused and write nothing.
	for _, hostile := range []string{"", "ann.2026-12", "*", ">", "ann bob", "ANN"} {
		refused(t, l, hostile, true, 403, "unattributed")
	}
	keys, err := bucket[state.ModelCalls](b, state.BucketModelCalls).Keys(natstest.Context(t, 10*time.Second), ">")
	if err != nil {
		t.Fatal(err)
	}
	admitted := map[string]bool{"ann": true, "bob": true, "dan": true, "fay": true, "gus": true}
	for _, k := range keys {
		if !admitted[k] {
			t.Errorf("model_calls holds %q", k)
		}
	}
}

// End adds the call to the month's total (with the user's own key into
// the BYOK fields, never the budget's), publishes its record once with the
// call's id as Nats-Msg-Id, and frees its slot. What End is handed cannot
// move the call to another user or id.
func TestEndRecordsTheCallOnceToTheAdmittedUser(t *testing.T) {
	b := newLedgerBus(t)
	l, reg := b.ledger("broker-a", nil)
	paid := admit(t, l, "ann", true)
	own := admit(t, l, "ann", false)
	if paid.ID() == own.ID() || len(paid.ID()) < 20 {
		t.Fatalf("call ids %q and %q", paid.ID(), own.ID())
	}
	if n := len(b.liveSlotsOf("ann")); n != 2 {
		t.Fatalf("%d slots while two calls are in flight", n)
	}
	u := events.UsageEvent{ID: "forged", User: "bob", Broker: "elsewhere", Provider: "deepseek", Model: "deepseek-chat", Status: 200,
		InputTokens: 100, OutputTokens: 50, CachedTokens: 20, CostMicros: 70, BYOK: true}
	paid.End(u)
	paid.End(u) // once only
	own.End(events.UsageEvent{Provider: "deepseek", Model: "deepseek-chat", Status: 200, InputTokens: 40, OutputTokens: 8, CostMicros: 500, Estimated: true})
	flush(t, l)

	got := b.usageOf("ann")
	if got.User != "ann" || got.Calls != 2 || got.Estimated != 1 || got.InputTokens != 140 || got.OutputTokens != 58 || got.CachedTokens != 20 ||
		got.CostMicros != 70 || got.BYOKCalls != 1 || got.BYOKCostMicros != 500 || got.Month != state.Month(time.Now()) {
		t.Fatalf("ann's month: %+v", got)
	}
	if bob := b.usageOf("bob"); bob.Calls != 0 {
		t.Fatalf("bob was charged: %+v", bob)
	}
	recs := b.records()
	p, o := recs[paid.ID()], recs[own.ID()]
	if len(recs) != 2 || p.User != "ann" || p.Broker != "broker-a" || p.BYOK || p.CostMicros != 70 || p.Duration <= 0 || p.At.IsZero() ||
		o.User != "ann" || !o.BYOK || !o.Estimated {
		t.Fatalf("records: %+v", recs)
	}
	if n := len(b.liveSlotsOf("ann")); n != 0 {
		t.Fatalf("%d slots after both calls ended", n)
	}
	if n, err := promtest.GatherAndCount(reg); err != nil || n == 0 {
		t.Fatal(n, err)
	}
	if mfs, _ := reg.Gather(); strings.Contains(fmt.Sprint(mfs), "ann") {
		t.Fatal("a metric names the user")
	}
}

// A record retried after its update was applied (the acknowledgement was
// lost) is not counted twice, and the ids kept for that stay bounded.
func TestARetriedTotalIsAddedOnce(t *testing.T) {
	b := newLedgerBus(t)
	l, _ := b.ledger("broker-a", nil)
	ctx := natstest.Context(t, time.Minute)
	e := events.UsageEvent{ID: "call-1", User: "ann", Status: 200, InputTokens: 10, OutputTokens: 5, CacheWriteTokens: 3, CostMicros: 7, At: time.Now()}
	for range 3 {
		if err := l.addToTotal(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	if got := b.usageOf("ann"); got.Calls != 1 || got.InputTokens != 10 || got.CacheWriteTokens != 3 || got.CostMicros != 7 {
		t.Fatalf("one call added three times: %+v", got)
	}
	for i := range state.UsageRecentCalls + 10 {
		if err := l.addToTotal(ctx, events.UsageEvent{ID: fmt.Sprintf("other-%d", i), User: "ann", CostMicros: 1, At: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	got := b.usageOf("ann")
	if got.Calls != 1+state.UsageRecentCalls+10 || got.CostMicros != 7+state.UsageRecentCalls+10 || len(got.Recent) != state.UsageRecentCalls ||
		got.Recent[len(got.Recent)-1] != fmt.Sprintf("other-%d", state.UsageRecentCalls+9) {
		t.Fatalf("after %d more calls: %d calls, %d µ$, %d ids kept", state.UsageRecentCalls+10, got.Calls, got.CostMicros, len(got.Recent))
	}
}

// The overshoot bound: calls admitted while the spend is under the budget
// may all finish over it, but at most MaxConcurrent are in flight, so the
// spend ends at most MaxConcurrent × the largest call over the budget; the
// next call is refused.
func TestOvershootIsAtMostTheConcurrentCallsCost(t *testing.T) {
	b := newLedgerBus(t)
	const budget, concurrent, cost = 1_000_000, 3, 600_000
	b.putBudget(state.BudgetUser, "ann", budget, false)
	l, _ := b.ledger("broker-a", func(o *LedgerOptions) { o.MaxConcurrent = concurrent })
	var calls []Call
	for range concurrent {
		calls = append(calls, admit(t, l, "ann", true)) // spent 0 < budget each time
	}
	refused(t, l, "ann", true, 429, "concurrency")
	for _, c := range calls {
		c.End(events.UsageEvent{Provider: "deepseek", Model: "deepseek-chat", Status: 200, CostMicros: cost})
	}
	flush(t, l)
	spent := b.usageOf("ann").CostMicros
	if spent != concurrent*cost || spent > budget+concurrent*cost {
		t.Fatalf("spent %d, want %d×%d = %d (bound %d)", spent, concurrent, cost, concurrent*cost, budget+concurrent*cost)
	}
	refused(t, l, "ann", true, 429, "budget")
	admit(t, l, "ann", false).End(events.UsageEvent{CostMicros: cost}) // her own key is not held to it
	flush(t, l)
	if got := b.usageOf("ann").CostMicros; got != spent {
		t.Fatalf("a call with her own key moved the budget's spend to %d", got)
	}
}

// The cap is per user across brokers: slots live in NATS, taken with
// compare-and-set.
func TestConcurrencyCapSpansBrokers(t *testing.T) {
	b := newLedgerBus(t)
	one, _ := b.ledger("broker-a", func(o *LedgerOptions) { o.MaxConcurrent = 2 })
	two, _ := b.ledger("broker-b", func(o *LedgerOptions) { o.MaxConcurrent = 2 })
	first := admit(t, one, "ann", true)
	admit(t, two, "ann", true)
	r := refused(t, one, "ann", true, 429, "concurrency")
	refused(t, two, "ann", false, 429, "concurrency")
	if !strings.Contains(r.Message, "at most 2") || r.RetryAfter <= 0 {
		t.Fatalf("%+v", r)
	}
	admit(t, two, "bob", true).End(events.UsageEvent{}) // another user is not held to ann's cap
	first.End(events.UsageEvent{})
	flush(t, one)
	admit(t, two, "ann", true)
	if n := len(b.liveSlotsOf("ann")); n != 2 {
		t.Fatalf("%d live slots, want 2", n)
	}
}

// A broker killed mid-call never frees its slot: the slot lapses after
// CallTimeout and the user may call again, not before.
func TestASlotNeverFreedLapsesAfterTheCallTimeout(t *testing.T) {
	b := newLedgerBus(t)
	const timeout = 2 * time.Second
	l, _ := b.ledger("broker-a", func(o *LedgerOptions) { o.MaxConcurrent, o.CallTimeout = 1, timeout })
	taken := time.Now()
	admit(t, l, "ann", true) // never ended
	refused(t, l, "ann", true, 429, "concurrency")
	tu.Eventually(t, 10*timeout, func() error {
		_, err := l.Admit(natstest.Context(t, 10*time.Second), "ann", true)
		return err
	})
	if since := time.Since(taken); since < timeout {
		t.Fatalf("admitted again %s after the slot was taken, before it lapsed (%s)", since, timeout)
	}
}

// beaconLog follows the activity stream from now on, as the sweeper reads
// it.
type beaconLog struct {
	mu  sync.Mutex
	got []events.Beacon
}

func followBeacons(t *testing.T, js jetstream.JetStream) *beaconLog {
	t.Helper()
	ctx := natstest.Context(t, 2*time.Minute)
	cons, err := js.OrderedConsumer(ctx, events.StreamActivity, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{events.ActivitySubjectsAll}, DeliverPolicy: jetstream.DeliverNewPolicy,
	})
	if err != nil {
		t.Fatal(err)
	}
	bl := &beaconLog{}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		bc, err := events.Decode[events.Beacon](m.Data())
		if err != nil || m.Subject() != bc.Subject() {
			t.Errorf("beacon on %s: %+v %v", m.Subject(), bc, err)
			return
		}
		bl.mu.Lock()
		bl.got = append(bl.got, bc)
		bl.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
	return bl
}

// of are the beacons for user from broker.
func (bl *beaconLog) of(user, broker string) []events.Beacon {
	bl.mu.Lock()
	defer bl.mu.Unlock()
	var out []events.Beacon
	for _, b := range bl.got {
		if b.User == user && b.Edge == broker {
			out = append(out, b)
		}
	}
	return out
}

// While a user's model call is in flight the broker publishes their
// activity as an edge does: a beacon at the start, one every interval, a
// last one with nothing in flight at the end, and then no more.
func TestBeaconsWhileACallIsInFlight(t *testing.T) {
	b := newLedgerBus(t)
	bl := followBeacons(t, b.admin)
	const interval = 200 * time.Millisecond
	l, _ := b.ledger("broker-a", func(o *LedgerOptions) { o.BeaconInterval, o.BeaconTTL = interval, time.Minute })

	started := time.Now()
	c := admit(t, l, "ann", true)
	tu.Eventually(t, 20*time.Second, func() error {
		got := bl.of("ann", "broker-a")
		if len(got) < 4 {
			return fmt.Errorf("%d beacons so far", len(got))
		}
		for _, bc := range got {
			if bc.InFlight != 1 || bc.TTL != time.Minute || bc.LastActive.Before(started.Add(-time.Second)) {
				return fmt.Errorf("beacon during the call: %+v", bc)
			}
		}
		return nil
	})
	c.End(events.UsageEvent{Status: 200})
	var ended int
	tu.Eventually(t, 10*time.Second, func() error {
		got := bl.of("ann", "broker-a")
		if last := got[len(got)-1]; last.InFlight != 0 || !last.LastActive.After(got[0].LastActive) {
			return fmt.Errorf("last beacon %+v", last)
		}
		ended = len(got)
		return nil
	})
	// The stream's last word for ann from this broker, the sweeper's view:
	// nothing in flight.
	ctx := natstest.Context(t, 10*time.Second)
	st, err := b.admin.Stream(ctx, events.StreamActivity)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx, events.ActivitySubject("ann", "broker-a"))
	if err != nil {
		t.Fatal(err)
	}
	if last, err := events.Decode[events.Beacon](m.Data); err != nil || last.InFlight != 0 {
		t.Fatalf("last beacon in the stream %+v %v", last, err)
	}
	// No more for ann, while the heartbeats go on for bob's call: after
	// three of his, ann still has none.
	k := admit(t, l, "bob", true)
	tu.Eventually(t, 20*time.Second, func() error {
		if n := len(bl.of("bob", "broker-a")); n < 4 {
			return fmt.Errorf("%d of bob's beacons", n)
		}
		return nil
	})
	if n := len(bl.of("ann", "broker-a")); n != ended {
		t.Fatalf("%d beacons for ann after her last call ended, %d then", n, ended)
	}
	k.End(events.UsageEvent{})

	// The first and the last beacon do not wait for a heartbeat: with an
	// hour between heartbeats, a call still shows at once, and its end.
	slow, _ := b.ledger("broker-b", nil)
	c = admit(t, slow, "cat", true)
	tu.Eventually(t, 10*time.Second, func() error {
		if got := bl.of("cat", "broker-b"); len(got) != 1 || got[0].InFlight != 1 {
			return fmt.Errorf("cat's beacons: %+v", got)
		}
		return nil
	})
	c.End(events.UsageEvent{})
	tu.Eventually(t, 10*time.Second, func() error {
		if got := bl.of("cat", "broker-b"); len(got) != 2 || got[1].InFlight != 0 {
			return fmt.Errorf("cat's beacons: %+v", got)
		}
		return nil
	})
}

// With NATS unreachable a user with a budget is refused (it cannot be
// checked), a user without one, or a call with the user's own key, is
// admitted (this broker still capping the user's calls), and the records
// of the calls that end wait in a bounded queue, oldest dropped, until
// NATS is back, when they are written once each.
func TestNATSUnreachableFailsBudgetsClosedAndHoldsRecords(t *testing.T) {
	b := newLedgerBus(t)
	b.putBudget(state.BudgetUser, "bob", 5_000_000, false)
	l, _ := b.ledger("broker-a", func(o *LedgerOptions) { o.MaxConcurrent, o.MaxHeld = 2, 2 })

	// Positive control: with NATS there, bob's budget is checked and his
	// call recorded.
	before := admit(t, l, "bob", true)
	if len(b.liveSlotsOf("bob")) != 1 {
		t.Fatal("bob's call holds no slot")
	}
	before.End(events.UsageEvent{Status: 200, CostMicros: 10})
	flush(t, l)
	if got := b.usageOf("bob"); got.Calls != 1 || got.CostMicros != 10 {
		t.Fatalf("bob before the outage: %+v", got)
	}

	b.s.Stop()
	tu.Eventually(t, 10*time.Second, func() error {
		if l.nc.IsConnected() {
			return errors.New("the broker has not noticed yet")
		}
		return nil
	})
	r := refused(t, l, "bob", true, 503, "unavailable")
	if !strings.Contains(r.Message, "cannot be checked") {
		t.Fatalf("%+v", r)
	}
	bobOwn := admit(t, l, "bob", false)
	ann1 := admit(t, l, "ann", true)
	ann2 := admit(t, l, "ann", true)
	refused(t, l, "ann", true, 429, "concurrency") // this broker's cap holds
	// A record is held once its write has failed, a moment after End: the
	// third is seen by the drop it makes, as the held count stays 2.
	for i, c := range []Call{ann1, ann2, bobOwn} {
		c.End(events.UsageEvent{Status: 200, CostMicros: 7})
		tu.Eventually(t, 10*time.Second, func() error {
			if n, d := l.heldCount(), promtest.ToFloat64(l.m.dropped); n != min(i+1, 2) || d != float64(max(i-1, 0)) {
				return fmt.Errorf("%d held, %v dropped", n, d)
			}
			return nil
		})
	}
	if d := promtest.ToFloat64(l.m.dropped); d != 1 {
		t.Fatalf("%v records dropped, want ann's first", d)
	}
	if err := l.Flush(natstest.Context(t, 5*time.Second)); err == nil {
		t.Fatal("flushed with NATS stopped")
	}
	across := admit(t, l, "ann", true) // in flight across NATS's return

	back, err := b.s.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Stop)
	tu.Eventually(t, time.Minute, func() error {
		if n := l.heldCount(); n != 0 {
			return fmt.Errorf("%d records still held", n)
		}
		return nil
	})
	recs := b.records()
	if _, ok := recs[ann1.ID()]; ok || len(recs) != 3 {
		t.Fatalf("records %+v: want bob's first, ann's second and bob's own-key call, not ann's dropped first", recs)
	}
	if got := b.usageOf("ann"); got.Calls != 1 || got.CostMicros != 7 {
		t.Fatalf("ann after the outage: %+v", got)
	}
	if got := b.usageOf("bob"); got.Calls != 2 || got.CostMicros != 10 || got.BYOKCalls != 1 || got.BYOKCostMicros != 7 {
		t.Fatalf("bob after the outage: %+v", got)
	}
	across.End(events.UsageEvent{Status: 200, CostMicros: 3})
	flush(t, l)
	if got := b.usageOf("ann"); got.Calls != 2 || got.CostMicros != 10 {
		t.Fatalf("ann's call across the outage: %+v", got)
	}
	// NATS back: bob's budget is checked again, and his call holds a slot.
	admit(t, l, "bob", true)
	if len(b.liveSlotsOf("bob")) != 1 {
		t.Fatal("bob's call after the outage holds no slot")
	}
	if n := promtest.ToFloat64(l.m.unslotted); n != 4 {
		t.Fatalf("%v calls admitted without a slot, want 4", n)
	}
	if n := promtest.ToFloat64(l.m.held); n != 0 {
		t.Fatalf("aaas_broker_usage_held %v", n)
	}
}

// The bound holds however calls interleave: brokers admitting and ending
// calls as fast as they can never let the spend pass budget +
// MaxConcurrent × a call. Each round sets the budget just above the spend
// and races workers on two brokers across it. (Read only before taking
// the slot, the spend may lack a call that ended in between, one call
// more than the bound; these rounds find that.)
func TestOvershootBoundHoldsUnderRacingBrokers(t *testing.T) {
	b := newLedgerBus(t)
	const concurrent, cost, workers, rounds = 2, 1000, 6, 15
	var ledgers []*NATSLedger
	for _, id := range []string{"broker-a", "broker-b"} {
		l, _ := b.ledger(id, func(o *LedgerOptions) { o.MaxConcurrent = concurrent })
		ledgers = append(ledgers, l)
	}
	ctx := natstest.Context(t, 5*time.Minute)
	for round := range rounds {
		spent := b.usageOf("ann").CostMicros
		budget := spent + 1
		b.putBudget(state.BudgetUser, "ann", budget, false)
		for _, l := range ledgers {
			tu.Eventually(t, 10*time.Second, func() error {
				if m, _ := l.budgetOf(ctx, "ann"); m != budget {
					return fmt.Errorf("%s sees a budget of %d", l.o.Instance, m)
				}
				return nil
			})
		}
		var wg sync.WaitGroup
		for w := range workers {
			l := ledgers[w%len(ledgers)]
			wg.Go(func() {
				// Each worker calls until the budget refuses it.
				for ctx.Err() == nil {
					c, err := l.Admit(ctx, "ann", true)
					var r *Refusal
					switch {
					case errors.As(err, &r) && r.Reason == "budget":
						return
					case err != nil:
						continue // concurrency: try again
					}
					c.End(events.UsageEvent{Status: 200, CostMicros: cost})
					if err := l.Flush(ctx); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		after := b.usageOf("ann").CostMicros
		if after > budget+concurrent*cost {
			t.Fatalf("round %d: spent %d with a budget of %d: over the bound %d (%d calls this round)", round, after, budget, budget+concurrent*cost, (after-spent)/cost)
		}
	}
}

// BenchmarkAdmit is what the ledger adds before a call is forwarded (its
// part of the time to first token), on one local NATS server: a user
// without a budget (a slot taken), and one with (the spend read before
// and after taking it). Each call is ended and its record written outside
// the timing.
func BenchmarkAdmit(b *testing.B) {
	bus := newLedgerBus(b)
	bus.putBudget(state.BudgetUser, "bob", 1<<60, false)
	l, _ := bus.ledger("broker-a", func(o *LedgerOptions) { o.MaxConcurrent = 1000 })
	ctx := natstest.Context(b, 10*time.Minute)
	for _, user := range []string{"ann", "bob"} {
		b.Run(map[string]string{"ann": "no budget", "bob": "budget"}[user], func(b *testing.B) {
			for b.Loop() {
				c, err := l.Admit(ctx, user, true)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				c.End(events.UsageEvent{Status: 200, CostMicros: 1})
				if err := l.Flush(ctx); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}

// A named sandbox's call (key ann--work) is its owner's to pay: the slot,
// the month's total and the record are ann's; its beacons are the
// sandbox's own, so they keep ann--work awake and not ann's first
// sandbox. A key that is no account's sandbox is refused.
func TestANamedSandboxsCallIsItsOwnersToPay(t *testing.T) {
	b := newLedgerBus(t)
	bl := followBeacons(t, b.admin)
	l, _ := b.ledger("broker-a", nil)
	c := admit(t, l, "ann--work", true)
	if n := len(b.liveSlotsOf("ann")); n != 1 {
		t.Fatalf("ann holds %d slots during her sandbox's call", n)
	}
	tu.Eventually(t, 10*time.Second, func() error {
		if got := bl.of("ann--work", "broker-a"); len(got) != 1 || got[0].InFlight != 1 {
			return fmt.Errorf("ann--work's beacons: %+v", got)
		}
		return nil
	})
	c.End(events.UsageEvent{Provider: "deepseek", Model: "deepseek-chat", Status: 200, CostMicros: 70})
	flush(t, l)
	if got := b.usageOf("ann"); got.Calls != 1 || got.CostMicros != 70 {
		t.Fatalf("ann's month: %+v", got)
	}
	if r := b.records()[c.ID()]; r.User != "ann" {
		t.Fatalf("the record names %q", r.User)
	}
	if got := bl.of("ann", "broker-a"); len(got) != 0 {
		t.Fatalf("beacons for ann's first sandbox: %+v", got)
	}
	for _, key := range []string{"ann--", "ann--Work", "x--work", "ann.work"} {
		if _, err := l.Admit(natstest.Context(t, 10*time.Second), key, true); err == nil {
			t.Errorf("a call of %q was admitted", key)
		}
	}
}
