package broker

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
)

// The ledger is the broker's account of model calls, kept in NATS so that
// any number of brokers share it: before a call it takes one of the
// user's slots in model_calls (compare-and-set, so brokers racing for the
// last slot cannot both win; a broker's own changes to one user's keys
// are batched into one write, batch.go) and checks the user's budget
// against the month's spend; after it, it adds the call to the month's
// total, publishes its record on AAAS_USAGE and only then frees the slot. That
// order is what bounds the overshoot: a call whose cost is not yet in the
// total still holds a slot, and the spend is read holding one, so at most
// MaxConcurrent calls' costs are ever missing from the spend a budget
// check reads, and the spend ends at most MaxConcurrent × the largest
// call over the budget. While a user has calls in flight it publishes
// their activity beacons, as an edge does for requests.
//
// NATS unreachable: a call charged to a budget is refused (503), as the
// budget cannot be checked; any other is admitted without a slot (this
// broker still caps the user at MaxConcurrent of its own calls), and the
// records of ended calls wait in memory, a bounded queue that drops its
// oldest when full, until NATS answers again.

// LedgerOptions configure NewLedger.
type LedgerOptions struct {
	// JS is the broker's JetStream handle, under its own NATS identity.
	JS jetstream.JetStream
	// Budget is BROKER_BUDGET_DEFAULT, for users without an override.
	Budget config.Budget
	// MaxConcurrent is BROKER_MAX_CONCURRENT_CALLS, per user, all brokers.
	MaxConcurrent int
	// CallTimeout is BROKER_CALL_TIMEOUT: a slot lapses this long after
	// it was taken, even if its broker never frees it (killed mid-call).
	CallTimeout time.Duration
	// BeaconInterval and BeaconTTL are the activity beacons' heartbeat and
	// trust (BEACON_INTERVAL, BEACON_TTL).
	BeaconInterval, BeaconTTL time.Duration
	// Instance is INSTANCE_ID: the beacons' Edge and the records' Broker.
	Instance string
	Log      *slog.Logger
	Metrics  prometheus.Registerer
	// MaxHeld bounds the records held while NATS is unreachable (0:
	// maxHeld).
	MaxHeld int
}

// maxHeld is how many ended calls' records a broker holds while NATS is
// unreachable: a few hundred bytes each, so a few MiB at most.
const maxHeld = 10_000

// retryHeld is how often held records are tried again.
const retryHeld = time.Second

// recordAttempt bounds one attempt at recording an ended call before its
// record is held for later.
const recordAttempt = 10 * time.Second

// NATSLedger is the Ledger on NATS JetStream.
type NATSLedger struct {
	o     LedgerOptions
	ctx   context.Context
	nc    *nats.Conn
	pub   *events.Publisher
	usage *kv.Bucket[state.Usage]
	// totals and slots write the usage and model_calls buckets, a
	// batch of a user's changes at a time.
	totals  *batcher[state.Usage]
	slots   *batcher[state.ModelCalls]
	budgets *kv.Cache[state.Budget]
	groups  *kv.Cache[state.UserGroups]
	m       *ledgerMetrics

	mu     sync.Mutex
	active map[string]*activity
	kick   chan struct{}

	heldMu  sync.Mutex
	held    []*record
	drainMu sync.Mutex
	// recording counts the records being written in the background;
	// idle is closed (and replaced) whenever it drops to 0.
	recMu     sync.Mutex
	recording int
	idle      chan struct{}
}

// activity is one sandbox's calls in flight on this broker, for beacons and
// for the cap while NATS is unreachable. gen counts changes; sent is the
// last change a beacon carried.
type activity struct {
	inFlight  int
	last      time.Time
	gen, sent uint64
}

// NewLedger opens the buckets and starts watching budgets and user_groups.
// Budgets and groups are read from those watches (kv.Cache), not from the
// bucket at each call: they change when an administrator acts, and a
// broker cut off from NATS must still know which users have a budget, to
// refuse their calls rather than let them run unchecked. The month's spend
// and the slots, which every call changes, are read fresh. It returns once
// both watches have loaded, or with ctx's error; the ledger works until
// ctx ends.
func NewLedger(ctx context.Context, o LedgerOptions) (*NATSLedger, error) {
	switch {
	case o.JS == nil || o.Log == nil || o.Metrics == nil || o.Instance == "":
		return nil, errors.New("ledger: JS, Log, Metrics and Instance are required")
	case o.MaxConcurrent < 1 || o.CallTimeout <= 0 || o.BeaconInterval <= 0 || o.BeaconTTL <= 0:
		return nil, fmt.Errorf("ledger: MaxConcurrent %d, CallTimeout %s, BeaconInterval %s, BeaconTTL %s must be positive", o.MaxConcurrent, o.CallTimeout, o.BeaconInterval, o.BeaconTTL)
	}
	if o.MaxHeld <= 0 {
		o.MaxHeld = maxHeld
	}
	l := &NATSLedger{
		o: o, ctx: ctx, nc: o.JS.Conn(), pub: events.NewPublisher(o.JS, o.Instance, o.Log),
		m: newLedgerMetrics(o.Metrics), active: map[string]*activity{}, kick: make(chan struct{}, 1),
		idle: make(chan struct{}),
	}
	var err error
	if l.usage, err = kv.Open[state.Usage](ctx, o.JS, state.BucketUsage); err != nil {
		return nil, err
	}
	calls, err := kv.Open[state.ModelCalls](ctx, o.JS, state.BucketModelCalls)
	if err != nil {
		return nil, err
	}
	l.totals = newBatcher(ctx, l.usage, recordAttempt)
	// The server drops a user's slots record once its newest slot has
	// lapsed (its floor for a key's TTL is a second).
	l.slots = newBatcher(ctx, calls, recordAttempt, kv.WithTTL(max(o.CallTimeout, time.Second)))
	budgets, err := kv.Open[state.Budget](ctx, o.JS, state.BucketBudgets)
	if err != nil {
		return nil, err
	}
	groups, err := kv.Open[state.UserGroups](ctx, o.JS, state.BucketUserGroups)
	if err != nil {
		return nil, err
	}
	if l.budgets, err = kv.NewCache(ctx, budgets, ">", o.Log); err != nil {
		return nil, err
	}
	if l.groups, err = kv.NewCache(ctx, groups, ">", o.Log); err != nil {
		return nil, err
	}
	for _, synced := range []<-chan struct{}{l.budgets.Synced(), l.groups.Synced()} {
		select {
		case <-synced:
		case <-ctx.Done():
			return nil, fmt.Errorf("ledger: budgets not loaded: %w", ctx.Err())
		}
	}
	go l.beat(ctx)
	go l.retry(ctx)
	return l, nil
}

// Admit decides whether the call of the sandbox of key (ident.SandboxKey)
// may go ahead (charged: against its owner's budget at the organisation's
// expense; false for the owner's own key) and takes its slot in the
// owner's. Every error it returns is a *Refusal.
func (l *NATSLedger) Admit(ctx context.Context, key string, charged bool) (Call, error) {
	// The key comes from attribution, not from the call; still, it and
	// its owner become KV keys and subjects, so nothing else is let
	// through.
	user := ident.OwnerOf(key)
	if err := ident.ValidateUser(user); err != nil {
		return nil, &Refusal{Status: http.StatusForbidden, Reason: "unattributed", Message: "this address is not a running sandbox"}
	}
	now := time.Now()
	limit, limited := l.budgetOf(ctx, user)
	limited = limited && charged
	if !l.nc.IsConnected() {
		return l.cutOff(key, charged, limited, now)
	}
	// First without a slot, so that a user over budget costs no write.
	if limited {
		if r := l.checkBudget(ctx, user, limit, now); r != nil {
			return nil, r
		}
	}
	id := rand.Text()
	if err := l.takeSlot(ctx, user, id); err != nil {
		var r *Refusal
		switch {
		case errors.As(err, &r):
			return nil, r
		case ctx.Err() != nil:
			return nil, gone()
		}
		l.o.Log.Warn("model call slot not taken", "user", user, "err", err)
		return l.cutOff(key, charged, limited, now)
	}
	// Again holding the slot: every call whose cost the spend read here
	// lacks holds a slot as well, this one included, so at most
	// MaxConcurrent calls' costs are missing from it. Checked only before
	// taking the slot, a call that ended in between (its cost added, its
	// slot freed for this one) would be one more.
	if limited {
		if r := l.checkBudget(ctx, user, limit, now); r != nil {
			l.abandon(user, id)
			return nil, r
		}
	}
	c, _ := l.begin(key, id, charged, true, now)
	return c, nil
}

// checkBudget refuses the call if the month's spend has reached limit, or
// cannot be read.
func (l *NATSLedger) checkBudget(ctx context.Context, user string, limit int64, now time.Time) *Refusal {
	spent, err := l.spent(ctx, user, now)
	switch {
	case err != nil && ctx.Err() != nil:
		return gone()
	case err != nil:
		l.o.Log.Warn("model call refused: its budget cannot be checked", "user", user, "err", err)
		return unavailable()
	case spent >= limit:
		return overBudget(limit, spent, now)
	}
	return nil
}

// abandon frees the slot of a call refused after taking it, in the
// background (it lapses by itself if this fails).
func (l *NATSLedger) abandon(user, id string) {
	l.background(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(l.ctx), recordAttempt)
		defer cancel()
		if err := l.releaseSlot(ctx, user, id); err != nil {
			l.o.Log.Warn("slot of a refused model call left to lapse", "user", user, "err", err)
		}
	})
}

// background runs fn in its own goroutine, counted for Flush.
func (l *NATSLedger) background(fn func()) {
	l.recMu.Lock()
	l.recording++
	l.recMu.Unlock()
	go func() {
		defer func() {
			l.recMu.Lock()
			defer l.recMu.Unlock()
			if l.recording--; l.recording == 0 {
				close(l.idle)
				l.idle = make(chan struct{})
			}
		}()
		fn()
	}()
}

// recorded is closed once no record is being written in the background.
func (l *NATSLedger) recorded() <-chan struct{} {
	l.recMu.Lock()
	defer l.recMu.Unlock()
	if l.recording == 0 {
		done := make(chan struct{})
		close(done)
		return done
	}
	return l.idle
}

// cutOff admits a call of the sandbox of key while the shared state
// cannot be used: never one charged to a budget, and at most
// MaxConcurrent of that sandbox's on this broker.
func (l *NATSLedger) cutOff(key string, charged, limited bool, now time.Time) (Call, error) {
	if limited {
		return nil, unavailable()
	}
	c, err := l.begin(key, rand.Text(), charged, false, now)
	if err != nil {
		return nil, err
	}
	l.m.unslotted.Inc()
	return c, nil
}

// begin counts the call of the sandbox of key in flight here and has its
// first beacon sent (the beacons are the sandbox's).
func (l *NATSLedger) begin(key, id string, charged, slotted bool, now time.Time) (*call, error) {
	l.mu.Lock()
	a := l.active[key]
	if a == nil {
		a = &activity{}
		l.active[key] = a
	}
	if !slotted && a.inFlight >= l.o.MaxConcurrent {
		l.mu.Unlock()
		return nil, tooMany(l.o.MaxConcurrent)
	}
	a.inFlight++
	a.last = now
	a.gen++
	l.mu.Unlock()
	l.wake()
	return &call{l: l, id: id, key: key, user: ident.OwnerOf(key), charged: charged, slotted: slotted, start: now}, nil
}

func (l *NATSLedger) wake() {
	select {
	case l.kick <- struct{}{}:
	default: // a beacon round is due anyway
	}
}

// budgetOf is the user's monthly budget and whether there is one, read
// as the pages read it (spend.Book) from the ledger's caches.
func (l *NATSLedger) budgetOf(ctx context.Context, user string) (micros int64, limited bool) {
	a := (&spend.Book{Budgets: l.budgets, Groups: l.groups, DefaultMicros: l.o.Budget.DefaultMicros}).Budget(ctx, user)
	return a.Micros, a.Limited
}

func (l *NATSLedger) spent(ctx context.Context, user string, now time.Time) (int64, error) {
	e, err := l.usage.Get(ctx, state.UsageKey(user, state.Month(now)))
	if errors.Is(err, kv.ErrNotFound) {
		return 0, nil
	}
	return e.Value.CostMicros, err
}

// takeSlot adds the call to the user's slots unless MaxConcurrent live
// ones are there; lapsed slots are dropped on the way. A caller that
// leaves before the write answers has the slot freed once it is taken.
func (l *NATSLedger) takeSlot(ctx context.Context, user, id string) error {
	var full bool
	err := l.slots.do(ctx, user, func(cur *state.ModelCalls) bool {
		now := time.Now()
		pruned := pruneSlots(cur, now)
		cur.User = user
		if full = len(cur.Slots) >= l.o.MaxConcurrent; full {
			return pruned
		}
		cur.Slots[id] = now.Add(l.o.CallTimeout)
		return true
	}, func() {
		if !full {
			l.abandon(user, id)
		}
	})
	if err == nil && full {
		return tooMany(l.o.MaxConcurrent)
	}
	return err
}

// releaseSlot removes the call's slot (and any lapsed one).
func (l *NATSLedger) releaseSlot(ctx context.Context, user, id string) error {
	return l.slots.do(ctx, user, func(cur *state.ModelCalls) bool {
		pruned := pruneSlots(cur, time.Now())
		_, held := cur.Slots[id]
		delete(cur.Slots, id)
		return pruned || held
	}, nil)
}

// pruneSlots drops the lapsed slots from cur (making its map if it has
// none) and reports whether there were any.
func pruneSlots(cur *state.ModelCalls, now time.Time) bool {
	if cur.Slots == nil {
		cur.Slots = map[string]time.Time{}
	}
	n := len(cur.Slots)
	maps.DeleteFunc(cur.Slots, func(_ string, lapse time.Time) bool { return !lapse.After(now) })
	return len(cur.Slots) != n
}

// call is one admitted call.
type call struct {
	l  *NATSLedger
	id string
	// key is the calling sandbox's (its beacons), user its owner's (the
	// slot, the budget, the record).
	key     string
	user    string
	charged bool
	slotted bool
	start   time.Time
	ended   atomic.Bool
}

func (c *call) ID() string { return c.id }

// End records the call (once; later calls do nothing). The record's id,
// user, broker and BYOK flag are the admitted call's, whatever u says;
// At defaults to the admission and Duration to the time since. It returns
// at once: the record is written in the background, held if NATS does
// not answer (Flush waits for it).
func (c *call) End(u events.UsageEvent) {
	if !c.ended.CompareAndSwap(false, true) {
		return
	}
	l := c.l
	u.ID, u.User, u.Broker, u.BYOK = c.id, c.user, l.o.Instance, !c.charged
	if u.At.IsZero() {
		u.At = c.start
	}
	if u.Duration == 0 {
		u.Duration = time.Since(c.start)
	}
	l.mu.Lock()
	if a := l.active[c.key]; a != nil {
		a.inFlight--
		a.last = time.Now()
		a.gen++
	}
	l.mu.Unlock()
	l.wake()
	l.record(&record{ev: u, slot: c.slotted, lapse: c.start.Add(l.o.CallTimeout)})
}

// record is an ended call's bookkeeping, each step done at most once.
type record struct {
	ev                 events.UsageEvent
	totalled, recorded bool
	// slot is whether the call still holds a slot to free, which lapses
	// by itself at lapse.
	slot  bool
	lapse time.Time
}

func (l *NATSLedger) record(r *record) {
	l.background(func() {
		if l.nc.IsConnected() {
			// Not cancelled with the ledger: a record being written when
			// the broker shuts down is finished.
			ctx, cancel := context.WithTimeout(context.WithoutCancel(l.ctx), recordAttempt)
			err := l.write(ctx, r)
			cancel()
			if err == nil {
				return
			}
			l.o.Log.Warn("model call record held until NATS answers", "call", r.ev.ID, "user", r.ev.User, "err", err)
		}
		l.hold(r)
	})
}

// write adds the call to the month's total, publishes its record, and
// frees its slot, in that order (see the top of this file).
func (l *NATSLedger) write(ctx context.Context, r *record) error {
	if !r.totalled {
		if err := l.addToTotal(ctx, r.ev); err != nil {
			return err
		}
		r.totalled = true
	}
	if !r.recorded {
		if err := l.pub.Usage(ctx, r.ev); err != nil {
			return err
		}
		r.recorded = true
	}
	if r.slot && time.Now().Before(r.lapse) {
		if err := l.releaseSlot(ctx, r.ev.User, r.ev.ID); err != nil {
			return err
		}
	}
	r.slot = false
	return nil
}

// addToTotal adds the call to its month (the month it was admitted in, the
// one its budget check read). Calls and tokens count every call; the cost
// of a call made with the user's own key goes to the BYOK fields, never to
// CostMicros, the budget's measure. A call already in the total (its
// update was applied and the acknowledgement lost) is not added again.
func (l *NATSLedger) addToTotal(ctx context.Context, e events.UsageEvent) error {
	month := state.Month(e.At)
	return l.totals.do(ctx, state.UsageKey(e.User, month), func(cur *state.Usage) bool {
		if slices.Contains(cur.Recent, e.ID) {
			return false
		}
		cur.Recent = append(cur.Recent, e.ID)
		if n := len(cur.Recent) - state.UsageRecentCalls; n > 0 {
			cur.Recent = slices.Delete(cur.Recent, 0, n)
		}
		cur.User, cur.Month = e.User, month
		cur.Calls++
		if e.Estimated {
			cur.Estimated++
		}
		cur.InputTokens += e.InputTokens
		cur.OutputTokens += e.OutputTokens
		cur.CachedTokens += e.CachedTokens
		cur.CacheWriteTokens += e.CacheWriteTokens
		if e.BYOK {
			cur.BYOKCalls++
			cur.BYOKCostMicros += e.CostMicros
		} else {
			cur.CostMicros += e.CostMicros
		}
		cur.Updated = time.Now().UTC()
		return true
	}, nil)
}

// hold queues a record for later, dropping the oldest when full.
func (l *NATSLedger) hold(r *record) {
	l.heldMu.Lock()
	defer l.heldMu.Unlock()
	if len(l.held) >= l.o.MaxHeld {
		lost := l.held[0]
		l.held = l.held[1:]
		l.m.dropped.Inc()
		l.o.Log.Error("model call record dropped: too many held while NATS is unreachable", "call", lost.ev.ID, "user", lost.ev.User, "held", l.o.MaxHeld)
	}
	l.held = append(l.held, r)
	l.m.held.Set(float64(len(l.held)))
}

// drain writes the held records, oldest first, until one fails.
func (l *NATSLedger) drain(ctx context.Context) error {
	l.drainMu.Lock()
	defer l.drainMu.Unlock()
	for {
		l.heldMu.Lock()
		if len(l.held) == 0 {
			l.heldMu.Unlock()
			return nil
		}
		r := l.held[0]
		l.heldMu.Unlock()
		if err := l.write(ctx, r); err != nil {
			return err
		}
		l.heldMu.Lock()
		if len(l.held) > 0 && l.held[0] == r { // not dropped meanwhile
			l.held = l.held[1:]
		}
		l.m.held.Set(float64(len(l.held)))
		l.heldMu.Unlock()
	}
}

func (l *NATSLedger) heldCount() int {
	l.heldMu.Lock()
	defer l.heldMu.Unlock()
	return len(l.held)
}

// retry writes held records whenever NATS answers, until ctx ends.
func (l *NATSLedger) retry(ctx context.Context) {
	t := time.NewTicker(retryHeld)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if l.heldCount() == 0 || !l.nc.IsConnected() {
				continue
			}
			actx, cancel := context.WithTimeout(ctx, recordAttempt)
			if err := l.drain(actx); err != nil {
				l.o.Log.Debug("held model call records not written yet", "held", l.heldCount(), "err", err)
			}
			cancel()
		}
	}
}

// Flush waits for the records of ended calls to be written, held ones
// included (at shutdown, before the connection closes). It fails if some
// are still held when ctx ends or NATS does not answer.
func (l *NATSLedger) Flush(ctx context.Context) error {
	select {
	case <-l.recorded():
	case <-ctx.Done():
		return fmt.Errorf("flush model call records: %w", ctx.Err())
	}
	if err := l.drain(ctx); err != nil {
		return fmt.Errorf("flush model call records: %d held: %w", l.heldCount(), err)
	}
	return nil
}

// beat publishes beacons until ctx ends: at once after a call starts or
// ends, and every BeaconInterval for each user with calls in flight.
func (l *NATSLedger) beat(ctx context.Context) {
	t := time.NewTicker(l.o.BeaconInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.kick:
			l.beacons(false)
		case <-t.C:
			l.beacons(true)
		}
	}
}

// beacons sends those due: every user whose calls changed since their
// last beacon, and on a heartbeat every user with calls in flight. Only
// this goroutine sends, so a user's beacons are published in order (the
// stream keeps the last). A user's entry goes once a beacon said InFlight
// 0. Cut off from NATS nothing is sent; what is due is sent on return.
func (l *NATSLedger) beacons(heartbeat bool) {
	if !l.nc.IsConnected() {
		return
	}
	type due struct {
		b   events.Beacon
		gen uint64
	}
	now := time.Now().UTC()
	var send []due
	l.mu.Lock()
	for key, a := range l.active {
		if a.gen != a.sent || (heartbeat && a.inFlight > 0) {
			send = append(send, due{events.Beacon{
				User: key, Edge: l.o.Instance, InFlight: a.inFlight,
				LastActive: a.last.UTC(), SentAt: now, TTL: l.o.BeaconTTL,
			}, a.gen})
		}
	}
	l.mu.Unlock()
	for _, d := range send {
		if _, err := l.pub.Beacon(d.b); err != nil {
			l.o.Log.Debug("beacon not sent", "user", d.b.User, "err", err)
			continue
		}
		l.mu.Lock()
		if a := l.active[d.b.User]; a != nil {
			a.sent = max(a.sent, d.gen)
			if a.inFlight == 0 && a.sent == a.gen {
				delete(l.active, d.b.User)
			}
		}
		l.mu.Unlock()
	}
}

// Refusals.

func overBudget(limit, spent int64, now time.Time) *Refusal {
	now = now.UTC()
	renews := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	return &Refusal{
		Status: http.StatusTooManyRequests, Reason: "budget", RetryAfter: renews.Sub(now),
		Message: fmt.Sprintf("your model budget of %s for %s is spent (%s used); it renews on %s",
			usd(limit), now.Format("January 2006"), usd(spent), renews.Format("2 January 2006")),
	}
}

func tooMany(n int) *Refusal {
	return &Refusal{
		Status: http.StatusTooManyRequests, Reason: "concurrency", RetryAfter: time.Second,
		Message: fmt.Sprintf("too many model calls at once: at most %d may run together; try again when one has finished", n),
	}
}

// gone answers a client that left while its call was being admitted.
func gone() *Refusal {
	return &Refusal{Status: 499, Reason: "client_gone", Message: "the call was abandoned before it started"}
}

func unavailable() *Refusal {
	return &Refusal{
		Status: http.StatusServiceUnavailable, Reason: "unavailable", RetryAfter: 5 * time.Second,
		Message: "your model budget cannot be checked right now (the broker lost touch with its state store); try again shortly",
	}
}

// usd shows micro-USD as dollars and cents.
func usd(micros int64) string { return fmt.Sprintf("$%.2f", float64(micros)/1e6) }

// Metrics: aggregate only, never a user.

type ledgerMetrics struct {
	held               prometheus.Gauge
	dropped, unslotted prometheus.Counter
}

func newLedgerMetrics(reg prometheus.Registerer) *ledgerMetrics {
	m := &ledgerMetrics{
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aaas_broker_usage_held", Help: "Ended model calls whose record waits for NATS.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_broker_usage_dropped_total", Help: "Ended model calls whose record was dropped, the oldest held when too many waited for NATS.",
		}),
		unslotted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_broker_unslotted_calls_total", Help: "Model calls admitted without a shared slot or budget check because NATS was unreachable (users without a budget, or their own key).",
		}),
	}
	reg.MustRegister(m.held, m.dropped, m.unslotted)
	return m
}
