package auth_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/state"
)

// refusingEdge is an edge's Authenticator and a fiber app whose POST
// /login refuses every request the way a wrong token is refused
// (Authenticator.Refused), with its metrics.
type refusingEdge struct {
	app *fiber.App
	reg *prometheus.Registry
}

func newRefusingEdge(t *testing.T, js jetstream.JetStream, name string, window time.Duration, limit int) *refusingEdge {
	t.Helper()
	ctx := natstest.Context(t, time.Minute)
	lim, err := ratelimit.New(ctx, js, 30, window)
	if err != nil {
		t.Fatal(err)
	}
	ub, err := kv.Open[state.User](ctx, js, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	users, err := kv.NewCache(context.Background(), ub, ">", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	a := auth.New(auth.Options{Limiter: lim, Users: users, Publisher: events.NewPublisher(js, name, slog.New(slog.DiscardHandler)),
		RefusalAuditLimit: limit, CookieName: "sid", Metrics: reg})
	clients, err := httpguard.NewPolicy(httpguard.Options{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/32")}, PublicHosts: []string{"*"}})
	if err != nil {
		t.Fatal(err)
	}
	app := fiber.New(fiber.Config{DisableStartupMessage: true})
	app.Use(clients.Middleware)
	app.Post("/login", func(c *fiber.Ctx) error {
		a.Refused(c, events.AuditEvent{Kind: events.AuditLogin, Outcome: "rejected"})
		return c.SendStatus(http.StatusUnauthorized)
	})
	return &refusingEdge{app: app, reg: reg}
}

func (e *refusingEdge) login(t *testing.T, client string) {
	req := httptest.NewRequest(http.MethodPost, "/login", nil)
	req.Header.Set("X-Forwarded-For", client)
	resp, err := e.app.Test(req, -1)
	if err != nil {
		t.Error(err)
		return
	}
	resp.Body.Close()
}

func (e *refusingEdge) suppressed(t *testing.T) int {
	t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "aaas_edge_refusal_audits_suppressed_total" {
			return int(mf.GetMetric()[0].GetCounter().GetValue())
		}
	}
	t.Fatal("no aaas_edge_refusal_audits_suppressed_total")
	return 0
}

// auditEvents is every event in the audit stream, decoded.
func auditEvents(t *testing.T, js jetstream.JetStream) []events.AuditEvent {
	t.Helper()
	ctx := natstest.Context(t, time.Minute)
	st, err := js.Stream(ctx, events.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []events.AuditEvent
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		e, err := events.Decode[events.AuditEvent](m.Data)
		if err != nil {
			t.Fatalf("audit event %d: %v", seq, err)
		}
		out = append(out, e)
	}
	return out
}

// Refusals from distinct IPv6 /64s, each a client's first (so each is one
// the per-client rule audits), are audited within one budget all edges
// share per window (security review S10): two edges, 1,500 clients each,
// write at most REFUSAL_AUDIT_LIMIT refusal events per window between
// them; the first refusals are audited; every refusal not written is
// counted by a metric and in one summary event per edge and window.
func TestRefusalAuditsShareOneBudget(t *testing.T) {
	js := bus(t)
	if err := events.EnsureStreams(natstest.Context(t, time.Minute), js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	const window, limit, perEdge = 2 * time.Second, 7, 1500
	edges := []*refusingEdge{newRefusingEdge(t, js, "edge-a", window, limit), newRefusingEdge(t, js, "edge-b", window, limit)}
	client := func(edge, i int) string { return fmt.Sprintf("2001:db8:%x:%x::1", edge+1, i) }

	start := time.Now()
	// The first refusals, one at a time: all audited, whatever the window.
	for i := range 3 {
		edges[0].login(t, client(0, i))
	}
	var wg sync.WaitGroup
	for e, edge := range edges {
		first := 0
		if e == 0 {
			first = 3
		}
		for g := range 8 {
			wg.Go(func() {
				for i := first + g; i < perEdge; i += 8 {
					edge.login(t, client(e, i))
				}
			})
		}
	}
	wg.Wait()
	end := time.Now()
	windows := int(end.UnixMilli()/window.Milliseconds()-start.UnixMilli()/window.Milliseconds()) + 1

	suppressed := edges[0].suppressed(t) + edges[1].suppressed(t)
	var all []events.AuditEvent
	var audited, summarised, summaries int
	testutil.Eventually(t, 30*time.Second, func() error {
		all = auditEvents(t, js)
		audited, summarised, summaries = 0, 0, 0
		for _, e := range all {
			switch {
			case e.Kind == events.AuditLogin && e.Outcome == "rejected":
				audited++
			case e.Kind == events.AuditRateLimited && e.Outcome == "audits_suppressed":
				var n int
				if _, err := fmt.Sscanf(e.Detail, "%d refusals not audited", &n); err != nil {
					return fmt.Errorf("summary %q: %v", e.Detail, err)
				}
				summarised += n
				summaries++
			}
		}
		if audited+suppressed != 2*perEdge {
			return fmt.Errorf("%d audited and %d counted as suppressed of %d refusals", audited, suppressed, 2*perEdge)
		}
		if summarised != suppressed {
			return fmt.Errorf("summaries report %d refusals not audited, the metrics %d", summarised, suppressed)
		}
		return nil
	})
	if audited > limit*windows {
		t.Fatalf("%d refusals audited in %d windows of %s: more than %d a window", audited, windows, window, limit)
	}
	if summaries > 2*windows {
		t.Fatalf("%d summaries in %d windows from two edges", summaries, windows)
	}
	// Each edge summarises a window once: a refusal that waited for the
	// edge's lock past its window's end is counted in the next window, not
	// in a second summary of its own.
	summarisedWindow := map[string]bool{}
	for _, e := range all {
		if e.Kind == events.AuditRateLimited && e.Outcome == "audits_suppressed" {
			_, from, _ := strings.Cut(e.Detail, " from ")
			if key := e.Source + " " + from; summarisedWindow[key] {
				t.Errorf("%s summarised the window from %s twice", e.Source, from)
			} else {
				summarisedWindow[key] = true
			}
		}
	}
	firsts := map[string]bool{}
	for _, e := range all {
		firsts[e.Client] = true
	}
	for i := range 3 {
		p, _ := netip.MustParseAddr(client(0, i)).Prefix(64)
		if tag := ident.HashHex(p.String())[:16]; !firsts[tag] {
			t.Errorf("refusal %d, among the first, was not audited", i+1)
		}
	}
	t.Logf("%d refusals from distinct /64s on two edges in %s (%d windows of %s): %d audited, %d counted in %d summaries",
		2*perEdge, end.Sub(start).Round(time.Millisecond), windows, window, audited, suppressed, summaries)
}
