package accounts_test

import (
	"fmt"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
)

// suppressedMetric is an edge's count of refusals it did not audit.
func suppressedMetric(t *testing.T, e *testenv.Edge) int {
	t.Helper()
	m, err := e.Metric("aaas_edge_refusal_audits_suppressed_total")
	if err != nil {
		t.Fatal(err)
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(m, "aaas_edge_refusal_audits_suppressed_total")), 64)
	if err != nil {
		t.Fatalf("%q: %v", m, err)
	}
	return int(f)
}

// 100,000 refused logins from distinct IPv6 /64s (every one a client's
// first refusal, which the per-client rule audits), spread over two
// edges, add at most REFUSAL_AUDIT_LIMIT (60) refusal events per window
// between them, plus one summary per edge and window (security review
// S10). The first refusals are audited; every other one is counted by a
// metric and in the summaries; and the trail, capped at 16 MB here (the
// 100,000 events would be about 17 MB), keeps the records written before.
func TestRefusalsFromAnAddressSpaceKeepTheAuditTrail(t *testing.T) {
	const flood, limit, window = 100_000, 60, 10 * time.Second
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{
		"SIGNUP_INVITE_CODE": invite, "AUDIT_MAX_MB": "16", "AUTH_RATE_WINDOW": window.String(),
	}, Lifecycle: "lc-a"})
	edges := []*testenv.Edge{
		w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"}),
		w.Edge("edge-b", map[string]string{"TRUSTED_PROXIES": "127.0.0.1"}),
	}
	testenv.NewClient(t, edges[0].URL).Signup("old", invite)
	var marker events.AuditEvent
	testutil.Eventually(t, 10*time.Second, func() error {
		for _, e := range auditEvents(t, w) {
			if e.Kind == events.AuditSignup && e.User == "old" {
				marker = e
				return nil
			}
		}
		return fmt.Errorf("no signup event for old yet")
	})
	before := len(auditEvents(t, w))

	client := func(i int) string { return fmt.Sprintf("2001:db8:%x:%x::1", i>>16, i&0xffff) }
	tag := func(i int) string {
		p, _ := netip.MustParseAddr(client(i)).Prefix(64)
		return ident.HashHex(p.String())[:16]
	}
	login := func(c *testenv.Client, i int) int {
		return c.Do(http.MethodPost, "/login", strings.NewReader("token=nobody.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
			"Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json", "X-Forwarded-For", client(i)).StatusCode
	}
	clients := []*testenv.Client{testenv.NewClient(t, edges[0].URL).From("127.0.0.1"), testenv.NewClient(t, edges[1].URL).From("127.0.0.1")}
	start := time.Now()
	// The first refusals, one at a time.
	const firsts = 3
	for i := range firsts {
		if st := login(clients[0], i); st != http.StatusUnauthorized {
			t.Fatalf("refusal %d: %d", i, st)
		}
	}
	var next atomic.Int64
	next.Store(firsts)
	var wrong atomic.Int64
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < flood; i = int(next.Add(1)) - 1 {
				if st := login(clients[g%2], i); st != http.StatusUnauthorized {
					wrong.Add(1)
				}
			}
		})
	}
	wg.Wait()
	end := time.Now()
	if wrong.Load() != 0 {
		t.Fatalf("%d of the flood's logins were not refused as wrong tokens: the flood did not happen as intended", wrong.Load())
	}
	ms := window.Milliseconds()
	windows := int(end.UnixMilli()/ms-start.UnixMilli()/ms) + 1

	// Read the trail only when it is small enough to: a trail that grew by
	// the flood fails here.
	evs := auditEvents(t, w)
	if added := len(evs) - before; added > (limit+len(edges))*windows+100 {
		t.Fatalf("%d refusals in %d windows of %s added %d audit events, want at most %d a window", flood, windows, window, added, limit+len(edges))
	}
	var audited, summarised, summaries, suppressed int
	testutil.Eventually(t, 3*window, func() error {
		evs = auditEvents(t, w)
		audited, summarised, summaries = count(evs, refusal), 0, 0
		for _, e := range evs {
			if e.Kind == events.AuditRateLimited && e.Outcome == "audits_suppressed" {
				var n int
				if _, err := fmt.Sscanf(e.Detail, "%d refusals not audited", &n); err != nil {
					return fmt.Errorf("summary %q: %v", e.Detail, err)
				}
				summarised, summaries = summarised+n, summaries+1
			}
		}
		suppressed = suppressedMetric(t, edges[0]) + suppressedMetric(t, edges[1])
		if audited+suppressed != flood || summarised != suppressed {
			return fmt.Errorf("%d refusals audited, %d counted by the metrics, %d in summaries: want %d in all, each counted one summarised", audited, suppressed, summarised, flood)
		}
		return nil
	})
	if audited > limit*windows || summaries > len(edges)*windows {
		t.Fatalf("%d refusals audited and %d summaries in %d windows: want at most %d and %d a window", audited, summaries, windows, limit, len(edges))
	}
	audit := map[string]bool{}
	for _, e := range evs {
		if refusal(e) {
			audit[e.Client] = true
		}
	}
	for i := range firsts {
		if !audit[tag(i)] {
			t.Errorf("refusal %d, among the first, was not audited", i+1)
		}
	}
	kept := false
	for _, e := range evs {
		kept = kept || e.Kind == marker.Kind && e.User == marker.User && e.At.Equal(marker.At)
	}
	if !kept {
		t.Fatal("the signup recorded before the flood is gone from the trail")
	}
	t.Logf("%d refused logins from distinct /64s on two edges in %s (%d windows of %s): %d audited, %d counted and summarised in %d events",
		flood, end.Sub(start).Round(time.Millisecond), windows, window, audited, suppressed, summaries)
}
