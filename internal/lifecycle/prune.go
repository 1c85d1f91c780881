package lifecycle

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/state"
)

// pruner removes the sessions of accounts that no longer exist: a session
// an edge wrote while the account's deletion was purging them, or one of a
// claim removed while no replica mirrored. It is lifecycle's because
// lifecycle writes sessions anyway: an identity allowed to purge a session
// may put one on the same subject (NATS cannot tell the two apart), which
// is why the sweeper, which once pruned, may now write none. The replica
// that mirrors prunes, every PRUNE_INTERVAL. It also removes sandbox
// origins' sessions whose gateway session is gone: the edges refuse them
// already (auth.Authenticator.Valid), and they would otherwise stay until
// their TTL.
type pruner struct {
	w        *Worker
	interval time.Duration
	passes   prometheus.Counter
	pruned   prometheus.Counter
}

// pruneTerm is what one term of leadership remembers between passes.
type pruneTerm struct {
	*pruner
	// missing is the users missing on the last pass.
	missing map[string]bool
	// parents is each session key's parent's key, "" for a gateway
	// session, learned once per key (keys are listed every pass, values
	// read only for keys not seen before).
	parents map[string]string
}

func newPruner(w *Worker, interval time.Duration, reg prometheus.Registerer) *pruner {
	p := &pruner{
		w: w, interval: interval,
		passes: prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_lifecycle_prune_passes_total", Help: "Passes over the sessions looking for those of accounts that are gone (one per PRUNE_INTERVAL on the mirroring replica)."}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_lifecycle_pruned_sessions_total", Help: "Sessions removed because their account is gone, or (a sandbox origin's) their gateway session."}),
	}
	reg.MustRegister(p.passes, p.pruned)
	return p
}

// run prunes every interval until ctx ends (the end of a term of
// leadership). What it remembers between passes lives for the term only.
func (p *pruner) run(ctx context.Context) {
	tick := time.NewTicker(p.interval)
	defer tick.Stop()
	t := &pruneTerm{pruner: p, parents: map[string]string{}}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if p.w.userCache.IsSynced() {
				t.pass(ctx)
			}
		}
	}
}

// pass removes the sessions of users that were missing on the previous
// pass and still are, so that an account whose record has not reached
// this replica's cache yet is not mistaken for a deleted one.
func (p *pruneTerm) pass(ctx context.Context) {
	keys, err := p.w.sessions.Keys(ctx, ">")
	if err != nil {
		p.w.log.Warn("prune: list sessions", "err", err)
		return
	}
	missingBefore := p.missing
	p.passes.Inc()
	missing := map[string]bool{}
	present := make(map[string]bool, len(keys))
	for _, k := range keys {
		present[k] = true
	}
	for k := range p.parents {
		if !present[k] {
			delete(p.parents, k)
		}
	}
	for _, k := range keys {
		user, _, _ := strings.Cut(k, ".")
		if _, ok := p.w.userCache.Get(user); ok {
			if parent := p.parent(ctx, k, user); parent != "" && !present[parent] {
				p.purge(ctx, k, user)
			}
			continue
		}
		missing[user] = true
		if !missingBefore[user] {
			continue
		}
		p.purge(ctx, k, user)
	}
	p.missing = missing
}

// parent is the key of the gateway session the sandbox session at key was
// made from, "" for a gateway session (or an SSO one, whose account
// pruning covers, or one that could not be read).
func (p *pruneTerm) parent(ctx context.Context, key, user string) string {
	if parent, ok := p.parents[key]; ok {
		return parent
	}
	e, err := p.w.sessions.Get(ctx, key)
	if err != nil {
		return ""
	}
	parent := ""
	if e.Value.Host != "" && e.Value.Parent != "" {
		parent = state.SessionKey(user, e.Value.Parent)
	}
	p.parents[key] = parent
	return parent
}

func (p *pruneTerm) purge(ctx context.Context, key, user string) {
	if err := p.w.sessions.Purge(ctx, key); err != nil {
		if !errors.Is(err, context.Canceled) {
			p.w.log.Warn("prune: purge session", "user", user, "err", err)
		}
		return
	}
	delete(p.parents, key)
	p.pruned.Inc()
}
