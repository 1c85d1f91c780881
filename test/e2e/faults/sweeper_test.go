package faults

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
)

// TestSweeperFailoverWithManyClocks gives two sweepers 10k users' clocks
// (busy ones, and idle ones falling due over 17 s), kills the active one
// halfway, and reads every suspend command from the stream: no busy
// sandbox may be asked to suspend, and no idle one late by more than a
// tick — except those that fell due during the takeover, which the
// successor must ask about in its first sweep, within the lease TTL and
// two ticks of the kill (the lease expires, the successor takes it on a
// retry, then sweeps on its next tick). A fifth of
// the beacons come from edges whose clocks are 30 s ahead or behind; the
// sweeper judges by the stream's time, so they change nothing.
func TestSweeperFailoverWithManyClocks(t *testing.T) {
	const idle, tick, lease = 20 * time.Second, time.Second, 2 * time.Second
	n := size(10000, 10000)
	st := pkg.NewStack(t, testenv.StackOptions{NATSNodes: 3, Env: map[string]string{
		"IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": tick.String(), "LEASE_TTL": lease.String(),
	}})
	names := []string{"sw-a", "sw-b"}
	sweepers := []*testenv.Proc{st.Sweeper(names[0], nil), st.Sweeper(names[1], nil)}
	ctx := testenv.Context(t, 5*time.Minute)

	// Beacons: every tenth user busy (a socket open an hour); the others
	// last active so that their IDLE_TIMEOUT falls due 2-19 s from now.
	// Users i%5==1 are reported by an edge 30 s ahead, i%5==2 by one 30 s
	// behind.
	pub := events.NewPublisher(st.JS, "edge-x", testenv.Logger())
	published := time.Now()
	due := map[string]time.Time{}
	sent := map[string]time.Time{}
	busy := map[string]bool{}
	for i := range n {
		u := fmt.Sprintf("c%d", i)
		skew, edge := time.Duration(0), "edge-x"
		switch i % 5 {
		case 1:
			skew, edge = 30*time.Second, "edge-ahead"
		case 2:
			skew, edge = -30*time.Second, "edge-behind"
		}
		now := time.Now()
		b := events.Beacon{User: u, Edge: edge, SentAt: now.Add(skew).UTC(), TTL: events.MaxBeaconTTL}
		if i%10 == 0 {
			busy[u] = true
			b.InFlight, b.LastActive = 1, now.Add(-time.Hour+skew).UTC()
		} else {
			in := 2*time.Second + time.Duration(i)*17*time.Second/time.Duration(n)
			due[u], sent[u] = now.Add(in), now
			b.LastActive = now.Add(in - idle + skew).UTC()
		}
		if _, err := pub.Beacon(b); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-st.JS.PublishAsyncComplete():
	case <-ctx.Done():
		t.Fatal("beacons not acknowledged")
	}
	// The sweeper reads a beacon by the stream's clock: the edge's own
	// clock only says how long before sending the user was last active.
	// So a user falls due that long after the stream stamped the beacon,
	// which on a loaded machine can be seconds after it was sent.
	stampLag := time.Duration(0)
	for u, at := range stamps(t, st) {
		if d, ok := due[u]; ok {
			lag := at.Sub(sent[u])
			due[u], stampLag = d.Add(lag), max(stampLag, lag)
		}
	}

	// Then 10k Ready sandboxes, Ready for an hour (the beacons came first,
	// as they do: activity is what a sandbox that is Ready has had).
	boxes, err := kv.Open[state.Sandbox](ctx, st.JS, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	long := time.Now().Add(-time.Hour).UTC()
	var wg sync.WaitGroup
	work := make(chan int)
	for range 32 {
		wg.Go(func() {
			for i := range work {
				u := fmt.Sprintf("c%d", i)
				if _, err := boxes.Put(ctx, u, state.Sandbox{User: u, Phase: state.PhaseReady, Managed: true, Claim: u, ReadySince: long, Updated: long}); err != nil {
					t.Error(err)
				}
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()

	// Kill the active sweeper halfway through.
	time.Sleep(time.Until(published.Add(10 * time.Second)))
	leader := -1
	for i, p := range sweepers {
		if m, _ := p.Metric("aaas_sweeper_leader"); strings.HasSuffix(m, " 1") {
			leader = i
		}
	}
	if leader < 0 {
		t.Fatal("no sweeper leads")
	}
	sweepers[leader].Kill()
	killed := time.Now()
	time.Sleep(time.Until(published.Add(19*time.Second + 10*time.Second)))

	// Every suspend command the sweepers published, from the stream: when
	// each user was first asked about, and by which sweeper.
	first := map[string]time.Time{}
	by := map[string]string{}
	var successorFirst time.Time
	asks := 0
	cmds, err := st.JS.Stream(ctx, events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	info, err := cmds.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := cmds.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		u, ok := strings.CutPrefix(m.Subject, events.CommandSubject(events.VerbSuspend, ""))
		if !ok {
			continue
		}
		c, err := events.Decode[events.Command](m.Data)
		if err != nil {
			t.Fatal(err)
		}
		asks++
		if _, seen := first[u]; !seen {
			first[u], by[u] = m.Time, c.IssuedBy
		}
		if c.IssuedBy != names[leader] && successorFirst.IsZero() && m.Time.After(killed) {
			successorFirst = m.Time
		}
	}
	// The takeover: from the kill to the successor's first ask. A user who
	// fell due meanwhile, or just before the kill (in a sweep the kill cut
	// short, or the tick before it), is the successor's backlog; every
	// other one is asked in steady state, within a tick.
	takeover := successorFirst.Sub(killed)
	inBacklog := func(u string, d time.Time) bool {
		return by[u] != names[leader] && d.Before(successorFirst) && !d.Before(killed.Add(-2*tick))
	}
	var busyAsked, missed, early []string
	var lateBacklog, lateSteady, backlogSpread time.Duration
	backlog := 0
	for u := range busy {
		if _, ok := first[u]; ok {
			busyAsked = append(busyAsked, u)
		}
	}
	for u, d := range due {
		at, ok := first[u]
		switch {
		case !ok:
			missed = append(missed, u)
		case at.Before(d.Add(-500 * time.Millisecond)):
			early = append(early, fmt.Sprintf("%s %s early", u, d.Sub(at)))
		case inBacklog(u, d):
			backlog++
			lateBacklog, backlogSpread = max(lateBacklog, at.Sub(d)), max(backlogSpread, at.Sub(successorFirst))
		default:
			lateSteady = max(lateSteady, at.Sub(d))
		}
	}
	report(t, "Sweeper failover with 10k clocks", [][2]string{
		row("users (busy / idle)", fmt.Sprintf("%d (%d / %d)", n, len(busy), len(due))),
		row("beacons from clocks 30 s ahead / behind", fmt.Sprintf("%d / %d", n/5, n/5)),
		row("beacons stamped by the stream after sent, at most", seconds(stampLag)),
		row("active sweeper killed after", seconds(killed.Sub(published))),
		row("suspend commands published", asks),
		row("busy sandboxes asked to suspend", len(busyAsked)),
		row("idle sandboxes never asked", len(missed)),
		row("asked early", len(early)),
		row("takeover (kill to the successor's first ask)", seconds(takeover)),
		row("fell due around the takeover / latest ask after due", fmt.Sprintf("%d / %s", backlog, seconds(lateBacklog))),
		row("latest ask after due, the rest", seconds(lateSteady)),
	})
	if len(busyAsked) > 0 {
		t.Errorf("%d busy sandboxes asked to suspend, e.g. %v", len(busyAsked), busyAsked[:min(5, len(busyAsked))])
	}
	if len(missed) > 0 {
		t.Errorf("%d idle sandboxes never asked to suspend, e.g. %v", len(missed), missed[:min(5, len(missed))])
	}
	if len(early) > 0 {
		t.Errorf("%d asked before their IDLE_TIMEOUT, e.g. %v", len(early), early[:min(5, len(early))])
	}
	if successorFirst.IsZero() || takeover > lease+2*tick+time.Second {
		t.Errorf("the successor's first ask came %s after the kill, more than the lease TTL and two ticks", takeover)
	}
	if backlogSpread > tick+time.Second {
		t.Errorf("the successor asked about a user who fell due around the takeover %s after its first ask, more than a tick", backlogSpread)
	}
	if lateSteady > tick+time.Second {
		t.Errorf("an idle sandbox was asked %s after it fell due, more than a tick (%s)", lateSteady, tick)
	}
}

// stamps is when the stream stored each user's newest beacon.
func stamps(t *testing.T, st *testenv.Stack) map[string]time.Time {
	t.Helper()
	ctx, cancel := context.WithCancel(testenv.Context(t, time.Minute))
	defer cancel()
	var mu sync.Mutex
	at := map[string]time.Time{}
	caughtUp := false
	err := events.FollowActivity(ctx, st.JS, testenv.Logger(), func(b events.Beacon, _ uint64, stamped time.Time) {
		mu.Lock()
		defer mu.Unlock()
		at[b.User] = stamped
	}, func() { caughtUp = true; cancel() })
	if err != nil || !caughtUp {
		t.Fatalf("beacons not read back (%d read): %v", len(at), err)
	}
	mu.Lock()
	defer mu.Unlock()
	return at
}
