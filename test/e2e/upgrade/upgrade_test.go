// Package upgrade tests the upgrade from the previous release to this
// commit, and the rollback README's version-skew policy allows, with both
// releases' real binaries on one devcluster and one NATS.
package upgrade

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/providersim"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

const (
	// The release this commit upgrades from: the newest tag before it.
	// Cutting a release moves these to it (README, "Releases").
	previous       = "0.2.0"
	previousCommit = "bfc3b866af77648e6fbb6211b7b7fbb9139ef8b1"
	// providerKey is the organisation's key the broker holds for the
	// provider stand-in.
	providerKey = "org-key-upgrade-0000000000000001"
)

// previousRelease builds the previous release's binaries. The commit is
// pinned here, not looked up by tag, so that a clone without tags tests
// the same thing; where the tag is present it must name that commit.
func previousRelease(t *testing.T) *testenv.Package {
	t.Helper()
	if out, err := exec.Command("git", "-C", testenv.Root(), "rev-parse", "-q", "--verify", "v"+previous+"^{commit}").Output(); err == nil {
		if got := strings.TrimSpace(string(out)); got != previousCommit {
			t.Fatalf("tag v%s names %s, the test upgrades from %s", previous, got, previousCommit)
		}
	}
	return pkg.Release(t, previousCommit, previous)
}

// TestUpgradeUnderTrafficAndRollBack installs the previous release, makes
// every kind of state (sessions, running sandboxes with handshakes done,
// an idle clock running, a suspended sandbox, a wake waiting in the
// queue), then upgrades process by process in the policy's order (setup,
// lifecycle, the sweeper, the broker, the edges one at a time behind the
// front) while
// two users keep browsing, and finally rolls back in the reverse order.
// Nothing is lost (no session signed out, no handshake done again, the
// idle clock kept, the queued wake carried out) and nothing is done twice
// (one wake for the queued user, one decision for the idle one).
func TestUpgradeUnderTrafficAndRollBack(t *testing.T) {
	const idle = 90 * time.Second
	old := previousRelease(t)
	brokerAddr := testenv.FreeAddr(t)
	st := old.NewStack(t, testenv.StackOptions{Env: map[string]string{
		// Three places: the two browsing users and the idle one; the
		// queued user waits for the idle one's.
		"MAX_RUNNING_SANDBOXES": "3", "IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": "1s", "AUTH_RATE_LIMIT": "10000",
	}, Sandbox: testenv.SandboxesCallBroker(brokerAddr)})
	lc := st.Lifecycle("lc-a")
	sw := st.Sweeper("sw-a", nil)
	sweeps := testenv.FollowSweeps(t, sw)
	// The broker is upgraded in its place in the order, on its address;
	// the provider stand-in is the far end of ben's chats (the real
	// providers cannot be reached from here).
	sim := providersim.New(providersim.Options{Keys: []string{providerKey}})
	simSrv := httptest.NewServer(sim)
	t.Cleanup(simSrv.Close)
	keys := t.TempDir()
	if err := os.WriteFile(filepath.Join(keys, "deepseek"), []byte(providerKey), 0o600); err != nil {
		t.Fatal(err)
	}
	br := st.Broker("br-a", map[string]string{"BROKER_ADDR": brokerAddr, "BROKER_KEYS_DIR": keys,
		"BROKER_PROVIDERS": `[{"name":"deepseek","api":"openai","base_url":"` + simSrv.URL + `","models":["deepseek-chat"]}]`})
	addr := st.FrontAddr()
	edges := []*testenv.Edge{st.Edge("edge-a", nil), st.Edge("edge-b", nil)}
	front := testenv.NewFrontAt(t, addr, strings.TrimPrefix(edges[0].URL, "http://"), strings.TrimPrefix(edges[1].URL, "http://"))
	procs := []*testenv.Proc{lc, sw, br.Proc, edges[0].Proc, edges[1].Proc}
	isRelease(t, previous, procs...)

	users := map[string]*testenv.Client{}
	signup := func(names ...string) {
		for _, u := range names {
			users[u] = testenv.NewClient(t, front.URL()).WithTimeout(time.Minute)
			users[u].Signup(u, "")
			st.WaitPhase(t, u, state.PhaseReady, 2*time.Minute)
		}
	}
	// The queued user and the sleeper first, put to sleep, so that the
	// three others take the places.
	signup("quinn", "sally")
	st.Suspend("quinn")
	st.Suspend("sally")
	signup("ann", "ben", "ida")
	for _, u := range []string{"ann", "ben", "ida"} {
		get(t, users[u], u, http.StatusOK)
	}
	// The places are taken: quinn's wake waits in the queue.
	testutil.Eventually(t, time.Minute, func() error {
		r := users["quinn"].Do(http.MethodGet, "/u/quinn/", nil, "Accept", "text/html")
		if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "number 1 of 1 in the queue") {
			return fmt.Errorf("quinn's page: %d, want 503 and the queue", r.StatusCode)
		}
		return nil
	})
	wokenBefore := woken(st, "quinn")
	handshakes := map[string]int{}
	for _, u := range []string{"ann", "ben", "ida"} {
		handshakes[u] = len(st.Audit(events.AuditHandshake, u))
		if handshakes[u] == 0 {
			t.Fatalf("%s: no handshake audited: the test would prove nothing", u)
		}
	}
	idaSeen := st.Idleness("ida").Last

	load := testenv.StartLoad(t, front.URL(), testenv.LoadOptions{Users: map[string]*testenv.Client{"ann": users["ann"], "ben": users["ben"]}})
	flowing(t, load, 50)
	chats := 0
	chat := func(when string) {
		t.Helper()
		chats++
		msg := fmt.Sprintf("chat %d %s", chats, when)
		body, _ := json.Marshal(map[string]string{"message": msg, "session": "upgrade"})
		r := users["ben"].Do(http.MethodPost, "/u/ben/api/chat", bytes.NewReader(body), "Content-Type", "application/json")
		if r.StatusCode != http.StatusOK || !strings.Contains(string(r.Body), "event: delta") || strings.Contains(string(r.Body), "event: error") {
			t.Fatalf("ben's chat %s: %d %.500s", when, r.StatusCode, r.Body)
		}
	}
	chat("on " + previous)

	// The upgrade, in README's order: the setup step (lifecycle's init
	// container), lifecycle, the sweeper and the broker, the edges one at
	// a time.
	start := time.Now()
	st.Use(&pkg)
	st.Setup()
	for _, p := range procs {
		p.Replace(t, &pkg)
		flowing(t, load, 20)
		chat("after " + p.Name + "'s upgrade")
	}
	t.Logf("upgrade rolled in %s", time.Since(start).Round(time.Millisecond))
	isRelease(t, "", procs...)
	sameHandshakes(t, st, handshakes)

	// Nothing lost: ida's clock is the one the old edges kept (neither
	// lost nor moved by a restart counted as activity), she is still
	// running, sally is still asleep, quinn still waits.
	ida := st.Idleness("ida")
	if ida.Last.Before(idaSeen) || ida.Last.After(start) {
		t.Errorf("ida's idle clock moved from %s to %s across the upgrade (begun %s)",
			idaSeen.Format(time.StampMilli), ida.Last.Format(time.StampMilli), start.Format(time.StampMilli))
	}
	due := ida.Due(idle)
	if time.Now().After(due) {
		t.Fatalf("the upgrade outlasted ida's idle timeout (%s): the rest proves nothing; raise idle", idle)
	}
	for u, want := range map[string]state.Phase{"ida": state.PhaseReady, "sally": state.PhaseSuspended, "quinn": state.PhaseSuspended} {
		if p := st.Box(u).Phase; p != want {
			t.Errorf("%s's sandbox is %s after the upgrade, want %s", u, p, want)
		}
	}
	status(t, users["quinn"], "Queued")

	// ida falls due on the kept clock; the new sweeper suspends her, and
	// the new lifecycle gives her place to quinn, from the queue the old
	// one kept.
	st.WaitPhase(t, "ida", state.PhaseSuspended, time.Until(due)+time.Minute)
	st.DecidedOnTime("ida", idle, map[string]*testenv.Sweeps{"sw-a": sweeps})
	st.WaitPhase(t, "quinn", state.PhaseReady, 2*time.Minute)
	get(t, users["quinn"], "quinn", http.StatusOK)
	if n := woken(st, "quinn") - wokenBefore; n != 1 {
		t.Errorf("quinn's queued wake was carried out %d times, want once", n)
	}
	// A newcomer signs up on the new release (a new account takes a
	// spare, never queued): the rollback must keep her.
	users["nia"] = testenv.NewClient(t, front.URL()).WithTimeout(time.Minute)
	users["nia"].Signup("nia", "")

	// The rollback, in the reverse order, traffic still flowing.
	start = time.Now()
	st.Use(old)
	for i := len(procs) - 1; i >= 0; i-- {
		procs[i].Replace(t, old)
		flowing(t, load, 20)
		chat("after " + procs[i].Name + "'s rollback")
	}
	t.Logf("rollback rolled in %s", time.Since(start).Round(time.Millisecond))
	isRelease(t, previous, procs...)
	load.Stop()

	// The old release reads what the new one wrote (quinn's sandbox and
	// session, nia's account, session and handshake) and refuses nothing
	// as newer.
	get(t, users["quinn"], "quinn", http.StatusOK)
	get(t, users["nia"], "nia", http.StatusOK)
	for _, p := range procs {
		if n, err := p.MetricSum("aaas_kv_newer_records_total"); err != nil || n != 0 {
			t.Errorf("%s (%s) refused %v records as newer (%v)", p.Name, previous, n, err)
		}
	}
	sameHandshakes(t, st, handshakes)
	// And acts on it: places free (nia's start took one beyond the cap),
	// and the old lifecycle wakes sally, once.
	st.Suspend("ann")
	st.Suspend("ben")
	get(t, users["sally"], "sally", http.StatusOK)
	if n := woken(st, "sally"); n != 1 {
		t.Errorf("sally woken %d times, want once", n)
	}

	// Every chat was one model call, metered once to ben across the
	// releases: none lost, none counted twice.
	usage, err := kv.Open[state.Usage](context.Background(), st.JS, state.BucketUsage)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		e, err := usage.Get(context.Background(), state.UsageKey("ben", state.Month(time.Now())))
		if err != nil || e.Value.Calls != int64(chats) || len(sim.Calls()) != chats {
			return fmt.Errorf("ben's usage %+v (%v) and %d calls at the provider, for %d chats", e.Value, err, len(sim.Calls()), chats)
		}
		return nil
	})

	r := load.Report()
	t.Logf("traffic: %d requests, %d uploads, %d sockets (%d reconnected), %v", r.Sent, r.Uploads, r.Sockets, r.Reconnected, r.Requests)
	if r.Failed != 0 {
		t.Errorf("%d of %d idempotent requests failed through the front\n%s", r.Failed, r.Sent, strings.Join(r.Failures, "\n"))
	}
	// No answer said signed out; a POST may meet a draining edge's
	// keep-alive race (one per edge restart), which no proxy retries.
	for k, n := range r.Requests {
		if strings.HasSuffix(k, " 401") || strings.HasSuffix(k, " 303") {
			t.Errorf("%d answers %q: a session was lost", n, k)
		}
	}
	if race := r.Requests["POST upload 502"]; r.UploadsFailed != race || race > 2*len(edges) {
		t.Errorf("%d of %d uploads failed, %d of them 502s from the front\n%s", r.UploadsFailed, r.Uploads, race, strings.Join(r.Failures, "\n"))
	}
	if r.Lost != 0 {
		t.Errorf("%d WebSocket echoes lost", r.Lost)
	}
}

// isRelease checks every process reports version in aaas_build_info
// ("": any version but the previous release's).
func isRelease(t *testing.T, version string, procs ...*testenv.Proc) {
	t.Helper()
	for _, p := range procs {
		n, err := p.MetricSum("aaas_build_info", "version", previous)
		if err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
		if old := n == 1; old != (version == previous) {
			m, _ := p.Metric("aaas_build_info")
			t.Fatalf("%s runs %s, want %q", p.Name, m, version)
		}
	}
}

// flowing waits until the load has had n more requests answered.
func flowing(t *testing.T, load *testenv.Load, n int) {
	t.Helper()
	sent := load.Report().Sent
	testutil.Eventually(t, time.Minute, func() error {
		if got := load.Report().Sent - sent; got < n {
			return fmt.Errorf("%d of %d requests answered", got, n)
		}
		return nil
	})
}

// get asks for user's file list and wants status.
func get(t *testing.T, c *testenv.Client, user string, status int) {
	t.Helper()
	if r := c.Do(http.MethodGet, "/u/"+user+"/api/files", nil, "Accept", "application/json"); r.StatusCode != status {
		t.Fatalf("%s: %d %.300s, want %d", user, r.StatusCode, r.Body, status)
	}
}

// status wants phase in user's /_/status.
func status(t *testing.T, c *testenv.Client, phase string) {
	t.Helper()
	if r := c.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"); r.JSON()["phase"] != phase {
		t.Errorf("status: %d %.300s, want phase %s", r.StatusCode, r.Body, phase)
	}
}

// sameHandshakes checks no handshake was done again: each user's count
// of audited handshakes is what it was before the upgrade.
func sameHandshakes(t *testing.T, st *testenv.Stack, before map[string]int) {
	t.Helper()
	for u, n := range before {
		if got := len(st.Audit(events.AuditHandshake, u)); got != n {
			t.Errorf("%s: %d handshakes audited, %d before the upgrade: one was done again", u, got, n)
		}
	}
}

// woken counts the wakes lifecycle carried out for user.
func woken(st *testenv.Stack, user string) int {
	n := 0
	for _, a := range st.Audit(events.AuditWake, user) {
		if a.Outcome == "woken" {
			n++
		}
	}
	return n
}
