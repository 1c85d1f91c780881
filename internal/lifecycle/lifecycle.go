// Package lifecycle executes the gateway's commands against Kubernetes and
// mirrors Kubernetes state into KV. It is the only part of the system with
// Kubernetes credentials: edges and the sweeper ask, lifecycle acts.
//
// Every handler is idempotent, because a command may be delivered again
// after a crash, and acknowledges only once its effect is durable.
package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/notify"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// Options wires a Worker.
type Options struct {
	Cluster      *sandbox.Cluster
	JS           jetstream.JetStream
	Publisher    *events.Publisher
	Sealer       *handshake.Sealer
	LogTailLines int
	// LogLimitBytes is the most of the pod log a handshake reads (the
	// Cluster cuts it); a failure to find the token says when it was cut.
	LogLimitBytes int64
	HandshakeTTL  time.Duration
	// HandshakeTimeout bounds one handshake command, all of it.
	HandshakeTimeout time.Duration
	// HandshakeWorkers is how many commands may be handshakes at once: a
	// handshake talks to the tenant's pod, and the rest of the workers
	// stay free for claims and wakes however pods answer.
	HandshakeWorkers int
	RecreateTimeout  time.Duration
	// Profiles are what claims are made of: a command names one (or the
	// default), and its warm pool is the claim's.
	Profiles config.Profiles
	// MaxSandboxes is MAX_SANDBOXES_PER_USER: an account's sandboxes, its
	// first included (0 reads as 1).
	MaxSandboxes int
	// Rollout is ROLLOUT, RolloutPercent ROLLOUT_PERCENT, RolloutGroups
	// ROLLOUT_GROUPS (rollForward) and RolloutProbation
	// ROLLOUT_PROBATION (rollBack).
	Rollout          string
	RolloutPercent   int
	RolloutGroups    []string
	RolloutProbation time.Duration
	// Limits cap running sandboxes and concurrent starts; wakes beyond
	// them wait in the queue, which the lease holder admits from.
	Limits capacity.Limits
	// Notify tells the operator's webhook of suspends and deletions (nil:
	// no webhook).
	Notify  *notify.Notifier
	Log     *slog.Logger
	Metrics prometheus.Registerer

	// PruneInterval is how often the lease holder removes the sessions of
	// accounts that are gone (prune.go).
	PruneInterval time.Duration
}

// Worker handles commands and, while it holds the lease, runs the mirror.
type Worker struct {
	o        Options
	log      *slog.Logger
	m        *metrics
	pub      *events.Publisher
	k8s      *sandbox.Cluster
	activity jetstream.Stream
	http     *http.Client

	users      *kv.Bucket[state.User]
	sandboxes  *kv.Bucket[state.Sandbox]
	sessions   *kv.Bucket[state.Session]
	handshakes *kv.Bucket[state.Handshake]
	apiTokens  *kv.Bucket[state.APIToken]
	requests   *kv.Bucket[state.Result]
	queue      *kv.Bucket[state.Queued]
	rollouts   *kv.Bucket[state.Rollout]
	keepAwake  *kv.Bucket[state.KeepAwake]
	// userGroups is read for ROLLOUT_GROUPS (nil without).
	userGroups *kv.Bucket[state.UserGroups]
	userCache  *kv.Cache[state.User]
	boxCache   *kv.Cache[state.Sandbox]
	queueCache *kv.Cache[state.Queued]
	// usage is the capacity caps' count, and revs the sandboxes per
	// revision (aaas_sandboxes), kept as boxCache changes.
	usage capacity.Tally
	revs  revisions

	locks  keyedMutex
	mirror *mirror
	pruner *pruner
	// handshakeSlots holds one token per handshake under way.
	handshakeSlots chan struct{}
	// refreshes paces handshakes asked for again (LifecycleRefreshes).
	refreshes *handshake.Backoff
}

// New opens the buckets and caches Worker needs; ctx bounds the caches.
func New(ctx context.Context, o Options) (*Worker, error) {
	if len(o.Profiles) == 0 {
		return nil, errors.New("lifecycle: no profiles: a claim would have no warm pool")
	}
	w := &Worker{o: o, log: o.Log, m: newMetrics(o.Metrics), pub: o.Publisher, k8s: o.Cluster, http: handshake.Client(),
		handshakeSlots: make(chan struct{}, max(o.HandshakeWorkers, 1)), refreshes: handshake.LifecycleRefreshes()}
	w.usage.Default = o.Profiles.NameOf("")
	var err error
	if w.users, err = kv.Open[state.User](ctx, o.JS, state.BucketUsers); err != nil {
		return nil, err
	}
	if w.sandboxes, err = kv.Open[state.Sandbox](ctx, o.JS, state.BucketSandboxes); err != nil {
		return nil, err
	}
	if w.sessions, err = kv.Open[state.Session](ctx, o.JS, state.BucketSessions); err != nil {
		return nil, err
	}
	if w.handshakes, err = kv.Open[state.Handshake](ctx, o.JS, state.BucketHandshakes); err != nil {
		return nil, err
	}
	if w.apiTokens, err = kv.Open[state.APIToken](ctx, o.JS, state.BucketAPITokens); err != nil {
		return nil, err
	}
	if w.requests, err = kv.Open[state.Result](ctx, o.JS, state.BucketRequests); err != nil {
		return nil, err
	}
	if w.keepAwake, err = kv.Open[state.KeepAwake](ctx, o.JS, state.BucketKeepAwake); err != nil {
		return nil, err
	}
	if w.rollouts, err = kv.Open[state.Rollout](ctx, o.JS, state.BucketRollouts); err != nil {
		return nil, err
	}
	if len(o.RolloutGroups) > 0 {
		if w.userGroups, err = kv.Open[state.UserGroups](ctx, o.JS, state.BucketUserGroups); err != nil {
			return nil, err
		}
	}
	if w.activity, err = o.JS.Stream(ctx, events.StreamActivity); err != nil {
		return nil, fmt.Errorf("activity stream: %w", err)
	}
	// The mirror is level-based on both sides: a change to a record it
	// compares against (another replica's write, or its own that a lagging
	// watch brings late) is a reason to look at that user again, or a
	// decision taken on the stale record ("unchanged") would stand.
	w.mirror = newMirror(w)
	w.pruner = newPruner(w, o.PruneInterval, o.Metrics)
	if w.userCache, err = kv.NewCache(ctx, w.users, ">", o.Log, requeue[state.User](w.mirror)); err != nil {
		return nil, err
	}
	if w.boxCache, err = kv.NewCache(ctx, w.sandboxes, ">", o.Log, requeue[state.Sandbox](w.mirror), kv.OnReplace(w.usage.Observe), kv.OnReplace(w.revs.Observe)); err != nil {
		return nil, err
	}
	if w.queue, err = kv.Open[state.Queued](ctx, o.JS, state.BucketQueue); err != nil {
		return nil, err
	}
	if w.queueCache, err = kv.NewCache(ctx, w.queue, ">", o.Log); err != nil {
		return nil, err
	}
	if err := o.Cluster.OnChange(w.mirror.enqueue); err != nil {
		return nil, err
	}
	o.Metrics.MustRegister(scrapeGauge{
		desc: prometheus.NewDesc("aaas_lifecycle_command_backlog", "Commands waiting for a worker (the consumer's pending count; absent while NATS cannot say).", nil, nil),
		read: func() (float64, bool) { return w.backlog(ctx) },
	}, &w.revs, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "aaas_lifecycle_warm_pool_ready", Help: "Ready spare sandboxes in the warm pool: what the next signups adopt at once.",
	}, func() float64 { return float64(o.Cluster.Spares()) }), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "aaas_lifecycle_wake_queue", Help: "Wakes waiting for a free place (MAX_RUNNING_SANDBOXES, MAX_CONCURRENT_STARTS).",
	}, func() float64 { return float64(w.queueCache.Len()) }), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "aaas_lifecycle_wake_queue_oldest_seconds", Help: "How long the oldest wake in the queue has waited for a place (0: none waits).",
	}, func() float64 { return w.oldestQueued(time.Now()) }), prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "aaas_lifecycle_kubernetes_watch_refusals_total", Help: "Lists and watches of the informers that Kubernetes refused (forbidden, unauthorized): the Role lacks a verb.",
	}, func() float64 { return float64(o.Cluster.Refusals()) }))
	return w, nil
}

// oldestQueued is how long the oldest queued wake has waited at now.
func (w *Worker) oldestQueued(now time.Time) float64 {
	var oldest time.Time
	w.queueCache.Range(func(e kv.Entry[state.Queued]) bool {
		if oldest.IsZero() || e.Value.Since.Before(oldest) {
			oldest = e.Value.Since
		}
		return true
	})
	if oldest.IsZero() {
		return 0
	}
	return now.Sub(oldest).Seconds()
}

// backlog is the commands consumer's count of messages not yet delivered,
// asked of NATS at scrape time; false when NATS cannot say.
func (w *Worker) backlog(ctx context.Context) (float64, bool) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	// Looking the consumer up fetches its info: one request per scrape.
	c, err := w.o.JS.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
	if err != nil {
		return 0, false
	}
	return float64(c.CachedInfo().NumPending), true
}

// scrapeGauge is a gauge read at scrape time and left out of the scrape
// when its value cannot be had: a stand-in such as -1 would be taken for a
// value by max() over the replicas and by an alert's threshold.
type scrapeGauge struct {
	desc *prometheus.Desc
	read func() (float64, bool)
}

func (g scrapeGauge) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

func (g scrapeGauge) Collect(ch chan<- prometheus.Metric) {
	if v, ok := g.read(); ok {
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, v)
	}
}

// requeue has the mirror look again at the user whose record changed.
func requeue[T any](m *mirror) kv.CacheOption[T] {
	return kv.OnChange(func(user string, _ kv.Entry[T], _ bool) { m.enqueue(user) })
}

// Ready reports whether the caches the handlers read are complete.
func (w *Worker) Ready() bool {
	return w.k8s.Healthy() && w.userCache.IsSynced() && w.boxCache.IsSynced() && w.queueCache.IsSynced()
}

// Handle is the events.Handler for the command stream.
func (w *Worker) Handle(ctx context.Context, d events.Delivery) error {
	c, err := events.Decode[events.Command](d.Data)
	if errors.Is(err, events.ErrNewerSchema) {
		// A newer replica of a rolling upgrade will understand it.
		w.m.commands.WithLabelValues("", "newer").Observe(0)
		return events.Later(err, newerSchemaDelay)
	}
	if err == nil {
		err = c.Validate()
	}
	if err != nil {
		return events.Permanent(fmt.Errorf("undecodable command on %s: %w", clip(d.Subject), err))
	}
	// Counted at receipt, whatever becomes of this delivery, so that the
	// commands handled less the redeliveries is the commands asked for.
	if d.Delivered > 1 {
		w.m.redelivered.WithLabelValues(string(c.Verb)).Inc()
	}
	// NATS grants subjects, not bodies: the sweeper may publish suspends
	// only, so a body naming another verb or user than its subject is
	// forged. It is refused: nothing of it is done, answered, or
	// attributed to the user it names (Exhausted records it).
	if d.Subject != c.Subject() {
		w.m.commands.WithLabelValues(string(c.Verb), "refused").Observe(0)
		return events.Permanent(fmt.Errorf("%w: %s carries a %s command for %q", errWrongSubject, clip(d.Subject), c.Verb, clip(c.User)))
	}
	// Every log line and audit event of the command quotes the request it
	// is for, so one grep follows it from the edge's access line.
	log := w.log
	if id := trace(c); id != "" {
		ctx, log = ident.WithRequestID(ctx, id), log.With("request_id", id)
	}
	// Handshakes talk to tenants' pods, which may answer as slowly as
	// HANDSHAKE_TIMEOUT allows: they hold at most HandshakeWorkers, and
	// the next goes back to the queue, so claims and wakes always find a
	// worker.
	if c.Verb == events.VerbHandshake {
		select {
		case w.handshakeSlots <- struct{}{}:
			defer func() { <-w.handshakeSlots }()
		default:
			w.m.commands.WithLabelValues(string(c.Verb), "busy").Observe(0)
			if d.Last {
				// Its last delivery: answer the waiting edge now, and with
				// a record, so that its next request asks afresh.
				_, err := w.handshakeFailed(ctx, c, state.HandshakeKey(c.User, c.Handshake.PodUID, c.Handshake.Host), errHandshakesBusy)
				return err
			}
			return events.Later(errHandshakesBusy, busyDelay(d.Delivered))
		}
	}
	// One user's commands never hold more than one worker: while one runs
	// (a recreate takes up to RECREATE_TIMEOUT), the next goes back to the
	// queue instead of parking a worker every other user needs.
	unlock, ok := w.locks.tryLock(c.User)
	if !ok {
		w.m.commands.WithLabelValues(string(c.Verb), "busy").Observe(0)
		return events.Later(fmt.Errorf("another command of %s is running", c.User), busyDelay(d.Delivered))
	}
	defer unlock()
	running := w.m.running.WithLabelValues(string(c.Verb))
	running.Inc()
	defer running.Dec()
	log.Debug("command received", "verb", c.Verb, "user", c.User, "seq", d.StreamSeq, "delivered", d.Delivered)

	start := time.Now()
	// A command whose requester already has an answer was done by an
	// earlier delivery; doing it again could undo what followed it (a
	// second recreate would wipe the fresh sandbox).
	if c.RequestID != "" {
		if prev, err := w.requests.Get(ctx, c.RequestID); err == nil && prev.Value.Outcome != state.OutcomeFailed {
			w.m.commands.WithLabelValues(string(c.Verb), "duplicate").Observe(time.Since(start).Seconds())
			log.Info("command already answered", "verb", c.Verb, "user", c.User, "seq", d.StreamSeq, "delivered", d.Delivered)
			return nil
		}
	}
	outcome, err := w.dispatch(ctx, c, d)
	switch {
	case err == nil:
	case events.IsPermanent(err):
		outcome = "failed"
	case events.IsLater(err):
		outcome = "later"
	default:
		outcome = "retry"
	}
	w.m.commands.WithLabelValues(string(c.Verb), outcome).Observe(time.Since(start).Seconds())
	if err != nil && outcome != "later" { // the consumer logs a hand-back
		log.Warn("command failed", "verb", c.Verb, "user", c.User, "seq", d.StreamSeq, "delivered", d.Delivered, "err", err)
	} else {
		log.Info("command done", "verb", c.Verb, "user", c.User, "outcome", outcome, "seq", d.StreamSeq, "delivered", d.Delivered, "took", time.Since(start).Round(time.Millisecond).String())
	}
	return err
}

func (w *Worker) dispatch(ctx context.Context, c events.Command, d events.Delivery) (string, error) {
	switch c.Verb {
	case events.VerbClaim:
		return w.claim(ctx, c)
	case events.VerbWake:
		return w.wake(ctx, c)
	case events.VerbSuspend:
		return w.suspend(ctx, c)
	case events.VerbDelete:
		return w.delete(ctx, c)
	case events.VerbRecreate:
		return w.recreate(ctx, c)
	case events.VerbHandshake:
		return w.handshake(ctx, c, d)
	case events.VerbToken:
		return w.token(ctx, c)
	}
	return "", events.Permanent(fmt.Errorf("unknown verb %q", c.Verb))
}

// Exhausted records a command that will never be handled, and answers its
// requester so nobody waits for it in vain.
//
// Only a valid command on its own subject is attributed to its user and
// answered: anything else may name a victim's user or request id, and is
// recorded under no user with the subject it came on.
func (w *Worker) Exhausted(d events.Delivery, err error) {
	w.m.deadLettered.Inc()
	c, derr := events.Decode[events.Command](d.Data)
	if derr == nil {
		derr = c.Validate()
	}
	if derr != nil || d.Subject != c.Subject() {
		outcome := "exhausted"
		if errors.Is(err, errWrongSubject) || events.IsPermanent(err) {
			outcome = "refused"
		}
		w.pub.Audit(events.AuditEvent{Kind: events.AuditCommandFailed, Outcome: outcome,
			Detail: fmt.Sprintf("message on %s (stream seq %d, %d deliveries): %v", clip(d.Subject), d.StreamSeq, d.Delivered, err)})
		return
	}
	user, verb, req := c.User, c.Verb, c.RequestID
	w.pub.Audit(events.AuditEvent{Kind: events.AuditCommandFailed, User: user, RequestID: trace(c), Outcome: "exhausted",
		Detail: fmt.Sprintf("%s command (stream seq %d, %d deliveries) failed: %v", verb, d.StreamSeq, d.Delivered, err)})
	if req != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = w.answer(ctx, c, state.OutcomeFailed, err.Error())
	}
}

// trace is the request a command is for: the HTTP request that asked
// for it, else (a sweeper's delete) the id its answer goes under.
func trace(c events.Command) string {
	if c.Trace != "" {
		return c.Trace
	}
	return c.RequestID
}

// answer records the outcome of a command its requester waits for.
func (w *Worker) answer(ctx context.Context, c events.Command, outcome, msg string) error {
	if c.RequestID == "" {
		return nil
	}
	_, err := w.requests.Put(ctx, c.RequestID, state.Result{RequestID: c.RequestID, Verb: string(c.Verb), User: c.User, Outcome: outcome, Error: msg, At: time.Now().UTC()})
	return err
}

// kubeErr counts a failed Kubernetes call and passes the error on.
func (w *Worker) kubeErr(op string, err error) error {
	if err != nil && !errors.Is(err, context.Canceled) {
		w.m.kubeErrors.WithLabelValues(op).Inc()
	}
	return err
}

// errWrongSubject marks a command whose body does not match its subject.
var errWrongSubject = errors.New("command body does not match its subject")

// clip bounds a value a publisher chose (a subject, a user name) before it
// goes into an error, a log line or an audit event.
func clip(s string) string {
	const n = 120
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// newerSchemaDelay is how long a command of a newer schema waits before
// another delivery, likely to a newer replica.
const newerSchemaDelay = 15 * time.Second

// busyDelay is when a command for a user whose other command is running
// comes back: soon, then less often.
func busyDelay(delivered uint64) time.Duration {
	return min(time.Duration(delivered)*time.Second, 10*time.Second)
}

// keyedMutex serialises commands for one user inside this process.
type keyedMutex struct {
	mu   sync.Mutex
	busy map[string]bool
}

// tryLock marks key busy unless it already is.
func (k *keyedMutex) tryLock(key string) (unlock func(), ok bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.busy[key] {
		return nil, false
	}
	if k.busy == nil {
		k.busy = map[string]bool{}
	}
	k.busy[key] = true
	return func() {
		k.mu.Lock()
		delete(k.busy, key)
		k.mu.Unlock()
	}, true
}
