package sweeper

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/notify"
	"github.com/aaas-project/aaas/internal/state"
)

// Options wires a Sweeper.
type Options struct {
	JS        jetstream.JetStream
	Publisher *events.Publisher
	// Policy is IDLE_TIMEOUT and MAX_RUNTIME: the rule the sweeper
	// decides by (idle.Policy.Decide); a profile of Profiles (PROFILES)
	// may give its sandboxes their own idle timeout and ceiling.
	Policy   idle.Policy
	Profiles config.Profiles
	// Interval is how often the active sweeper looks.
	Interval time.Duration
	// IdleEvict suspends the longest-idle sandboxes while wakes wait for
	// a place under MaxRunning (MAX_RUNNING_SANDBOXES).
	IdleEvict  bool
	MaxRunning int
	// Notify tells the operator's webhook of suspends to come (WarnBefore
	// ahead, NOTIFY_WARN_BEFORE) and of dormant accounts (nil: no webhook).
	Notify     *notify.Notifier
	WarnBefore time.Duration
	Log        *slog.Logger
	Metrics    prometheus.Registerer
}

// Sweeper keeps idle clocks on every replica, so a standby that takes the
// lease decides with complete clocks at once.
type Sweeper struct {
	o      Options
	m      *metrics
	clocks *idle.Clocks
	// boxes is every sandbox, summarized: what the decisions read of each
	// record, not its pod's names, addresses and reasons.
	boxes *kv.Cache[state.SandboxSummary]
	// usage is IDLE_EVICT's count of running sandboxes, and phases the
	// inventory's count by phase, kept as boxes changes.
	usage  capacity.Tally
	phases phaseTally
	// idleAt holds the Ready, managed sandboxes by when the leader next
	// looks at each; dormantAt the suspended, managed ones (with
	// DORMANT_AFTER set) by when each falls dormant or due for deletion.
	// A sweep decides for those whose time has come, not for every
	// sandbox.
	idleAt, dormantAt timetable
	// users are the accounts' names alone (headers, not records): all
	// the sweeper needs of them is aaas_users.
	users  *kv.Names
	queue  *kv.Cache[state.Queued]
	awake  *kv.Cache[state.KeepAwake]
	synced atomic.Bool
	// leading while this replica holds the lease: only the leader exports
	// the inventory, so a sum over replicas is the count.
	leading atomic.Bool

	// Only the leader's loop touches them.
	issued map[string]issue
	// dormant holds the accounts audited dormant, by when their sandbox
	// fell asleep, and whether their deletion was asked for.
	dormant map[string]dormancy
	// warned is the suspend each user was last warned of.
	warned map[string]time.Time
}

type issue struct{ rev, seq uint64 }

type dormancy struct {
	asleep  time.Time
	deleted bool
}

// New opens the buckets and caches; Run starts following the stream.
func New(ctx context.Context, o Options) (*Sweeper, error) {
	s := &Sweeper{o: o, m: newMetrics(o.Metrics), clocks: idle.NewClocks(), issued: map[string]issue{}, dormant: map[string]dormancy{}, warned: map[string]time.Time{}}
	boxes, err := kv.Open[state.SandboxSummary](ctx, o.JS, state.BucketSandboxes)
	if err != nil {
		return nil, err
	}
	users, err := kv.Open[state.User](ctx, o.JS, state.BucketUsers)
	if err != nil {
		return nil, err
	}
	if s.boxes, err = kv.NewCache(ctx, boxes, ">", o.Log, kv.OnReplace(s.observe)); err != nil {
		return nil, err
	}
	s.users = kv.NewNames(ctx, o.Log, users.KeySource())
	go func() { _ = s.users.Load(ctx) }() // Ready says when it has
	queue, err := kv.Open[state.Queued](ctx, o.JS, state.BucketQueue)
	if err != nil {
		return nil, err
	}
	if s.queue, err = kv.NewCache(ctx, queue, ">", o.Log); err != nil {
		return nil, err
	}
	awake, err := kv.Open[state.KeepAwake](ctx, o.JS, state.BucketKeepAwake)
	if err != nil {
		return nil, err
	}
	if s.awake, err = kv.NewCache(ctx, awake, ">", o.Log, kv.OnChange(s.keepAwakeChanged)); err != nil {
		return nil, err
	}
	o.Metrics.MustRegister(s.inventory())
	return s, nil
}

// observe takes in one change of the sandboxes cache: the counts, and
// the timetables (a change is a reason to look at the sandbox now).
func (s *Sweeper) observe(key string, was kv.Entry[state.SandboxSummary], had bool, e kv.Entry[state.SandboxSummary], deleted bool) {
	s.usage.Change(capacity.Counted{Managed: was.Value.Managed, Phase: was.Value.Phase}, had,
		capacity.Counted{Managed: e.Value.Managed, Phase: e.Value.Phase}, !deleted)
	s.phases.observe(was, had, e, deleted)
	switch b := e.Value; {
	case !deleted && b.Managed && b.Phase == state.PhaseReady:
		s.idleAt.set(key, nextSweep)
		s.dormantAt.remove(key)
	case !deleted && b.Managed && b.Phase == state.PhaseSuspended && s.o.Policy.DormantAfter > 0:
		s.idleAt.remove(key)
		s.dormantAt.set(key, nextSweep)
	default:
		s.idleAt.remove(key)
		s.dormantAt.remove(key)
	}
}

// keepAwakeChanged: a keep-awake set, moved or gone changes when the
// sandbox falls due, so it is looked at next.
func (s *Sweeper) keepAwakeChanged(user string, _ kv.Entry[state.KeepAwake], _ bool) {
	s.lookSoon(user)
}

// beacon takes in a beacon. One that reports no work in flight may end
// the sandbox's busy spell before the busy beacons' TTL would, bringing
// its deadline closer (the last activity plus IDLE_TIMEOUT), so the
// sandbox is looked at next; beacons only push deadlines later otherwise,
// and those of work in flight come every BEACON_INTERVAL, which would
// bring a look at every one.
func (s *Sweeper) beacon(b events.Beacon, seq uint64, stamped time.Time) {
	s.clocks.Observe(b, seq, stamped)
	if b.InFlight == 0 {
		s.lookSoon(b.User)
	}
}

// lookSoon puts a Ready, managed sandbox in for the next sweep.
func (s *Sweeper) lookSoon(user string) {
	if b, ok := s.boxes.Get(user); ok && b.Value.Managed && b.Value.Phase == state.PhaseReady {
		s.idleAt.set(user, nextSweep)
	}
}

// nextSweep, as a timetable's time, is the next sweep, whatever moment it
// decides for.
var nextSweep time.Time

// phaseTally counts sandboxes by phase as the cache changes, taking back
// what each change replaced (kv.OnReplace): no copy of its own of every
// sandbox's phase.
type phaseTally struct {
	mu sync.Mutex
	n  map[state.Phase]int
}

func (t *phaseTally) observe(was kv.Entry[state.SandboxSummary], had bool, e kv.Entry[state.SandboxSummary], deleted bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.n == nil {
		t.n = map[state.Phase]int{}
	}
	if had {
		t.n[was.Value.Phase]--
	}
	if !deleted {
		t.n[e.Value.Phase]++
	}
}

// count is the sandboxes in each phase (every phase, zero too).
func (t *phaseTally) count() map[state.Phase]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[state.Phase]int, len(state.Phases))
	for _, p := range state.Phases {
		out[p] = t.n[p]
	}
	return out
}

// inventory is aaas_users and aaas_sandboxes{phase}, counted as the
// caches change, exported by the lease holder only (every replica
// has complete caches, and a sum over replicas must not double the
// count), and each replica's own aaas_sweeper_cached_sandboxes.
func (s *Sweeper) inventory() prometheus.Collector {
	return &inventory{s: s,
		users:  prometheus.NewDesc("aaas_users", "Accounts (exported by the active sweeper only).", nil, nil),
		boxes:  prometheus.NewDesc("aaas_sandboxes", "Sandboxes by phase (exported by the active sweeper only).", []string{"phase"}, nil),
		cached: prometheus.NewDesc("aaas_sweeper_cached_sandboxes", "Sandboxes in this replica's copy of the sandboxes bucket.", nil, nil),
	}
}

type inventory struct {
	s                    *Sweeper
	users, boxes, cached *prometheus.Desc
}

func (i *inventory) Describe(ch chan<- *prometheus.Desc) {
	ch <- i.users
	ch <- i.boxes
	ch <- i.cached
}

func (i *inventory) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(i.cached, prometheus.GaugeValue, float64(i.s.boxes.Len()))
	if !i.s.leading.Load() {
		return
	}
	ch <- prometheus.MustNewConstMetric(i.users, prometheus.GaugeValue, float64(i.s.users.Len()))
	for p, n := range i.s.phases.count() {
		ch <- prometheus.MustNewConstMetric(i.boxes, prometheus.GaugeValue, float64(n), string(p))
	}
}

// Ready reports whether the clocks and caches are complete.
func (s *Sweeper) Ready() bool {
	return s.synced.Load() && s.boxes.IsSynced() && s.users.Loaded() && s.queue.IsSynced() && s.awake.IsSynced()
}

// Follow reads the activity stream into the clocks until ctx ends
// (events.FollowActivity): first the newest beacon of every (user, edge),
// then each new one.
func (s *Sweeper) Follow(ctx context.Context) error {
	start := time.Now()
	return events.FollowActivity(ctx, s.o.JS, s.o.Log, s.beacon, func() {
		s.synced.Store(true)
		s.o.Log.Info("idle clocks rebuilt", "users", s.clocks.Len(), "took", time.Since(start).String())
	})
}

// Lead sweeps until ctx ends; the lease runs it on one replica.
func (s *Sweeper) Lead(ctx context.Context) {
	s.m.leader.Set(1)
	s.leading.Store(true)
	defer func() { s.m.leader.Set(0); s.leading.Store(false) }()
	s.o.Log.Info("sweeping", "idle_timeout", s.o.Policy.IdleTimeout.String(), "max_runtime", s.o.Policy.MaxRuntime.String())
	tick := time.NewTicker(s.o.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if s.Ready() {
				s.Sweep(ctx, time.Now())
			}
		}
	}
}

// candidate is a Ready, managed sandbox, and the idle rule of its
// profile.
type candidate struct {
	user       string
	rev        uint64
	readySince time.Time
	policy     idle.Policy
}

// policyOf is the idle rule of the sandboxes of profile.
func (s *Sweeper) policyOf(profile string) idle.Policy {
	if len(s.o.Profiles) == 0 {
		return s.o.Policy
	}
	return s.o.Profiles.PolicyOf(s.o.Policy, profile)
}

// longestIdle is the longest idle timeout of any profile: a gone user's
// clock is kept that long.
func (s *Sweeper) longestIdle() time.Duration {
	d := s.o.Policy.IdleTimeout
	for _, p := range s.o.Profiles {
		d = max(d, p.Policy(s.o.Policy).IdleTimeout)
	}
	return d
}

// Sweep makes one round of decisions at now, for the sandboxes whose time
// has come (idleAt), or, while wakes wait for a place under IDLE_EVICT,
// for every running one (the longest idle go first). Each is put back for
// the moment its decision can next change.
func (s *Sweeper) Sweep(ctx context.Context, now time.Time) {
	start := time.Now()
	evicting := s.o.IdleEvict && s.queue.Len() > 0
	var looked []string
	if evicting {
		looked = s.idleAt.all()
	} else {
		looked = s.idleAt.due(now)
	}
	var cands []candidate
	for _, u := range looked {
		// Only sandboxes this gateway created: a claim applied by hand is
		// not ours to suspend. One no longer Ready has left the set.
		if e, ok := s.boxes.Get(u); ok && e.Value.Phase == state.PhaseReady && e.Value.Managed {
			cands = append(cands, candidate{user: u, rev: e.Revision, readySince: e.Value.ReadySince(), policy: s.policyOf(e.Value.Profile())})
		}
	}
	due, freeing := 0, 0
	var asks []ask
	var evictable []capacity.Candidate
	seen := map[string]ask{}
	for _, c := range cands {
		v := s.clocks.View(c.user, now)
		sb := idle.Sandbox{ReadySince: c.readySince}
		if k, ok := s.awake.Get(c.user); ok {
			sb.KeepAwakeUntil = k.Value.Until
		}
		d := c.policy.Decide(v, sb, now)
		a := ask{candidate: c, seq: v.Seq, last: d.Last, reason: d.Reason}
		if d.Due {
			// Looked at every round until lifecycle's suspend changes
			// its record (or activity makes it not due).
			s.idleAt.set(c.user, now)
		} else {
			s.idleAt.set(c.user, s.nextLook(d, v, now))
		}
		if s.issued[c.user] == (issue{c.rev, v.Seq}) {
			freeing++ // asked already; lifecycle is on it
			if d.Due {
				due++
			}
			continue
		}
		if !d.Due {
			s.warn(c.user, d, c.policy, now)
			if !sb.KeepAwakeUntil.After(now) {
				evictable = append(evictable, capacity.Candidate{User: c.user, Last: d.Last, Busy: d.Busy})
			}
			seen[c.user] = a
			continue
		}
		due++
		asks = append(asks, a)
	}
	// Wakes waiting for a place: make room by suspending the longest-idle
	// sandboxes too (IDLE_EVICT), beyond the places already being freed.
	if evicting {
		use := s.usage.Usage()
		for _, u := range capacity.Evict(s.queue.Len(), use, capacity.Limits{MaxRunning: s.o.MaxRunning}, freeing+use.Stopping+len(asks), evictable) {
			a := seen[u]
			a.reason = idle.ReasonEvicted
			asks = append(asks, a)
			s.idleAt.set(u, now)
		}
	}
	s.publish(ctx, asks)
	for _, a := range asks {
		switch {
		case a.err != nil:
			s.m.suspends.WithLabelValues("error").Inc()
			s.o.Log.Warn("suspend not requested", "user", a.user, "err", a.err)
			continue
		case a.dup:
			s.m.suspends.WithLabelValues("duplicate").Inc()
		default:
			s.m.suspends.WithLabelValues("requested").Inc()
			s.o.Publisher.Audit(events.AuditEvent{Kind: events.AuditSuspend, User: a.user, Outcome: "requested",
				Detail: fmt.Sprintf("%s since %s (%s): %s", a.reason, a.last.UTC().Format(time.RFC3339), now.Sub(a.last).Round(time.Second), a.detail)})
			s.o.Log.Info("suspend requested", "user", a.user, "reason", a.reason, "idle", now.Sub(a.last).Round(time.Second).String())
		}
		s.issued[a.user] = issue{a.rev, a.seq}
	}
	s.dormancy(ctx, now)
	s.forget(now)
	s.m.tracked.Set(float64(s.clocks.Len()))
	s.m.idle.Set(float64(due))
	s.m.looked.Add(float64(len(cands)))
	s.m.tick.Observe(time.Since(start).Seconds())
}

// nextLook is when a decision made at now (not due) can next change
// without a change to the sandbox's record or keep-awake, or a beacon of
// no work in flight, which put it in for the next sweep themselves: when
// it falls due, when its warning is due (NOTIFY_WARN_BEFORE ahead), or,
// while work is in flight, when the newest beacon reporting it expires.
// Anything else only moves these later, so a look then is never late; one
// that finds the deadline moved puts it back.
func (s *Sweeper) nextLook(d idle.Decision, v idle.View, now time.Time) time.Time {
	at := d.SuspendAt
	if v.Busy && (at.IsZero() || v.BusyUntil.Before(at)) {
		at = v.BusyUntil
	}
	if s.o.Notify != nil && !d.SuspendAt.IsZero() {
		if w := d.SuspendAt.Add(-s.o.WarnBefore); w.After(now) && w.Before(at) {
			at = w
		}
	}
	if at.IsZero() {
		at = now.Add(s.o.Interval) // nothing to wait for: as often as the sweep runs
	}
	return at
}

// ask is one suspend decision and how its publication went.
type ask struct {
	candidate
	seq  uint64
	last time.Time
	// reason is why (idle.Policy.Decide's, or evicted: not due, but the
	// longest idle while wakes wait for a place, IDLE_EVICT); detail
	// says it in words, for the user's pages.
	reason idle.Reason
	detail string
	dup    bool
	err    error
}

// publishers bounds the suspend commands in flight at once: a takeover, or
// a quiet spell ending for many users together, can make thousands due in
// one tick, and one at a time (an acknowledged, replicated write each)
// they would take several ticks.
const publishers = 64

// publish sends the asks' commands, publishers at a time, and records each
// outcome in its ask.
func (s *Sweeper) publish(ctx context.Context, asks []ask) {
	for i := range asks {
		asks[i].detail = asks[i].reason.Describe(asks[i].policy)
	}
	sem := make(chan struct{}, publishers)
	var wg sync.WaitGroup
	for i := range asks {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			a := &asks[i]
			a.dup, a.err = s.o.Publisher.Command(ctx, events.NewSuspend(a.user, a.seq, a.rev, a.last, string(a.reason), a.detail))
		})
	}
	wg.Wait()
}

// warn tells the webhook of a suspend due within WarnBefore, once per
// suspend: a deadline that moved (activity, a keep-awake) by more than
// WarnBefore is a new one. The id is the user and the deadline, the same
// on a standby that takes over with the same clocks.
func (s *Sweeper) warn(user string, d idle.Decision, p idle.Policy, now time.Time) {
	if s.o.Notify == nil || d.SuspendAt.IsZero() || d.SuspendAt.Sub(now) > s.o.WarnBefore {
		return
	}
	if last, ok := s.warned[user]; ok && (d.SuspendAt.Sub(last)).Abs() <= s.o.WarnBefore {
		return
	}
	s.warned[user] = d.SuspendAt
	at := d.SuspendAt.UTC().Truncate(time.Second)
	s.o.Notify.Send(notify.Notice{ID: fmt.Sprintf("warning.%s.%d", user, at.Unix()), Kind: notify.KindWarning, User: user,
		At: now.UTC(), When: at, Reason: string(d.Reason), Detail: d.Reason.Ahead(p)})
}

// dormancy audits the accounts whose managed sandbox has slept for
// DORMANT_AFTER, once per sleep, and asks lifecycle to delete those that
// have slept DORMANT_DELETE_AFTER longer (its id derived from the record's
// revision, so replicas and rounds ask once). Lifecycle deletes only
// claims this gateway manages, and an unmanaged sandbox is never asked
// about at all.
func (s *Sweeper) dormancy(ctx context.Context, now time.Time) {
	if s.o.Policy.DormantAfter <= 0 {
		return
	}
	for _, user := range s.dormantAt.due(now) {
		e, ok := s.boxes.Get(user)
		if !ok || e.Value.Phase != state.PhaseSuspended || !e.Value.Managed {
			delete(s.dormant, user) // woke or went: a later sleep is a new one
			continue
		}
		asleep := e.Value.Asleep()
		dormant, deleteAt := s.o.Policy.Dormancy(asleep, now)
		if !dormant {
			s.dormantAt.set(user, asleep.Add(s.o.Policy.DormantAfter))
			continue
		}
		d, seen := s.dormant[user]
		if !seen || !d.asleep.Equal(asleep) {
			d = dormancy{asleep: asleep}
			detail := "asleep since " + asleep.UTC().Format(time.RFC3339)
			if !deleteAt.IsZero() {
				detail += "; to be deleted at " + deleteAt.UTC().Format(time.RFC3339)
			}
			s.o.Publisher.Audit(events.AuditEvent{Kind: events.AuditDormant, User: user, Outcome: "dormant", Detail: detail})
			s.o.Notify.Send(notify.Notice{ID: fmt.Sprintf("dormant.%s.%d", user, asleep.Unix()), Kind: notify.KindDormant, User: user,
				At: now.UTC(), When: deleteAt, Detail: detail})
		}
		switch {
		case deleteAt.IsZero() || d.deleted:
			// Nothing more to do until it wakes (a change puts it back).
		case now.Before(deleteAt):
			s.dormantAt.set(user, deleteAt)
		default:
			id := fmt.Sprintf("dormant-%s-%d", user, e.Revision)
			if _, err := s.o.Publisher.Command(ctx, events.NewDelete(user, id)); err != nil {
				s.o.Log.Warn("dormant account's deletion not asked", "user", user, "err", err)
				s.dormantAt.set(user, now) // again next round
			} else {
				d.deleted = true
				s.o.Publisher.Audit(events.AuditEvent{Kind: events.AuditDormant, User: user, Outcome: "deleting",
					Detail: "unused since " + asleep.UTC().Format(time.RFC3339)})
			}
		}
		s.dormant[user] = d
	}
}

// forget drops the idle clocks, and the record of suspends asked, of users
// without a sandbox (deleted), so neither holds more users than there are
// sandboxes. It looks only when one of them does (then some user in it
// certainly has no sandbox): a pass over every clock costs about as much as
// the sweep itself. A clock goes only once it can decide nothing (clocks
// forget): its sandbox record may simply not have reached this replica yet,
// and when it comes its ReadySince need not be newer than the activity (a
// record written again, a bucket restored), so a busy sandbox would be
// judged idle.
func (s *Sweeper) forget(now time.Time) {
	if n := s.boxes.Len(); s.clocks.Len() <= n && len(s.issued) <= n && len(s.dormant) <= n && len(s.warned) <= n {
		return
	}
	gone := func(user string) bool {
		_, ok := s.boxes.Get(user)
		return !ok
	}
	s.clocks.Forget(gone, now, s.longestIdle())
	for u := range s.issued {
		if gone(u) {
			delete(s.issued, u)
		}
	}
	for u := range s.dormant {
		if gone(u) {
			delete(s.dormant, u)
		}
	}
	for u := range s.warned {
		if gone(u) {
			delete(s.warned, u)
		}
	}
}

type metrics struct {
	tracked  prometheus.Gauge
	idle     prometheus.Gauge
	looked   prometheus.Counter
	suspends *prometheus.CounterVec
	tick     prometheus.Histogram
	leader   prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		tracked: prometheus.NewGauge(prometheus.GaugeOpts{Name: "aaas_sweeper_users_tracked", Help: "Users with an idle clock."}),
		idle:    prometheus.NewGauge(prometheus.GaugeOpts{Name: "aaas_sweeper_idle", Help: "Ready sandboxes due to be suspended (idle, or past MAX_RUNTIME) at the last sweep."}),
		looked:  prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_sweeper_decisions_total", Help: "Sandboxes the active sweeper decided for: those whose deadline, warning or end of work came, or that changed (every running one while IDLE_EVICT makes room)."}),
		suspends: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_sweeper_suspends_total", Help: "Suspend decisions, by outcome (requested, duplicate, error).",
		}, []string{"outcome"}),
		tick: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "aaas_sweeper_tick_seconds", Help: "Time to make one round of decisions.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "aaas_sweeper_leader", Help: "1 while this replica is the active sweeper."}),
	}
	reg.MustRegister(m.tracked, m.idle, m.looked, m.suspends, m.tick, m.leader)
	return m
}
