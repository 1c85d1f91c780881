package lifecycle_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// auditEvents are the audit stream's events of kind, decoded.
func (f *fixture) auditEvents(kind events.AuditKind) []events.AuditEvent {
	f.t.Helper()
	var out []events.AuditEvent
	for _, line := range strings.Split(f.AuditLog(), "\n") {
		if line == "" {
			continue
		}
		e, err := events.Decode[events.AuditEvent]([]byte(line))
		if err != nil {
			f.t.Fatalf("audit event %q: %v", line, err)
		}
		if e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// of are the events of evs about user.
func of(evs []events.AuditEvent, user string) []events.AuditEvent {
	var out []events.AuditEvent
	for _, e := range evs {
		if e.User == user {
			out = append(out, e)
		}
	}
	return out
}

// drained waits until the commands consumer has nothing left to deliver
// and nothing delivered but unacknowledged: every command published so far
// was acknowledged or terminated.
func (f *fixture) drained(t *testing.T) {
	t.Helper()
	testutil.Eventually(t, time.Minute, func() error {
		c, err := f.JS.Consumer(ctx(t), events.StreamCommands, events.CommandConsumer)
		if err != nil {
			return err
		}
		if i := c.CachedInfo(); i.NumPending != 0 || i.NumAckPending != 0 {
			return fmt.Errorf("consumer: %d pending, %d awaiting an ack", i.NumPending, i.NumAckPending)
		}
		return nil
	})
}

// Security review S3: the production permissions let the sweeper publish
// on aaas.cmd.suspend.* only, but a message body is whatever its publisher
// writes. A delete of victim forged on a suspend subject with the
// sweeper's identity is refused: terminated after one delivery, audited
// under the subject it came on, and victim's account, claim, session and
// request answers are untouched; a suspend on its own subject from the
// same identity, in the same window, is carried out.
func TestCommandNotOnItsOwnSubjectIsRefused(t *testing.T) {
	f := setup(t, nil)
	lc := f.lifecycle("lc-a")
	f.signup("victim")
	if _, err := f.sessions.Put(ctx(t), state.SessionKey("victim", "s1"), state.Session{User: "victim"}); err != nil {
		t.Fatal(err)
	}
	nc, _ := natstest.Connect(t, f.NATSURLs(), natstest.As(t, f.IDs, natsauth.Sweeper))
	forged, err := json.Marshal(events.NewDelete("victim", "req-forged"))
	if err != nil {
		t.Fatal(err)
	}
	const subject = "aaas.cmd.suspend.x"
	box, _ := f.boxes.Get("victim")
	control, _ := json.Marshal(events.NewSuspend("victim", f.lastActivitySeq("victim"), box.Revision, time.Now(), "idle", ""))
	for _, m := range []struct {
		subject string
		data    []byte
	}{{subject, forged}, {events.CommandSubject(events.VerbSuspend, "victim"), control}} {
		if err := nc.Publish(m.subject, m.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	f.waitPhase("victim", state.PhaseSuspended) // the control
	f.drained(t)

	// The audit is published as the command ends: it may still be on its
	// way when the commands are drained.
	var refused []events.AuditEvent
	testutil.Eventually(t, 10*time.Second, func() error {
		refused = nil
		for _, e := range f.auditEvents(events.AuditCommandFailed) {
			if strings.Contains(e.Detail, subject) {
				refused = append(refused, e)
			}
		}
		if len(refused) == 0 {
			return errors.New("the forged command's refusal is not audited yet")
		}
		return nil
	})
	if len(refused) != 1 || refused[0].Outcome != "refused" || refused[0].User != "" || refused[0].RequestID != "" ||
		!strings.Contains(refused[0].Detail, "1 deliveries") || !strings.Contains(refused[0].Detail, `delete command for "victim"`) {
		t.Fatalf("audit of the forged command: %+v", refused)
	}
	// One delivery, handled as refused, never retried.
	if v := metric(lc, `aaas_lifecycle_command_duration_seconds_count{outcome="refused",verb="delete"}`); v != 1 {
		t.Fatalf("%v refused deliveries, want exactly 1", v)
	}
	if _, err := f.users.Get(ctx(t), "victim"); err != nil {
		t.Fatalf("victim's account: %v", err)
	}
	if _, err := f.sessions.Get(ctx(t), state.SessionKey("victim", "s1")); err != nil {
		t.Fatalf("victim's session: %v", err)
	}
	if _, err := f.requests.Get(ctx(t), "req-forged"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("the forged command was answered: %v", err)
	}
	_, ext, _ := pkg.Cluster.SandboxClients()
	if c, err := ext.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Get(ctx(t), sandbox.ClaimName("victim"), metav1.GetOptions{}); err != nil || c.DeletionTimestamp != nil {
		t.Fatalf("victim's claim: %v (deleting: %v)", err, err == nil && c.DeletionTimestamp != nil)
	}
	if u, _ := f.users.Get(ctx(t), "victim"); !u.Value.DeletingSince.IsZero() {
		t.Fatal("victim was marked as being deleted")
	}
}

// Security review S6, lifecycle's part: however many edges ask, a
// handshake asked for again soon after the last (its cookie refused) is
// paced per (user, pod, host). A refusal answers the asker at once with the
// record as it was (the cookie, still good for whoever can use it), asks
// nothing of the pod and writes no audit event.
func TestLifecyclePacesHandshakesAskedForAgain(t *testing.T) {
	f := setup(t, nil)
	lc := f.lifecycle("lc-a")
	f.signup("max")
	key := state.HandshakeKey("max", f.Box("max").PodUID, "localhost")
	cookie, failure := f.handshake("max", "localhost", 0)
	if failure != "" {
		t.Fatal(failure)
	}
	// As many edges would, each finding the newest record refused.
	redone, refused := 0, 0
	start := time.Now()
	for time.Since(start) < 8*time.Second {
		cur, err := f.handshakes.Get(ctx(t), key)
		if err != nil {
			t.Fatal(err)
		}
		next, failure := f.handshake("max", "localhost", cur.Revision)
		switch {
		case failure != "":
			t.Fatalf("a refresh failed: %s", failure)
		case next == cookie:
			refused++
		default:
			redone++
		}
		cookie = next
	}
	elapsed := time.Since(start)
	allowed := paced(handshake.LifecycleRefreshes(), elapsed)
	if redone < 1 || redone > allowed || refused == 0 {
		t.Fatalf("in %s: %d handshakes done again (allowed 1..%d), %d refused", elapsed, redone, allowed, refused)
	}
	if code, _ := f.dsh("max", "GET", "/api/files", cookie, nil); code != http.StatusOK {
		t.Fatalf("the cookie lifecycle kept answers %d", code)
	}
	if v := metric(lc, `aaas_lifecycle_command_duration_seconds_count{outcome="ok",verb="handshake"}`); int(v) != redone+1 {
		t.Fatalf("lifecycle did %v handshakes, the cookies changed %d times after the first", v, redone)
	}
	if v := metric(lc, `aaas_lifecycle_handshake_failures_total{reason="backoff"}`); int(v) != refused {
		t.Fatalf("%v refusals counted, %d seen", v, refused)
	}
	if n := len(f.auditEvents(events.AuditHandshake)); n != redone+1 {
		t.Fatalf("%d handshake audit events for %d handshakes", n, redone+1)
	}
	if n := len(f.auditEvents(events.AuditHandshakeFailed)); n != 0 {
		t.Fatalf("%d refusals were audited", n)
	}
	t.Logf("%s of refreshes: %d handshakes done, %d refused", elapsed.Round(time.Millisecond), redone, refused)
}

// paced is how many goes b allows for one key asked for without pause
// during d.
func paced(b *handshake.Backoff, d time.Duration) int {
	t0 := time.Unix(0, 0)
	n := 0
	for at := t0; !at.After(t0.Add(d)); {
		if wait := b.Next("k", at); wait > 0 {
			at = at.Add(wait)
			continue
		}
		n++
	}
	return n
}

// commands is how many distinct commands of verb p has taken, whatever
// their outcome: its deliveries (every one ends in exactly one outcome,
// "busy" included) less the redeliveries among them.
func commands(p *testenv.Proc, verb events.Verb) int {
	return deliveries(p, verb) - int(metric(p, `aaas_lifecycle_commands_redelivered_total{verb="`+string(verb)+`"}`))
}

// deliveries is how many deliveries of commands of verb p has handled.
func deliveries(p *testenv.Proc, verb events.Verb) int {
	lines, err := p.Metric("aaas_lifecycle_command_duration_seconds_count")
	if err != nil {
		return 0
	}
	n := 0
	for _, l := range strings.Split(lines, "\n") {
		if strings.Contains(l, `verb="`+string(verb)+`"`) {
			f := strings.Fields(l)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			n += int(v)
		}
	}
	return n
}

// bearer signs user up through lifecycle with a token of its own and
// returns the token.
func (f *fixture) bearer(user string) string {
	f.t.Helper()
	token := ident.NewToken(user)
	if res := f.command(events.NewClaim(user, "req-"+user, ident.HashHex(token), "")); res.Outcome != state.OutcomeCreated {
		f.t.Fatalf("claim %s: %+v", user, res)
	}
	f.waitPhase(user, state.PhaseReady)
	return token
}

// Security review S6: a DSH that answers 401 to every cookie no longer
// makes each request a handshake. 1,000 requests through an edge over a
// minute cost a handshake, then what the edge's pacing allows (at once, 2
// s, 6 s, 14 s, 30 s: a few a minute), counted by lifecycle, which is
// asked for no more; another user's handshakes meanwhile take about as
// long as before.
func TestDSHRefusingEveryCookieCostsAFewHandshakes(t *testing.T) {
	f := setup(t, withEnv("DSHSIM_REFUSE_COOKIES", "1"))
	lc := f.lifecycle("lc-a")
	edge := f.Edge("edge-a", nil)
	token := f.bearer("rex")
	f.signup("sue")

	latency := func(hosts ...string) time.Duration {
		var took []time.Duration
		for _, h := range hosts {
			start := time.Now()
			if _, failure := f.handshake("sue", h, 0); failure != "" {
				t.Fatalf("sue's handshake for %s: %s", h, failure)
			}
			took = append(took, time.Since(start))
		}
		slices.Sort(took)
		return took[len(took)/2]
	}
	before := latency("localhost:1", "localhost:2", "localhost:3", "localhost:4", "localhost:5")

	const n = 1000
	client := &http.Client{Timeout: time.Minute}
	statuses := map[int]int{}
	var during time.Duration
	var wg sync.WaitGroup
	wg.Go(func() { during = latency("localhost:6", "localhost:7", "localhost:8", "localhost:9", "localhost:10") })
	start := time.Now()
	tick := time.NewTicker(time.Minute / n) // the load: a thousand requests over a minute
	defer tick.Stop()
	for range n {
		<-tick.C
		req, _ := http.NewRequest(http.MethodGet, edge.URL+"/u/rex/api/files", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Accept", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		statuses[resp.StatusCode]++
	}
	elapsed := time.Since(start)
	wg.Wait()
	if statuses[http.StatusServiceUnavailable] != n {
		t.Fatalf("answers %v, want %d × 503 (DSH kept refusing)", statuses, n)
	}
	var rex int
	for _, e := range f.auditEvents(events.AuditHandshake) {
		if e.User == "rex" {
			rex++
		}
	}
	// The first handshake, then the edge's paced refreshes.
	allowed := 1 + paced(handshake.EdgeRefreshes(), elapsed)
	if rex < 2 || rex > allowed {
		t.Fatalf("%d requests in %s caused %d handshakes for rex, want 2..%d", n, elapsed, rex, allowed)
	}
	if v := metric(lc, `aaas_lifecycle_command_duration_seconds_count{outcome="ok",verb="handshake"}`); int(v) != rex+10 {
		t.Fatalf("lifecycle did %v handshakes, the audit stream says %d for rex and 10 for sue", v, rex)
	}
	// The edge asked for no more than its pacing allows: every handshake
	// command lifecycle got, whatever became of it, was one of those.
	if asked := commands(lc, events.VerbHandshake) - 10; asked > allowed {
		t.Fatalf("the edge asked for %d handshakes of rex, its pacing allows %d", asked, allowed)
	}
	t.Logf("%d requests in %s: %d handshakes for rex; sue's handshake %s before, %s during", n, elapsed.Round(time.Millisecond), rex, before.Round(time.Millisecond), during.Round(time.Millisecond))
	if during > 10*before {
		t.Fatalf("sue's handshakes took %s during rex's requests, %s before", during, before)
	}
}

// Tests row T25 (DSH_LOG_LIMIT_BYTES): a pod that floods its log has it
// read only up to the limit. When the limit cuts the token off, the
// handshake fails saying so; with a tail short enough to fit, the same pod
// is signed in to.
func TestHugePodLogIsReadOnlyUpToTheLimit(t *testing.T) {
	const limit = 64 << 10
	f := setup(t, withEnv("DSHSIM_LOG_FLOOD", fmt.Sprint(4<<20)))
	f.Env["DSH_LOG_LIMIT_BYTES"] = fmt.Sprint(limit)
	lc := f.lifecycle("lc-a")
	f.signup("flo")
	if n := len(f.podLog("flo")); n < 4<<20 {
		t.Fatalf("the pod log holds %d bytes; the test proves nothing", n)
	}
	_, failure := f.handshake("flo", "localhost", 0)
	if !strings.Contains(failure, "missing launch token in the 65536 bytes read") || !strings.Contains(failure, "DSH_LOG_LIMIT_BYTES") {
		t.Fatalf("handshake with the token past the limit: %q", failure)
	}
	bounded := func(p *testenv.Proc) {
		t.Helper()
		sum, count := metric(p, "aaas_lifecycle_handshake_log_bytes_sum"), metric(p, "aaas_lifecycle_handshake_log_bytes_count")
		if count < 1 || sum > count*limit {
			t.Fatalf("%v log reads of %v bytes in all, limit %d each", count, sum, limit)
		}
	}
	bounded(lc)
	lc.Stop()
	f.Env["DSH_LOG_TAIL_LINES"] = "20"
	lc = f.lifecycle("lc-b")
	cookie, failure := f.handshake("flo", "localhost", f.handshakeRev("flo"))
	if failure != "" {
		t.Fatalf("handshake with a tail that fits: %s", failure)
	}
	if code, _ := f.dsh("flo", "GET", "/api/files", cookie, nil); code != http.StatusOK {
		t.Fatalf("DSH answered %d with the cookie", code)
	}
	bounded(lc)
}
