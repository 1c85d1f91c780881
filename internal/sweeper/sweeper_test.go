package sweeper_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsconn"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/sweeper"
)

var quiet = slog.New(slog.DiscardHandler)

const idleTimeout = time.Minute

type world struct {
	t     testing.TB
	js    jetstream.JetStream
	pub   *events.Publisher
	boxes *kv.Bucket[state.Sandbox]
	now   time.Time
	// reg holds the metrics of the sweeper started last.
	reg *prometheus.Registry
}

func setup(t testing.TB) *world {
	t.Helper()
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 10*time.Minute)
	if err := natsconn.Provision(ctx, js, events.DefaultStreamsConfig(), state.DefaultBucketsConfig(), events.CommandConsumerConfig(1, 5, 30*time.Second), slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	boxes, err := kv.Open[state.Sandbox](ctx, js, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	return &world{t: t, js: js, pub: events.NewPublisher(js, "edge-a", quiet), boxes: boxes, now: time.Now()}
}

func (w *world) sweeper() *sweeper.Sweeper {
	w.t.Helper()
	return w.sweeperWith(idle.Policy{IdleTimeout: idleTimeout})
}

func (w *world) sweeperWith(p idle.Policy) *sweeper.Sweeper {
	w.t.Helper()
	return w.sweeperOf(sweeper.Options{Policy: p})
}

// sweeperOf is a ready sweeper of o, with the world's bus, an hour's
// interval (the tests sweep themselves) and a registry of its own.
func (w *world) sweeperOf(o sweeper.Options) *sweeper.Sweeper {
	w.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w.t.Cleanup(cancel)
	w.reg = prometheus.NewRegistry()
	o.JS, o.Publisher, o.Interval, o.Log, o.Metrics = w.js, events.NewPublisher(w.js, "sweeper", quiet), time.Hour, quiet, w.reg
	s, err := sweeper.New(ctx, o)
	if err != nil {
		w.t.Fatal(err)
	}
	go func() { _ = s.Follow(ctx) }()
	testutil.Eventually(w.t, 60*time.Second, func() error {
		if !s.Ready() {
			return fmt.Errorf("not ready")
		}
		return nil
	})
	return s
}

func (w *world) sandbox(user string, phase state.Phase, managed bool, readySince time.Time) {
	w.t.Helper()
	if _, err := w.boxes.Put(context.Background(), user, state.Sandbox{User: user, Phase: phase, Managed: managed, ReadySince: readySince}); err != nil {
		w.t.Fatal(err)
	}
}

// beacon publishes, now, what an edge reports: work in flight, and its last
// activity that long ago (the sweeper counts back from the stream's time;
// the edge's own clock plays no part). ttl is how long inFlight holds.
func (w *world) beacon(user, edge string, inFlight int, idleFor, ttl time.Duration) uint64 {
	w.t.Helper()
	f, err := w.pub.Beacon(events.Beacon{User: user, Edge: edge, InFlight: inFlight, LastActive: w.now.Add(-idleFor), SentAt: w.now, TTL: ttl})
	if err != nil {
		w.t.Fatal(err)
	}
	select {
	case a := <-f.Ok():
		return a.Sequence
	case err := <-f.Err():
		w.t.Fatal(err)
	}
	return 0
}

// suspends lists the suspend commands waiting in the work queue.
func (w *world) suspends() map[string]events.Command { return w.commands(events.VerbSuspend) }

// audit is every audit event so far, as "<kind> <user> <outcome>".
func (w *world) audit() []string {
	var out []string
	w.each(events.StreamAudit, func(data []byte) {
		if e, err := events.Decode[events.AuditEvent](data); err == nil {
			out = append(out, fmt.Sprintf("%s %s %s", e.Kind, e.User, e.Outcome))
		}
	})
	return out
}

// commands lists the commands of verb waiting in the work queue, by user.
func (w *world) commands(verb events.Verb) map[string]events.Command {
	out := map[string]events.Command{}
	w.each(events.StreamCommands, func(data []byte) {
		if c, err := events.Decode[events.Command](data); err == nil && c.Verb == verb {
			out[c.User] = c
		}
	})
	return out
}

// each passes fn every message stream holds, oldest first.
func (w *world) each(stream string, fn func(data []byte)) {
	w.t.Helper()
	ctx := natstest.Context(w.t, time.Minute)
	s, err := w.js.Stream(ctx, stream)
	if err != nil {
		w.t.Fatal(err)
	}
	info, _ := s.Info(ctx)
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		if m, err := s.GetMsg(ctx, seq); err == nil {
			fn(m.Data)
		}
	}
}

// gauge is the value of the sweeper's metric name.
// gauge is the value of the gauge or counter name.
func (w *world) gauge(name string) float64 {
	w.t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		w.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			if c := mf.GetMetric()[0].GetCounter(); c != nil {
				return c.GetValue()
			}
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	w.t.Fatalf("no gauge or counter %s", name)
	return 0
}

func TestDecisions(t *testing.T) {
	w := setup(t)
	long := w.now.Add(-2 * idleTimeout)
	w.sandbox("idle", state.PhaseReady, true, long)
	seq := w.beacon("idle", "edge-a", 0, 2*idleTimeout, time.Second)
	w.sandbox("busy", state.PhaseReady, true, long)
	w.beacon("busy", "edge-a", 1, 2*idleTimeout, 3*idleTimeout) // a WebSocket open, heartbeating
	w.sandbox("dead-edge", state.PhaseReady, true, long)
	w.beacon("dead-edge", "edge-b", 1, 2*idleTimeout, time.Second) // in flight, but the edge stops reporting
	w.sandbox("other-edge-busy", state.PhaseReady, true, long)
	w.beacon("other-edge-busy", "edge-a", 0, 2*idleTimeout, time.Second)
	w.beacon("other-edge-busy", "edge-b", 2, 2*idleTimeout, 3*idleTimeout)
	w.sandbox("recent", state.PhaseReady, true, long)
	w.beacon("recent", "edge-a", 0, idleTimeout/2, time.Second)
	w.sandbox("just-woken", state.PhaseReady, true, w.now.Add(-time.Second)) // no beacons at all
	w.sandbox("unmanaged", state.PhaseReady, false, long)
	w.sandbox("asleep", state.PhaseSuspended, true, long)
	w.sandbox("never-used", state.PhaseReady, true, long)

	s := w.sweeper()
	sweep := func(at time.Time, want string) map[string]events.Command {
		t.Helper()
		s.Sweep(context.Background(), at)
		got := w.suspends()
		var users []string
		for u := range got {
			users = append(users, u)
		}
		sort.Strings(users)
		if fmt.Sprint(users) != want {
			t.Fatalf("at now+%s suspended %v, want %s", at.Sub(w.now), users, want)
		}
		return got
	}
	got := sweep(w.now.Add(5*time.Second), "[idle never-used]")
	if got["idle"].Suspend.ActivitySeq != seq {
		t.Fatalf("suspend carries activity seq %d, want %d", got["idle"].Suspend.ActivitySeq, seq)
	}
	if got["idle"].Suspend.IdleSince.Sub(long).Abs() > time.Second {
		t.Fatalf("idle since %s, want %s", got["idle"].Suspend.IdleSince, long)
	}
	// Sweeping again issues nothing new.
	sweep(w.now.Add(5*time.Second), "[idle never-used]")
	// An edge that stopped reporting stops pinning its user after the
	// beacon's TTL: idleTimeout a whole timeout after its last beacon.
	sweep(w.now.Add(idleTimeout+5*time.Second), "[dead-edge idle just-woken never-used recent]")
}

// Every decision carries its reason; MAX_RUNTIME suspends a busy sandbox;
// a keep-awake holds off both idleness and the ceiling until it ends, and
// no longer.
func TestReasonsCeilingAndKeepAwake(t *testing.T) {
	w := setup(t)
	long := w.now.Add(-2 * idleTimeout)
	w.sandbox("plain", state.PhaseReady, true, long)
	w.beacon("plain", "edge-a", 0, 2*idleTimeout, time.Second)
	w.sandbox("forgotten", state.PhaseReady, true, long)
	if _, err := w.pub.Beacon(events.Beacon{User: "forgotten", Edge: "edge-a", IdleStreams: 1, LastActive: long, SentAt: w.now, TTL: 3 * idleTimeout}); err != nil {
		t.Fatal(err)
	}
	w.sandbox("marathon", state.PhaseReady, true, w.now.Add(-3*time.Hour))
	w.beacon("marathon", "edge-a", 1, 0, 3*idleTimeout) // a model call running
	w.sandbox("kept", state.PhaseReady, true, long)
	w.beacon("kept", "edge-a", 0, 2*idleTimeout, time.Second)
	w.sandbox("kept-marathon", state.PhaseReady, true, w.now.Add(-3*time.Hour))
	w.beacon("kept-marathon", "edge-a", 1, 0, 3*idleTimeout)
	awake, err := kv.Open[state.KeepAwake](context.Background(), w.js, state.BucketKeepAwake)
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{"kept", "kept-marathon"} {
		if _, err := awake.Put(context.Background(), u, state.KeepAwake{Until: w.now.Add(30 * time.Second), At: w.now}); err != nil {
			t.Fatal(err)
		}
	}
	s := w.sweeperWith(idle.Policy{IdleTimeout: idleTimeout, MaxRuntime: 2 * time.Hour})
	reasons := func(at time.Time) map[string]string {
		s.Sweep(context.Background(), at)
		out := map[string]string{}
		for u, c := range w.suspends() {
			out[u] = c.Suspend.Reason
		}
		return out
	}
	want := map[string]string{"plain": "idle", "forgotten": "idle_connected", "marathon": "max_runtime"}
	if got := reasons(w.now.Add(5 * time.Second)); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("suspended %v, want %v (the kept-awake ones held)", got, want)
	}
	want["kept"], want["kept-marathon"] = "idle", "max_runtime"
	if got := reasons(w.now.Add(31 * time.Second)); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after the keep-awake ended: suspended %v, want %v", got, want)
	}
}

// A profile's idle_timeout and max_runtime are its sandboxes' rule, in
// the same sweep as the default's: a sandbox of a quick profile sleeps
// after its shorter timeout while the default's sandbox idle as long
// stays up, and a profile's ceiling suspends its busy sandbox while the
// default's (none) leaves one as busy alone. A record of a profile
// PROFILES no longer lists is judged by the default's rule.
func TestAProfileHasItsOwnIdleRule(t *testing.T) {
	w := setup(t)
	ready := func(user, profile string, readySince time.Time) {
		t.Helper()
		if _, err := w.boxes.Put(context.Background(), user, state.Sandbox{User: user, Phase: state.PhaseReady, Managed: true, ReadySince: readySince, Profile: profile}); err != nil {
			t.Fatal(err)
		}
	}
	long := w.now.Add(-3 * time.Hour)
	ready("quick", "quick", long)
	ready("plain", "", long)
	ready("removed", "gone", long)
	for _, u := range []string{"quick", "plain", "removed"} {
		w.beacon(u, "edge-a", 0, idleTimeout/2, time.Second)
	}
	ready("marathon", "marathon", long)
	ready("plain-busy", "", long)
	for _, u := range []string{"marathon", "plain-busy"} {
		w.beacon(u, "edge-a", 1, 0, 3*idleTimeout)
	}
	s := w.sweeperOf(sweeper.Options{Policy: idle.Policy{IdleTimeout: idleTimeout}, Profiles: config.Profiles{
		{Name: "small", WarmPool: "p"},
		{Name: "quick", WarmPool: "p", IdleTimeout: config.Duration(idleTimeout / 4)},
		{Name: "marathon", WarmPool: "p", MaxRuntime: config.Duration(2 * time.Hour)},
	}})
	s.Sweep(context.Background(), w.now.Add(time.Second))
	got := map[string]string{}
	for u, c := range w.suspends() {
		got[u] = c.Suspend.Reason + ": " + c.Suspend.Detail
	}
	want := map[string]string{"quick": "idle: it was idle for 15 seconds", "marathon": "max_runtime: it had been running for 2 hours, the longest this gateway allows without a keep-awake"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("suspended %v, want %v", got, want)
	}
}

// An account whose managed sandbox has slept DORMANT_AFTER is audited
// dormant once; DORMANT_DELETE_AFTER later its deletion is asked for,
// once. A sandbox applied by hand, asleep as long, is never asked about.
func TestDormantAccountsAreMarkedThenDeleted(t *testing.T) {
	w := setup(t)
	put := func(user string, managed bool, asleep time.Time) {
		if _, err := w.boxes.Put(context.Background(), user, state.Sandbox{User: user, Phase: state.PhaseSuspended, Managed: managed,
			LastSuspend: &state.Suspension{At: asleep, Reason: "idle"}}); err != nil {
			t.Fatal(err)
		}
	}
	put("sleeper", true, w.now.Add(-3*time.Hour))
	put("napper", true, w.now.Add(-90*time.Minute))
	put("hand", false, w.now.Add(-3*time.Hour))
	put("fresh", true, w.now.Add(-time.Minute))
	w.sandbox("awake", state.PhaseReady, true, w.now.Add(-3*time.Hour))
	s := w.sweeperWith(idle.Policy{IdleTimeout: idleTimeout, DormantAfter: time.Hour, DormantDeleteAfter: time.Hour})
	s.Sweep(context.Background(), w.now)
	s.Sweep(context.Background(), w.now.Add(time.Second))
	deletes := w.commands(events.VerbDelete)
	if _, ok := deletes["sleeper"]; len(deletes) != 1 || !ok {
		t.Fatalf("deletions asked %v, want sleeper's only", deletes)
	}
	// Audit events are published asynchronously: poll until all have
	// landed, then check no more than the expected ones did.
	testutil.Eventually(t, 30*time.Second, func() error {
		var dormancy []string
		for _, a := range w.audit() {
			if strings.HasPrefix(a, "dormant ") {
				dormancy = append(dormancy, a)
			}
		}
		sort.Strings(dormancy)
		if want := "[dormant napper dormant dormant sleeper deleting dormant sleeper dormant]"; fmt.Sprint(dormancy) != want {
			return fmt.Errorf("audited %v, want %s", dormancy, want)
		}
		return nil
	})
}

func TestClocksSurviveARestart(t *testing.T) {
	w := setup(t)
	long := w.now.Add(-2 * idleTimeout)
	w.sandbox("a", state.PhaseReady, true, long)
	w.beacon("a", "edge-a", 0, idleTimeout/2, time.Second)
	first := w.sweeper()
	first.Sweep(context.Background(), w.now)
	if len(w.suspends()) != 0 {
		t.Fatal("suspended a user active half an idleTimeout timeout ago")
	}
	// A new sweeper (the old one restarted, or a standby) knows the same
	// clock: at now+idleTimeout/2 the user has been idleTimeout a whole timeout.
	second := w.sweeper()
	second.Sweep(context.Background(), w.now.Add(idleTimeout/2+time.Second))
	if _, ok := w.suspends()["a"]; !ok {
		t.Fatal("the restarted sweeper lost the idleTimeout clock")
	}
}

// A user whose sandbox is deleted behind the sweeper's back loses its idle
// clock once the clocks outnumber the sandboxes and the clock can decide
// nothing any more (its beacons older than their TTL and IDLE_TIMEOUT):
// aaas_sweeper_users_tracked drops, and a sandbox of the same name made
// later is judged without that user's old activity, while another user's
// clock stays and still decides for it.
func TestSweepsForgetTheClocksOfDeletedSandboxes(t *testing.T) {
	w := setup(t)
	ctx := natstest.Context(t, time.Minute)
	long := w.now.Add(-2 * idleTimeout)
	w.sandbox("gone", state.PhaseReady, true, long)
	w.beacon("gone", "edge-a", 0, idleTimeout/2, time.Second) // active half an idleTimeout timeout ago
	w.sandbox("kept", state.PhaseReady, true, long)
	w.beacon("kept", "edge-a", 1, 2*idleTimeout, 3*idleTimeout) // a WebSocket open
	s := w.sweeper()
	s.Sweep(ctx, w.now)
	if n := w.gauge("aaas_sweeper_users_tracked"); n != 2 {
		t.Fatalf("%v users tracked, want 2", n)
	}
	if got := w.suspends(); len(got) != 0 {
		t.Fatalf("suspended users active half an idleTimeout timeout ago or busy: %v", got)
	}

	if err := w.boxes.Delete(ctx, "gone", 0); err != nil {
		t.Fatal(err)
	}
	ready := func() float64 {
		mfs, _ := w.reg.Gather()
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				if mf.GetName() == "aaas_sweeper_cached_sandboxes" {
					return m.GetGauge().GetValue()
				}
			}
		}
		return -1
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if n := ready(); n != 1 {
			return fmt.Errorf("the sweeper's cache holds %v sandboxes, want 1", n)
		}
		return nil
	})
	// Its sandbox is gone, but the clock could still decide (active within
	// IDLE_TIMEOUT): it stays.
	s.Sweep(ctx, w.now)
	if n := w.gauge("aaas_sweeper_users_tracked"); n != 2 {
		t.Fatalf("%v users tracked right after the deletion, want 2 (the clock can still decide)", n)
	}
	// An idleTimeout timeout later it can decide nothing: forgotten.
	later := w.now.Add(idleTimeout + 5*time.Second) // the stream stamped the beacon a moment after w.now
	s.Sweep(ctx, later)
	if n := w.gauge("aaas_sweeper_users_tracked"); n != 1 {
		t.Fatalf("%v users tracked, want 1", n)
	}
	// The kept clock still decides: judged by its sandbox's Ready time
	// alone, kept would be idleTimeout for three timeouts.
	if got := w.suspends(); len(got) != 0 {
		t.Fatalf("kept lost its clock: suspended %v", got)
	}
	// The forgotten one is gone for good: a sandbox of that name now is
	// judged by its Ready time, its old activity unknown.
	w.sandbox("gone", state.PhaseReady, true, long)
	testutil.Eventually(t, 30*time.Second, func() error {
		s.Sweep(ctx, later)
		if _, ok := w.suspends()["gone"]; !ok {
			return errors.New("the new sandbox named gone is not suspended: its old clock is still there, or the sweeper has not seen it")
		}
		return nil
	})
	if got := w.suspends(); len(got) != 1 {
		t.Fatalf("suspended %v, want gone only", got)
	}
}

// A beacon read before its sandbox (the activity stream and the sandboxes
// bucket are read apart; either can lag) is kept while the clocks
// outnumber the sandboxes, so that when the sandbox shows up, Ready since
// long ago, a busy user is not suspended and a recently active one not
// before its IDLE_TIMEOUT. The positive control: a user with no beacon at
// all, Ready as long, is suspended in the same sweep.
func TestBeaconsBeforeTheirSandboxStillDecide(t *testing.T) {
	w := setup(t)
	ctx := natstest.Context(t, time.Minute)
	long := w.now.Add(-2 * idleTimeout)
	w.beacon("busy", "edge-a", 1, 2*idleTimeout, 3*idleTimeout)
	w.beacon("recent", "edge-a", 0, idleTimeout/2, time.Second)
	s := w.sweeper()
	s.Sweep(ctx, w.now) // no sandboxes yet: the clocks outnumber them
	for _, u := range []string{"busy", "recent", "never-used"} {
		w.sandbox(u, state.PhaseReady, true, long)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		s.Sweep(ctx, w.now.Add(time.Second))
		if _, ok := w.suspends()["never-used"]; !ok {
			return errors.New("never-used not suspended yet: the sweeper has not seen the sandboxes")
		}
		return nil
	})
	if got := w.suspends(); len(got) != 1 {
		t.Fatalf("suspended %v, want never-used only", got)
	}
}

// BenchmarkSweep100k measures, for 100k users with beacons from two
// edges: rebuilding the clocks from the stream after a restart, the first
// sweep (every sandbox changed since the sweeper started: a takeover's),
// a steady tick (nothing changed or due: the timetables look at nobody),
// and the memory the clocks take.
func BenchmarkSweep100k(b *testing.B) {
	const users = 100_000
	w := setup(b)
	long := w.now.Add(-2 * idleTimeout)
	ctx := context.Background()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := 0; i < users; i++ {
		u := fmt.Sprintf("u%d", i)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			_, _ = w.boxes.Put(ctx, u, state.Sandbox{User: u, Phase: state.PhaseReady, Managed: true, ReadySince: long})
		}()
		for _, e := range []string{"edge-a", "edge-b"} {
			if _, err := w.pub.Beacon(events.Beacon{User: u, Edge: e, InFlight: i % 2, LastActive: w.now, SentAt: w.now, TTL: time.Hour}); err != nil {
				b.Fatal(err)
			}
		}
	}
	wg.Wait()
	<-w.js.PublishAsyncComplete()

	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	start := time.Now()
	s := w.sweeper()
	catchUp := time.Since(start)
	runtime.GC()
	runtime.ReadMemStats(&m1)

	start = time.Now()
	s.Sweep(ctx, w.now)
	first := time.Since(start)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s.Sweep(ctx, w.now.Add(time.Duration(i+1)*time.Nanosecond))
	}
	b.StopTimer()
	b.ReportMetric(catchUp.Seconds(), "catchup-s")
	b.ReportMetric(float64(first.Milliseconds()), "first-tick-ms")
	b.ReportMetric(float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc))/(1<<20), "heap-MiB")
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "tick-µs")
}

// The inventory (aaas_users, aaas_sandboxes) comes from the active
// sweeper only, so that a sum over replicas is the count; every replica
// says how much of the sandboxes bucket its own copy holds.
func TestOnlyTheLeaderExportsTheInventory(t *testing.T) {
	w := setup(t)
	w.sandbox("a", state.PhaseReady, true, w.now)
	s := w.sweeper()
	exported := func(name string) bool {
		mfs, err := w.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				return true
			}
		}
		return false
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if n := w.gauge("aaas_sweeper_cached_sandboxes"); n != 1 {
			return fmt.Errorf("%v sandboxes cached, want 1", n)
		}
		return nil
	})
	if exported("aaas_users") || exported("aaas_sandboxes") {
		t.Fatal("a standby exports the inventory")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Lead(ctx) }()
	testutil.Eventually(t, 30*time.Second, func() error {
		if !exported("aaas_users") || !exported("aaas_sandboxes") {
			return fmt.Errorf("the leader exports no inventory")
		}
		return nil
	})
	// The count by phase follows changes, each taking back what it
	// replaced: a moves on, b comes and goes, c stays.
	w.sandbox("c", state.PhaseReady, true, w.now)
	w.sandbox("b", state.PhaseWaking, true, w.now)
	w.sandbox("a", state.PhaseSuspending, true, w.now)
	w.sandbox("a", state.PhaseSuspended, true, w.now)
	if err := w.boxes.Delete(context.Background(), "b", 0); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		mfs, err := w.reg.Gather()
		if err != nil {
			return err
		}
		got := map[string]float64{}
		for _, mf := range mfs {
			if mf.GetName() == "aaas_sandboxes" {
				for _, m := range mf.GetMetric() {
					if v := m.GetGauge().GetValue(); v != 0 {
						got[m.GetLabel()[0].GetValue()] = v
					}
				}
			}
		}
		if fmt.Sprint(got) != "map[Ready:1 Suspended:1]" {
			return fmt.Errorf("aaas_sandboxes by phase %v, want Ready 1 and Suspended 1", got)
		}
		return nil
	})
	cancel()
	<-done
	if exported("aaas_users") || exported("aaas_sandboxes") {
		t.Fatal("a sweeper that stepped down still exports the inventory")
	}
}

// A sweep decides for the sandboxes whose time has come or that changed,
// not for every sandbox (issue 28): after the first sweep looks at all, one
// with nothing due looks at none; a keep-awake set is one look; a sandbox
// falling due, and one whose work in flight ends (its beacon expires), are
// looked at then, and suspended when due, as before.
func TestSweepsDecideOnlyForWhatFellDueOrChanged(t *testing.T) {
	w := setup(t)
	const quiet = 200
	for i := range quiet {
		u := fmt.Sprintf("u%d", i)
		w.sandbox(u, state.PhaseReady, true, w.now.Add(-time.Hour))
		w.beacon(u, "edge-a", 0, 0, time.Second) // active just now
	}
	w.sandbox("soon", state.PhaseReady, true, w.now.Add(-time.Hour))
	w.beacon("soon", "edge-a", 0, idleTimeout-10*time.Second, time.Second)
	w.sandbox("worker", state.PhaseReady, true, w.now.Add(-time.Hour))
	w.beacon("worker", "edge-a", 1, 2*idleTimeout, 30*time.Second) // a call in flight
	w.sandbox("streamer", state.PhaseReady, true, w.now.Add(-time.Hour))
	w.beacon("streamer", "edge-a", 1, 2*idleTimeout, 10*time.Minute) // a socket open, pinned for long
	s := w.sweeper()
	decided := func(at time.Duration, want float64) {
		t.Helper()
		before := w.gauge("aaas_sweeper_decisions_total")
		s.Sweep(context.Background(), w.now.Add(at))
		if got := w.gauge("aaas_sweeper_decisions_total") - before; got != want {
			t.Fatalf("the sweep at now+%s decided for %v sandboxes, want %v", at, got, want)
		}
	}
	decided(time.Second, quiet+3)
	decided(2*time.Second, 0)
	if len(w.suspends()) != 0 {
		t.Fatalf("suspended %v with nothing due", w.suspends())
	}

	// A keep-awake changes a deadline: that sandbox, and no other.
	awake := testutil.Open[state.KeepAwake](t, w.js, state.BucketKeepAwake)
	if _, err := awake.Put(context.Background(), "u7", state.KeepAwake{Until: w.now.Add(time.Hour), At: w.now}); err != nil {
		t.Fatal(err)
	}
	start := w.gauge("aaas_sweeper_decisions_total")
	testutil.Eventually(t, 30*time.Second, func() error {
		s.Sweep(context.Background(), w.now.Add(3*time.Second))
		if n := w.gauge("aaas_sweeper_decisions_total") - start; n != 1 {
			return fmt.Errorf("%v decisions since the keep-awake", n)
		}
		return nil
	})
	decided(4*time.Second, 0)

	// The positive control: soon falls due and is suspended; then it is
	// looked at every round until lifecycle's suspend changes its record,
	// and worker when its beacon of work in flight expires.
	decided(11*time.Second, 1)
	if got := w.suspends(); len(got) != 1 || got["soon"].User != "soon" {
		t.Fatalf("suspended %v, want soon", got)
	}
	decided(31*time.Second, 2)
	if got := w.suspends(); len(got) != 1 {
		t.Fatalf("suspended %v, want soon only (worker's work ended just now)", got)
	}

	// Work that ends before its beacon's TTL says so with a beacon of
	// nothing in flight: its work counted as activity until then, so it
	// falls due an idle timeout after; that beacon brings the look that
	// finds so, not the old beacon's expiry ten minutes on.
	w.beacon("streamer", "edge-a", 0, 2*idleTimeout, time.Second)
	testutil.Eventually(t, 30*time.Second, func() error {
		s.Sweep(context.Background(), w.now.Add(idleTimeout+time.Second))
		if _, ok := w.suspends()["streamer"]; !ok {
			return fmt.Errorf("streamer not suspended after its work ended (%d others are)", len(w.suspends()))
		}
		return nil
	})
}
