package events_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/jsconfig"
	"github.com/aaas-project/aaas/internal/natsconn"
)

var quiet = slog.New(slog.DiscardHandler)

func setup(t *testing.T) (string, jetstream.JetStream) {
	t.Helper()
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	if err := events.EnsureStreams(natstest.Context(t, 10*time.Second), js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	return s.URL(), js
}

func TestEnsureStreamsIsIdempotentAndUpdates(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	cfg := events.DefaultStreamsConfig()
	cfg.AuditMaxAge = 48 * time.Hour
	if err := events.EnsureStreams(ctx, js, cfg); err != nil {
		t.Fatalf("second ensure: %v", err)
	}
	s, err := js.Stream(ctx, events.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.CachedInfo().Config.MaxAge; got != 48*time.Hour {
		t.Fatalf("audit max age = %s, want the updated 48h", got)
	}
	cmd, _ := js.Stream(ctx, events.StreamCommands)
	if cmd.CachedInfo().Config.Retention != jetstream.WorkQueuePolicy {
		t.Fatal("commands stream is not a work queue")
	}
	act, _ := js.Stream(ctx, events.StreamActivity)
	if act.CachedInfo().Config.MaxMsgsPerSubject != 1 {
		t.Fatal("activity stream does not keep only the last message per subject")
	}
	// What the server reports back already holds what we asked for, so the
	// next process to start leaves the streams alone; a changed setting
	// does not hold and is applied.
	for i, sc := range events.StreamConfigs(cfg) {
		s, err := js.Stream(ctx, sc.Name)
		if err != nil {
			t.Fatal(err)
		}
		if !jsconfig.Holds(s.CachedInfo().Config, sc) {
			t.Errorf("stream %s would be updated on every start", sc.Name)
		}
		if sc.Name == events.StreamAudit && jsconfig.Holds(s.CachedInfo().Config, events.StreamConfigs(events.DefaultStreamsConfig())[i]) {
			t.Error("a changed audit retention is not seen as a change")
		}
	}
}

func TestDuplicateCommandIsDeliveredOnce(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 20*time.Second)
	pub := events.NewPublisher(js, "edge-a", quiet)
	pub2 := events.NewPublisher(js, "edge-b", quiet)

	// Two edges that saw the same state ask for the same wake.
	if dup, err := pub.Command(ctx, events.NewWake("bob", 7)); err != nil || dup {
		t.Fatalf("first publish: dup=%v err=%v", dup, err)
	}
	if dup, err := pub2.Command(ctx, events.NewWake("bob", 7)); err != nil || !dup {
		t.Fatalf("second publish: dup=%v err=%v, want a collapsed duplicate", dup, err)
	}
	// A wake after a later state change is a new command.
	if dup, err := pub.Command(ctx, events.NewWake("bob", 9)); err != nil || dup {
		t.Fatalf("wake at a new revision: dup=%v err=%v", dup, err)
	}

	var mu sync.Mutex
	var got []string
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = consume(cctx, js, events.ConsumerConfig{Stream: events.StreamCommands, Durable: "w"}, func(_ context.Context, d events.Delivery) error {
			c, err := events.Decode[events.Command](d.Data)
			if err != nil {
				return events.Permanent(err)
			}
			mu.Lock()
			got = append(got, c.ID)
			mu.Unlock()
			return nil
		}, func(events.Delivery, error) {}, quiet)
	}()
	testutil.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(got) < 2 {
			return fmt.Errorf("got %v", got)
		}
		return nil
	})
	// Give a stray duplicate every chance to show up: the stream must be empty.
	testutil.Eventually(t, 5*time.Second, func() error {
		s, _ := js.Stream(ctx, events.StreamCommands)
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.Msgs != 0 {
			return fmt.Errorf("%d messages still queued", info.State.Msgs)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 2 || got[0] != "wake.bob.7" || got[1] != "wake.bob.9" {
		t.Fatalf("deliveries = %v, want exactly wake.bob.7 then wake.bob.9", got)
	}
}

// TestConcurrentDuplicatesOnAClusteredStream publishes one command from
// many edges at once to an R3 stream. While the first copy is being
// replicated the stream answers the others "duplicate message id is in
// process" (409, 10158); each must still end as a collapsed duplicate,
// never an error the browser would see.
func TestConcurrentDuplicatesOnAClusteredStream(t *testing.T) {
	c := natstest.StartCluster(t, 3, embednats.Options{})
	_, js := natstest.Connect(t, c.URLs())
	ctx := natstest.Context(t, 60*time.Second)
	cfg := events.DefaultStreamsConfig()
	cfg.Replicas = 3
	natstest.Provision(t, ctx, func(ctx context.Context) error { return events.EnsureStreams(ctx, js, cfg) })
	// A stream just created answers no publish until its replicas have
	// elected a leader, which a loaded machine may take seconds over (a
	// clean-clone make test saw "no response from stream" in the first
	// rounds): this test is about the duplicates' race, not the election.
	commandsLeader(t, ctx, js)
	// Half publish raw, to see the race; half as the edges do, through
	// natsconn's connection, which rides out a leader election (under load
	// the stream's leader can move mid-test: "no response from stream" is
	// the election's, not the race's, and edges never show it either).
	conns := make([]jetstream.JetStream, 24)
	for i := range conns {
		if i%2 == 0 {
			_, conns[i] = natstest.Connect(t, c.Nodes[i%3].URL())
			continue
		}
		nc, js, err := natsconn.Connect(ctx, natsconn.Options{URL: c.Nodes[i%3].URL(), Name: fmt.Sprintf("edge-%d", i), FailoverWait: 20 * time.Second}, quiet)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		conns[i] = js
	}
	inProcess := 0
	for round := range 30 {
		cmd := events.NewWake("bob", uint64(round+1))
		// The raw publish shows whether this round hit the race at all.
		var wg sync.WaitGroup
		var mu sync.Mutex
		stored, dups := 0, 0
		for i, pjs := range conns {
			pub := events.NewPublisher(pjs, fmt.Sprintf("edge-%d", i), quiet)
			wg.Go(func() {
				if i%2 == 0 {
					data, _ := json.Marshal(cmd)
					_, err := pjs.PublishMsg(ctx, &nats.Msg{Subject: cmd.Subject(), Data: data}, jetstream.WithMsgID(cmd.ID))
					var apiErr *jetstream.APIError
					mu.Lock()
					defer mu.Unlock()
					if errors.As(err, &apiErr) && apiErr.ErrorCode == 10158 {
						inProcess++
					}
					return
				}
				dup, err := pub.Command(ctx, cmd)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
					t.Errorf("round %d: %v", round, err)
				case dup:
					dups++
				default:
					stored++
				}
			})
		}
		wg.Wait()
		if stored > 1 {
			t.Errorf("round %d: the command was stored %d times", round, stored)
		}
	}
	// The raw publishes prove the race was there to be handled.
	if inProcess == 0 {
		t.Fatal("no raw publish was answered \"in process\": the test did not reach the race it is about")
	}
	t.Logf("raw publishes answered \"in process\": %d of %d", inProcess, 30*len(conns)/2)
}

func TestWorkQueueHandsEachCommandToExactlyOneOfThreeConsumers(t *testing.T) {
	url, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	const n = 90
	pub := events.NewPublisher(js, "edge", quiet)
	for i := 0; i < n; i++ {
		if _, err := pub.Command(ctx, events.NewDelete(fmt.Sprintf("u%d", i), fmt.Sprintf("r%d", i))); err != nil {
			t.Fatal(err)
		}
	}

	var mu sync.Mutex
	seen := map[string]int{}
	perWorker := map[int]int{}
	// Until two consumers have each handled a command, every handler
	// holds its command: whichever consumer starts first cannot drain the
	// queue alone, and the queue must hand the rest to the others (the
	// consumer's MaxAckPending bounds what one can hold). Then all run.
	shared := make(chan struct{})
	var once sync.Once
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for w := 0; w < 3; w++ {
		_, wjs := natstest.Connect(t, url) // a separate process in spirit: own connection
		go func(w int) {
			_ = consume(cctx, wjs, events.ConsumerConfig{Stream: events.StreamCommands, Durable: "lifecycle", Workers: 2}, func(_ context.Context, d events.Delivery) error {
				mu.Lock()
				seen[d.Subject]++
				perWorker[w]++
				if len(perWorker) >= 2 {
					once.Do(func() { close(shared) })
				}
				mu.Unlock()
				select {
				case <-shared:
				case <-cctx.Done():
				}
				return nil
			}, func(events.Delivery, error) {}, quiet)
		}(w)
	}
	testutil.Eventually(t, 20*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(seen) != n {
			return fmt.Errorf("%d of %d commands handled", len(seen), n)
		}
		return nil
	})
	cancel()
	mu.Lock()
	defer mu.Unlock()
	for subj, c := range seen {
		if c != 1 {
			t.Errorf("%s handled %d times", subj, c)
		}
	}
	busy := 0
	for _, c := range perWorker {
		if c > 0 {
			busy++
		}
	}
	if busy < 2 {
		t.Errorf("work was not shared: per consumer %v", perWorker)
	}
}

func TestUnackedCommandIsRedeliveredToAnotherConsumerAndExhaustionIsRecorded(t *testing.T) {
	url, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	cfg := events.ConsumerConfig{
		Stream: events.StreamCommands, Durable: "lifecycle",
		MaxDeliver: 3, AckWait: 500 * time.Millisecond,
		Backoff: []time.Duration{100 * time.Millisecond},
	}
	if _, err := events.EnsureConsumer(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	pub := events.NewPublisher(js, "edge", quiet)
	if _, err := pub.Command(ctx, events.NewDelete("carol", "req-1")); err != nil {
		t.Fatal(err)
	}

	// Worker A takes the command and dies without acknowledging it.
	anc, ajs := natstest.Connect(t, url)
	acons, err := ajs.Consumer(ctx, events.StreamCommands, "lifecycle")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := acons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var taken int
	for range batch.Messages() {
		taken++
	}
	if taken != 1 {
		t.Fatalf("worker A took %d messages", taken)
	}
	anc.Close()

	// Worker B gets it again, fails every time, and the last failure is
	// recorded before the command is dropped.
	var mu sync.Mutex
	var deliveries []uint64
	var exhausted []error
	_, bjs := natstest.Connect(t, url)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = consume(cctx, bjs, cfg, func(_ context.Context, d events.Delivery) error {
			mu.Lock()
			deliveries = append(deliveries, d.Delivered)
			mu.Unlock()
			return errors.New("kubernetes unavailable")
		}, func(d events.Delivery, err error) {
			mu.Lock()
			exhausted = append(exhausted, err)
			mu.Unlock()
		}, quiet)
	}()
	testutil.Eventually(t, 15*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(exhausted) != 1 {
			return fmt.Errorf("deliveries %v, exhausted %v", deliveries, exhausted)
		}
		return nil
	})
	mu.Lock()
	if len(deliveries) != 2 || deliveries[0] != 2 || deliveries[1] != 3 {
		t.Fatalf("worker B saw deliveries %v, want [2 3]", deliveries)
	}
	if !strings.Contains(exhausted[0].Error(), "kubernetes unavailable") {
		t.Fatalf("exhaustion recorded %v", exhausted[0])
	}
	mu.Unlock()
	// The terminated command is gone from the work queue.
	testutil.Eventually(t, 5*time.Second, func() error {
		s, _ := js.Stream(ctx, events.StreamCommands)
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.Msgs != 0 {
			return fmt.Errorf("%d messages left", info.State.Msgs)
		}
		return nil
	})
}

func TestCommandWhoseWorkersAllCrashLeavesAnAuditRecord(t *testing.T) {
	url, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	cfg := events.ConsumerConfig{Stream: events.StreamCommands, Durable: "lifecycle", MaxDeliver: 2, AckWait: 300 * time.Millisecond, Backoff: []time.Duration{50 * time.Millisecond}}
	if _, err := events.EnsureConsumer(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	pub := events.NewPublisher(js, "edge", quiet)
	if _, err := pub.Command(ctx, events.NewDelete("dave", "req-2")); err != nil {
		t.Fatal(err)
	}
	// Two workers each take it and crash; nobody ever acks or terminates it.
	for i := 0; i < 2; i++ {
		nc, wjs := natstest.Connect(t, url)
		cons, err := wjs.Consumer(ctx, events.StreamCommands, "lifecycle")
		if err != nil {
			t.Fatal(err)
		}
		b, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for range b.Messages() {
			n++
		}
		if n != 1 {
			t.Fatalf("crash %d: fetched %d", i, n)
		}
		nc.Close()
	}
	// A healthy worker keeps pulling; the server notices the exhausted
	// command and its max-deliveries advisory lands in the audit stream.
	var handled int
	var mu sync.Mutex
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = consume(cctx, js, cfg, func(context.Context, events.Delivery) error {
			mu.Lock()
			handled++
			mu.Unlock()
			return nil
		}, func(events.Delivery, error) {}, quiet)
	}()
	audit, err := js.Stream(ctx, events.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		m, err := audit.GetLastMsgForSubject(ctx, events.MaxDeliveriesAdvisory+".>")
		if err != nil {
			return err
		}
		if !strings.Contains(string(m.Data), `"stream":"AAAS_CMD"`) {
			return fmt.Errorf("advisory %s", m.Data)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	if handled != 0 {
		t.Fatalf("an exhausted command was delivered again %d times", handled)
	}
}

func TestPermanentFailureIsTerminatedAtOnce(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 20*time.Second)
	pub := events.NewPublisher(js, "edge", quiet)
	if _, err := pub.Command(ctx, events.NewDelete("erin", "req-3")); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var calls int
	var recorded error
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = consume(cctx, js, events.ConsumerConfig{Stream: events.StreamCommands, Durable: "w", MaxDeliver: 5}, func(context.Context, events.Delivery) error {
			mu.Lock()
			calls++
			mu.Unlock()
			return events.Permanent(errors.New("claim is not managed by this gateway"))
		}, func(_ events.Delivery, err error) {
			mu.Lock()
			recorded = err
			mu.Unlock()
		}, quiet)
	}()
	testutil.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if recorded == nil {
			return errors.New("not recorded yet")
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	if calls != 1 {
		t.Fatalf("handler ran %d times for a permanent failure", calls)
	}
}

func TestInvalidCommandsAreRefusedAtPublish(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	pub := events.NewPublisher(js, "edge", quiet)
	bad := []events.Command{
		events.NewClaim("bob", "r1", "short", ""),
		events.NewWake("bo.b", 1),
		events.NewHandshake("bob", events.HandshakeArgs{}),
		events.NewToken("bob", "r1", "short", "user"),
		events.NewClaim("bob", "r1", strings.Repeat("a", 64), "GPU"),
		events.NewClaim("bob", "r1", strings.Repeat("a", 64), "gpu.>"),
		events.NewRecreate("bob", "r1", strings.Repeat("x", 33)),
		// A named sandbox carries no token hash; an account's claim must.
		{V: 4, Verb: events.VerbClaim, User: "bob--work", ID: "x", Claim: &events.ClaimArgs{TokenHash: strings.Repeat("a", 64)}},
		{V: 4, Verb: events.VerbClaim, User: "bob", ID: "x", Claim: &events.ClaimArgs{}},
		{V: 2, Verb: events.VerbToken, User: "bob", ID: "x"},
		{V: 99, Verb: events.VerbWake, User: "bob", ID: "x"},
	}
	for _, c := range bad {
		if _, err := pub.Command(ctx, c); err == nil {
			t.Errorf("command %+v was published", c)
		}
	}
}

func TestDecodeRefusesNewerSchema(t *testing.T) {
	if _, err := events.Decode[events.Beacon]([]byte(`{"v":2,"user":"bob"}`)); err == nil {
		t.Fatal("a beacon from a newer schema was accepted")
	}
	if _, err := events.Decode[events.Command]([]byte(`{"v":5,"verb":"wake","user":"bob"}`)); !errors.Is(err, events.ErrNewerSchema) {
		t.Fatalf("a command from a newer schema: %v", err)
	}
	// The token command is version 2: a 0.2.0 lifecycle (reads 1) hands it
	// back to the queue instead of refusing a verb it does not know.
	if c := events.NewToken("bob", "r1", strings.Repeat("a", 64), "user"); c.V != 2 || c.Validate() != nil {
		t.Fatalf("token command %+v: %v", c, c.Validate())
	}
	// A claim or recreate that names a profile is version 3: a lifecycle
	// that predates profiles (reads up to 2) hands it back rather than
	// make the default profile's sandbox. One that names none stays 1.
	hash := strings.Repeat("a", 64)
	for _, c := range []events.Command{events.NewClaim("bob", "r1", hash, "gpu"), events.NewRecreate("bob", "r1", "gpu")} {
		if c.V != 3 || c.Validate() != nil {
			t.Fatalf("%s naming a profile %+v: %v", c.Verb, c, c.Validate())
		}
	}
	for _, c := range []events.Command{events.NewClaim("bob", "r1", hash, ""), events.NewRecreate("bob", "r1", "")} {
		if c.V != 1 || c.Validate() != nil {
			t.Fatalf("%s naming no profile %+v: %v", c.Verb, c, c.Validate())
		}
	}
	// A named sandbox's claim and delete are version 4: a lifecycle that
	// predates them would refuse the one and take the other for the
	// account's. The account's own delete stays 1.
	for _, c := range []events.Command{events.NewSandbox("bob--work", "r1", ""), events.NewSandbox("bob--work", "r1", "gpu"), events.NewDelete("bob--work", "r1")} {
		if c.V != 4 || c.Validate() != nil {
			t.Fatalf("%s of a named sandbox %+v: %v", c.Verb, c, c.Validate())
		}
	}
	if c := events.NewDelete("bob", "r1"); c.V != 1 || c.Validate() != nil {
		t.Fatalf("an account's delete %+v: %v", c, c.Validate())
	}
	b, err := events.Decode[events.Beacon]([]byte(`{"v":1,"user":"bob","in_flight":2}`))
	if err != nil || b.InFlight != 2 {
		t.Fatalf("decode: %+v %v", b, err)
	}
}

func BenchmarkBeaconPublish(b *testing.B) {
	s := natstest.Start(b)
	_, js := natstest.Connect(b, s.URL())
	ctx := context.Background()
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		b.Fatal(err)
	}
	pub := events.NewPublisher(js, "edge", quiet)
	users := make([]string, 1000)
	for i := range users {
		users[i] = fmt.Sprintf("user%d", i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		now := time.Now()
		if _, err := pub.Beacon(events.Beacon{User: users[i%len(users)], InFlight: 1, LastActive: now, SentAt: now, TTL: 15 * time.Second}); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(30 * time.Second):
		b.Fatal("beacons not acknowledged")
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "beacons/s")
}

// consume creates the consumer, as the setup step does, and consumes it.
func consume(ctx context.Context, js jetstream.JetStream, c events.ConsumerConfig, h events.Handler, ex events.Exhausted, log *slog.Logger) error {
	if _, err := events.EnsureConsumer(ctx, js, c); err != nil {
		return err
	}
	return events.Consume(ctx, js, c, h, ex, log)
}

// A handler that panics costs that delivery only: the command comes back
// (its delivery count proves it), and the consumer, and the process, carry
// on with the next.
func TestHandlerPanicIsRetriedAndTheConsumerCarriesOn(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	pub := events.NewPublisher(js, "edge", quiet)
	for _, user := range []string{"pam", "quin"} {
		if _, err := pub.Command(ctx, events.NewDelete(user, "req-"+user)); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	done := map[string]uint64{}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = consume(cctx, js, events.ConsumerConfig{Stream: events.StreamCommands, Durable: "w", MaxDeliver: 5, Backoff: []time.Duration{50 * time.Millisecond}}, func(_ context.Context, d events.Delivery) error {
			c, _ := events.Decode[events.Command](d.Data)
			if c.User == "pam" && d.Delivered == 1 {
				panic("injected: a bug in a handler")
			}
			mu.Lock()
			done[c.User] = d.Delivered
			mu.Unlock()
			return nil
		}, func(events.Delivery, error) {}, quiet)
	}()
	testutil.Eventually(t, 20*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(done) != 2 {
			return fmt.Errorf("done %v", done)
		}
		return nil
	})
	if done["pam"] != 2 || done["quin"] != 1 {
		t.Fatalf("deliveries %v: want pam redelivered once after the panic, quin once", done)
	}
}

// No flood fills the JetStream store the whole platform shares: every
// stream has a byte cap; a full audit (or activity) stream drops its
// oldest messages, while a full command stream refuses new commands
// rather than losing queued ones.
func TestEveryStreamIsBounded(t *testing.T) {
	for _, sc := range events.StreamConfigs(events.DefaultStreamsConfig()) {
		want := jetstream.DiscardOld
		if sc.Name == events.StreamCommands {
			want = jetstream.DiscardNew
		}
		if sc.MaxBytes <= 0 || sc.Discard != want {
			t.Errorf("%s: MaxBytes %d, discard %v (want a cap and %v)", sc.Name, sc.MaxBytes, sc.Discard, want)
		}
	}

	_, js := natstest.Connect(t, natstest.Start(t).URL())
	ctx := natstest.Context(t, time.Minute)
	cfg := events.DefaultStreamsConfig()
	cfg.AuditMaxBytes = 64 << 10
	if err := events.EnsureStreams(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	pub := events.NewPublisher(js, "test", slog.New(slog.DiscardHandler))
	for i := range 2000 {
		pub.Audit(events.AuditEvent{Kind: events.AuditLogin, Outcome: "rejected", Detail: fmt.Sprintf("%04d %s", i, strings.Repeat("x", 100))})
	}
	st, _ := js.Stream(ctx, events.StreamAudit)
	testutil.Eventually(t, 10*time.Second, func() error {
		info, err := st.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.LastSeq != 2000 {
			return fmt.Errorf("last sequence %d", info.State.LastSeq)
		}
		if info.State.Bytes > 64<<10 || info.State.FirstSeq == 1 {
			return fmt.Errorf("audit stream holds %d bytes from sequence %d: the oldest were not dropped", info.State.Bytes, info.State.FirstSeq)
		}
		return nil
	})
}

// A replica pulls commands only for its idle workers. Were it to take one
// its busy worker cannot start, that command would sit unwatched while its
// AckWait ran out, go to the other replica, and be handled a second time
// here once the worker freed: each command here is handled once, on its
// first delivery, while one replica's only worker is held far past
// AckWait. The same consumer with one worker never stalls after a failed
// delivery either (TestHandlerPanicIsRetriedAndTheConsumerCarriesOn).
func TestAReplicaTakesOnlyWhatItsWorkersCanStart(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, time.Minute)
	cfg := events.ConsumerConfig{Stream: events.StreamCommands, Durable: "w", MaxDeliver: 5, AckWait: time.Second, Workers: 1}
	if _, err := events.EnsureConsumer(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var mu sync.Mutex
	handled := map[string][]uint64{}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var replicas sync.WaitGroup
	for range 2 {
		replicas.Go(func() {
			_ = events.Consume(cctx, js, cfg, func(hctx context.Context, d events.Delivery) error {
				c, _ := events.Decode[events.Command](d.Data)
				mu.Lock()
				handled[c.User] = append(handled[c.User], d.Delivered)
				mu.Unlock()
				if c.User == "slow" {
					select { // kept alive by progress signals meanwhile
					case <-release:
					case <-hctx.Done():
					}
				}
				return nil
			}, func(events.Delivery, error) {}, quiet)
		})
	}
	pub := events.NewPublisher(js, "edge", quiet)
	if _, err := pub.Command(ctx, events.NewDelete("slow", "req-slow")); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(handled["slow"]) == 0 {
			return errors.New("the slow command has not started")
		}
		return nil
	})
	users := []string{"u1", "u2", "u3", "u4", "u5", "u6"}
	for _, u := range users {
		if _, err := pub.Command(ctx, events.NewDelete(u, "req-"+u)); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 20*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		for _, u := range users {
			if len(handled[u]) == 0 {
				return fmt.Errorf("%s not handled yet: %v", u, handled)
			}
		}
		return nil
	})
	// The hold itself is what is tested: it must outlast AckWait for
	// anything the busy replica might have taken, so this waits a time,
	// not a condition.
	<-time.After(3 * cfg.AckWait)
	close(release)
	testutil.Eventually(t, 10*time.Second, func() error {
		c, err := js.Consumer(ctx, events.StreamCommands, "w")
		if err != nil {
			return err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending+uint64(info.NumAckPending) != 0 {
			return fmt.Errorf("%d pending, %d unacknowledged", info.NumPending, info.NumAckPending)
		}
		return nil
	})
	cancel()
	replicas.Wait()
	mu.Lock()
	defer mu.Unlock()
	for _, u := range append(users, "slow") {
		if d := handled[u]; len(d) != 1 || d[0] != 1 {
			t.Errorf("%s handled on deliveries %v, want once, on the first", u, d)
		}
	}
}

// A model call's record published twice (its acknowledgement lost, or
// held in a broker's queue through an outage and sent again) is stored
// once: the call's id is its Nats-Msg-Id.
func TestUsageRecordPublishedTwiceIsStoredOnce(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	p := events.NewPublisher(js, "broker-a", quiet)
	e := events.UsageEvent{ID: "call-1", User: "ann", Provider: "deepseek", Model: "deepseek-chat", Status: 200, InputTokens: 10, OutputTokens: 5, CostMicros: 7}
	for range 2 {
		if err := p.Usage(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	other := e
	other.ID = "call-2"
	if err := p.Usage(ctx, other); err != nil {
		t.Fatal(err)
	}
	if err := p.Usage(ctx, events.UsageEvent{User: "ann"}); err == nil {
		t.Fatal("a record without a call id was published")
	}
	s, err := js.Stream(ctx, events.StreamUsage)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 2 {
		t.Fatalf("%d records stored, want 2 (call-1 once, call-2)", info.State.Msgs)
	}
	m, err := s.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	got, err := events.Decode[events.UsageEvent](m.Data)
	if err != nil || got.ID != "call-1" || got.Broker != "broker-a" || got.V != events.SchemaVersion || m.Subject != events.UsageSubject("ann") {
		t.Fatalf("stored %s %+v %v", m.Subject, got, err)
	}
}

// commandsLeader waits until the R3 commands stream has a leader and two
// current replicas, and returns the leader's name.
func commandsLeader(t *testing.T, ctx context.Context, js jetstream.JetStream) string {
	t.Helper()
	var leader string
	testutil.Eventually(t, 30*time.Second, func() error {
		s, err := js.Stream(ctx, events.StreamCommands)
		if err != nil {
			return err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.Cluster == nil || info.Cluster.Leader == "" || len(info.Cluster.Replicas) != 2 {
			return fmt.Errorf("stream %s: cluster %+v", events.StreamCommands, info.Cluster)
		}
		for _, r := range info.Cluster.Replicas {
			if !r.Current {
				return fmt.Errorf("stream %s: replica %s not current", events.StreamCommands, r.Name)
			}
		}
		leader = info.Cluster.Leader
		return nil
	})
	return leader
}
