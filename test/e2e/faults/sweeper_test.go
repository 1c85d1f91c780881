package faults

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// TestSweeperFailoverWithManyClocks gives two sweepers 10k users' clocks
// (busy ones, and idle ones falling due over 29 s), kills the active one
// once it has asked about half the idle users, and reads every suspend
// command back from the stream. What must hold, however loaded the
// machine: no busy sandbox is ever asked to suspend; every idle one is
// asked exactly once, never before it fell due (by the stream's clock, as
// the sweeper judges); those that fell due after the kill by the
// successor, which asks nothing while the other leads; and each in a
// round of decisions its sweeper began after the user fell due (the
// second round to end from then on, counted from the sweepers' own
// metrics, so a slow round is measured, not assumed). How long the
// takeover and each ask took is reported, not bounded. A fifth of the
// beacons come from edges whose clocks are 30 s ahead or behind; the
// sweeper judges by the stream's time, so they change nothing.
func TestSweeperFailoverWithManyClocks(t *testing.T) {
	// Users fall due 10-39 s after their beacons: time for 10k sandboxes
	// to be stored and cached on a loaded machine before the first does.
	const idle, tick, lease = 40 * time.Second, time.Second, 2 * time.Second
	n := size(10000, 10000)
	st := pkg.NewStack(t, testenv.StackOptions{NATSNodes: 3, Env: map[string]string{
		"IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": tick.String(), "LEASE_TTL": lease.String(),
	}})
	names := []string{"sw-a", "sw-b"}
	sweepers := []*testenv.Proc{st.Sweeper(names[0], nil), st.Sweeper(names[1], nil)}
	rounds := map[string]*testenv.Sweeps{}
	for i, p := range sweepers {
		rounds[names[i]] = testenv.FollowSweeps(t, p)
	}
	ctx := testenv.Context(t, 10*time.Minute)

	// Beacons: every tenth user busy (a socket open an hour); the others
	// last active so that their IDLE_TIMEOUT falls due 10-39 s from now.
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
			in := 10*time.Second + time.Duration(i)*29*time.Second/time.Duration(n)
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
	var pinnedUntil time.Time // when the first busy user's beacon expires
	for u, at := range stamps(t, st) {
		if d, ok := due[u]; ok {
			lag := at.Sub(sent[u])
			due[u], stampLag = d.Add(lag), max(stampLag, lag)
		} else if until := at.Add(events.MaxBeaconTTL); pinnedUntil.IsZero() || until.Before(pinnedUntil) {
			pinnedUntil = until
		}
	}

	// Then 10k Ready sandboxes, Ready for an hour (the beacons came first,
	// as they do: activity is what a sandbox that is Ready has had).
	// Written as a KV put is stored, a message on the key's subject, and
	// pipelined: 10k acknowledged puts one round trip each would take a
	// loaded machine longer than the first users take to fall due.
	long := time.Now().Add(-time.Hour).UTC()
	for i := range n {
		u := fmt.Sprintf("c%d", i)
		data, err := json.Marshal(state.Sandbox{User: u, Phase: state.PhaseReady, Managed: true, Claim: u, ReadySince: long, Updated: long})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.JS.PublishAsync("$KV."+state.BucketSandboxes+"."+u, data); err != nil {
			t.Fatal(err)
		}
		if i%1000 == 999 || i == n-1 {
			select {
			case <-st.JS.PublishAsyncComplete():
			case <-ctx.Done():
				t.Fatal("sandboxes not acknowledged")
			}
		}
	}
	// A user can be asked about once its sweeper's cache holds its
	// sandbox too: when each sweeper's inventory counted all of them.
	cached := map[string]time.Time{}
	for i, p := range sweepers {
		eventually(t, 3*time.Minute, func() error {
			if cached, _ := p.MetricSum("aaas_sweeper_cached_sandboxes"); int(cached) < n {
				return fmt.Errorf("%s's cache holds %d of %d sandboxes", names[i], int(cached), n)
			}
			return nil
		})
		cached[names[i]] = time.Now()
	}

	// Kill the active sweeper halfway: once it has asked about half the
	// idle users.
	leader := -1
	eventually(t, 3*time.Minute, func() error {
		for i, p := range sweepers {
			if m, _ := p.Metric("aaas_sweeper_leader"); strings.HasSuffix(m, " 1") {
				leader = i
			}
		}
		if leader < 0 {
			return errors.New("no sweeper leads")
		}
		if asked, _ := sweepers[leader].MetricSum("aaas_sweeper_suspends_total", "outcome", "requested"); int(asked) < len(due)/2 {
			return fmt.Errorf("%s has asked about %d of %d idle users", names[leader], int(asked), len(due))
		}
		return nil
	})
	dead, successor := names[leader], names[1-leader]
	sweepers[leader].Kill()
	killed := time.Now()
	after := 0
	for _, d := range due {
		if d.After(killed) {
			after++
		}
	}
	if after == 0 {
		t.Fatalf("every idle user fell due before the kill (%s after the beacons): the setup was too slow to leave a takeover to test", killed.Sub(published))
	}

	// Until every idle user has been asked about (the stream holds one
	// command per ask: the deduplication window outlasts the test), and
	// then for two more rounds of the successor, in which a busy one
	// could be asked too.
	cmds, err := st.JS.Stream(ctx, events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	stored := func() uint64 {
		info, err := cmds.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Msgs
	}
	eventually(t, 3*time.Minute, func() error {
		if m := stored(); m < uint64(len(due)) {
			return fmt.Errorf("%d suspend commands for %d idle users", m, len(due))
		}
		return nil
	})
	more := rounds[successor].Rounds() + 2
	eventually(t, time.Minute, func() error {
		if r := rounds[successor].Rounds(); r < more {
			return fmt.Errorf("%s made %d of %d rounds", successor, r, more)
		}
		return nil
	})

	if time.Now().After(pinnedUntil) {
		t.Fatalf("the busy users' beacons expired (BEACON_TTL at most %s) before the scenario ended: too slow to judge them", events.MaxBeaconTTL)
	}

	// Every suspend command, from the stream: who asked about whom, when
	// the sweeper issued it and when the stream stored it.
	type ask struct {
		by             string
		issued, stored time.Time
	}
	asks := map[string][]ask{}
	var successorFirst time.Time
	cmdLag := time.Duration(0)
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
		asks[u] = append(asks[u], ask{by: c.IssuedBy, issued: c.IssuedAt, stored: m.Time})
		cmdLag = max(cmdLag, m.Time.Sub(c.IssuedAt))
		if c.IssuedBy == successor && (successorFirst.IsZero() || m.Time.Before(successorFirst)) {
			successorFirst = m.Time
		}
	}

	var busyAsked, missed, twice, early, notSuccessor, beforeKill, late []string
	var lateBacklog, lateSteady time.Duration
	backlog := 0
	for u := range busy {
		if len(asks[u]) > 0 {
			busyAsked = append(busyAsked, u)
		}
	}
	for u, d := range due {
		a := asks[u]
		switch {
		case len(a) == 0:
			missed = append(missed, u)
			continue
		case len(a) > 1:
			twice = append(twice, fmt.Sprintf("%s %d times", u, len(a)))
		}
		first := a[0]
		if first.issued.Before(d) {
			early = append(early, fmt.Sprintf("%s %s early", u, d.Sub(first.issued)))
		}
		if d.After(killed) && first.by != successor {
			notSuccessor = append(notSuccessor, fmt.Sprintf("%s (due %s after the kill) by %s", u, d.Sub(killed), first.by))
		}
		if first.by == successor && first.issued.Before(killed) {
			beforeKill = append(beforeKill, fmt.Sprintf("%s %s before the kill", u, killed.Sub(first.issued)))
		}
		// In a round begun after it fell due (and its sandbox was in the
		// sweeper's cache): by the second round's end of whichever
		// sweeper made two from then on.
		for name, r := range rounds {
			askable := d
			if cached[name].After(d) {
				askable = cached[name]
			}
			if by, ok := r.DecidedBy(askable); ok && first.stored.After(by) {
				late = append(late, fmt.Sprintf("%s asked by %s %s after due, %s's rounds allowed %s", u, first.by, first.stored.Sub(d), name, by.Sub(d)))
			}
		}
		if first.by == successor && d.Before(successorFirst) {
			backlog++
			lateBacklog = max(lateBacklog, first.stored.Sub(d))
		} else {
			lateSteady = max(lateSteady, first.stored.Sub(d))
		}
	}
	report(t, "Sweeper failover with 10k clocks", [][2]string{
		row("users (busy / idle)", fmt.Sprintf("%d (%d / %d)", n, len(busy), len(due))),
		row("beacons from clocks 30 s ahead / behind", fmt.Sprintf("%d / %d", n/5, n/5)),
		row("beacons stamped by the stream after sent, at most", seconds(stampLag)),
		row("commands stored by the stream after issued, at most", seconds(cmdLag)),
		row("active sweeper killed after (idle users due after the kill)", fmt.Sprintf("%s (%d)", seconds(killed.Sub(published)), after)),
		row("suspend commands published", info.State.Msgs),
		row("busy sandboxes asked to suspend", len(busyAsked)),
		row("idle sandboxes never asked / asked twice / asked early", fmt.Sprintf("%d / %d / %d", len(missed), len(twice), len(early))),
		row("asked later than the sweepers' rounds allow", len(late)),
		row("rounds made (longest, at most)", fmt.Sprintf("%s %d (%s), %s %d (%s)", dead, rounds[dead].Rounds(), seconds(rounds[dead].Longest()), successor, rounds[successor].Rounds(), seconds(rounds[successor].Longest()))),
		row("takeover (kill to the successor's first ask)", seconds(successorFirst.Sub(killed))),
		row("the successor's backlog (due before its first ask) / latest ask after due", fmt.Sprintf("%d / %s", backlog, seconds(lateBacklog))),
		row("latest ask after due, the rest", seconds(lateSteady)),
	})
	for what, l := range map[string][]string{
		"busy sandboxes asked to suspend":                     busyAsked,
		"idle sandboxes never asked to suspend":               missed,
		"idle sandboxes asked more than once":                 twice,
		"asked before their IDLE_TIMEOUT":                     early,
		"fell due after the kill, not asked by the successor": notSuccessor,
		"asked by the successor while the other still led":    beforeKill,
		"asked later than a round begun after they fell due":  late,
	} {
		if len(l) > 0 {
			sort.Strings(l)
			t.Errorf("%d %s, e.g. %v", len(l), what, l[:min(5, len(l))])
		}
	}
	if successorFirst.IsZero() {
		t.Errorf("%s never asked about anyone after %s was killed", successor, dead)
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
