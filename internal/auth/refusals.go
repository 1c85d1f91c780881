package auth

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ratelimit"
)

// Refusals are audited once per client per window (ratelimit.Limiter), but clients
// are cheap: an IPv6 /48 is 65,536 of them. So the refusal audits of all
// edges together also share a budget per window (REFUSAL_AUDIT_LIMIT), a
// counter in the ratelimit bucket; no address space can then write faster
// than the audit trail can keep. What an edge does not write it counts
// (a metric) and reports in one summary event when the window ends.

// auditTimeout bounds one read-and-write of the shared count.
const auditTimeout = 5 * time.Second

// refusalAudits writes refusal audit events within the shared budget.
type refusalAudits struct {
	limiter    *ratelimit.Limiter
	limit      int
	pub        *events.Publisher
	suppressed prometheus.Counter

	// mu serialises this edge's spending, so its requests do not race
	// each other for the shared count; full is the window this edge
	// already found spent (it asks no more until the next), pending the
	// refusals not written per window, until its summary, and summarised
	// the last window summarised.
	mu         sync.Mutex
	full       int64
	pending    map[int64]int
	summarised int64
}

func newRefusalAudits(l *ratelimit.Limiter, limit int, pub *events.Publisher, reg prometheus.Registerer) *refusalAudits {
	r := &refusalAudits{limiter: l, limit: limit, pub: pub, full: -1, summarised: -1, pending: map[int64]int{},
		suppressed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_edge_refusal_audits_suppressed_total",
			Help: "Refusals not written to the audit trail because all edges had written REFUSAL_AUDIT_LIMIT in the window (each window's count is in one summary event per edge).",
		})}
	reg.MustRegister(r.suppressed)
	return r
}

// audit writes e if the window's budget allows, else counts it.
func (r *refusalAudits) audit(e events.AuditEvent) {
	if r == nil || r.limiter == nil {
		return
	}
	window := r.limiter.Window()
	r.mu.Lock()
	defer r.mu.Unlock()
	// The window is read under mu: a refusal that waited for mu past its
	// window's end belongs to the next one, whose summary is still to come.
	w := time.Now().UnixMilli() / window.Milliseconds()
	if r.full != w {
		ctx, cancel := context.WithTimeout(context.Background(), auditTimeout)
		ok, err := r.limiter.SpendAudit(ctx, w, r.limit)
		cancel()
		if err == nil && ok {
			r.pub.Audit(e)
			return
		}
		// Spent, or the count cannot be read: either way this edge asks
		// no more this window (a bus that does not answer must not hold
		// every refused request in line behind mu).
		r.full = w
	}
	r.suppressed.Inc()
	// One summary per window, even if the clock and the summary's timer
	// disagree about when the window ended.
	w = max(w, r.summarised+1)
	if r.pending[w]++; r.pending[w] == 1 {
		end := time.UnixMilli((w + 1) * window.Milliseconds())
		time.AfterFunc(time.Until(end), func() { r.summarise(w) })
	}
}

// summarise writes the summary of window w's refusals not written.
func (r *refusalAudits) summarise(w int64) {
	r.mu.Lock()
	n := r.pending[w]
	delete(r.pending, w)
	r.summarised = max(r.summarised, w)
	r.mu.Unlock()
	window := r.limiter.Window()
	start := time.UnixMilli(w * window.Milliseconds()).UTC()
	r.pub.Audit(events.AuditEvent{Kind: events.AuditRateLimited, Outcome: "audits_suppressed",
		Detail: fmt.Sprintf("%d refusals not audited: more than %d in the %s from %s (REFUSAL_AUDIT_LIMIT)", n, r.limit, window, start.Format(time.RFC3339))})
}
