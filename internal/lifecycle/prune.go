package lifecycle

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/state"
)

// pruner removes the sessions of accounts that no longer exist: a session
// an edge wrote while the account's deletion was purging them, or one of a
// claim removed while no replica mirrored. It is lifecycle's because
// lifecycle writes sessions anyway: an identity allowed to purge a session
// may put one on the same subject (NATS cannot tell the two apart), which
// is why the sweeper, which once pruned, may now write none. It also
// removes sandbox origins' sessions whose gateway session is gone: the
// edges refuse them already (auth.Authenticator.Valid), and they would
// otherwise stay until their TTL.
//
// Its work follows changes, not the number of sessions: the replica that
// mirrors follows the sessions' and accounts' keys (headers only), and a
// user whose account went, whose session went, or who got a session
// without an account (as far as this replica knows yet) is looked at once,
// PRUNE_INTERVAL later, by their own keys. Only when a term of leadership
// starts, or a watch may have missed changes, does it list every session
// key, once, for the sessions of accounts that are gone.
type pruner struct {
	w        *Worker
	interval time.Duration
	passes   prometheus.Counter
	full     prometheus.Counter
	checked  prometheus.Counter
	pruned   prometheus.Counter
}

// pruneTerm is what one term of leadership remembers.
type pruneTerm struct {
	*pruner
	mu sync.Mutex
	// due is each user to look at, and since when: looked at once
	// PRUNE_INTERVAL has passed, so that an account whose record has not
	// reached this replica's cache yet is not mistaken for a deleted one.
	due map[string]time.Time
	// listAll: every session key is to be listed (the term's start, or a
	// watch restarted and may have missed changes).
	listAll bool
}

func newPruner(w *Worker, interval time.Duration, reg prometheus.Registerer) *pruner {
	p := &pruner{
		w: w, interval: interval,
		passes:  prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_lifecycle_prune_passes_total", Help: "Pruning passes (one per PRUNE_INTERVAL on the mirroring replica), each looking at the users changes named."}),
		full:    prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_lifecycle_prune_full_passes_total", Help: "Pruning passes that listed every session key: one per term of leadership, and one after a watch that may have missed changes."}),
		checked: prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_lifecycle_prune_users_checked_total", Help: "Users whose sessions pruning looked at (after a change to their account or sessions)."}),
		pruned:  prometheus.NewCounter(prometheus.CounterOpts{Name: "aaas_lifecycle_pruned_sessions_total", Help: "Sessions removed because their account is gone, or (a sandbox origin's) their gateway session."}),
	}
	reg.MustRegister(p.passes, p.full, p.checked, p.pruned)
	return p
}

// run prunes every interval until ctx ends (the end of a term of
// leadership). What it remembers lives for the term only.
func (p *pruner) run(ctx context.Context) {
	t := &pruneTerm{pruner: p, due: map[string]time.Time{}, listAll: true}
	// The term's watches end with it: run returns only after they have,
	// so no callback of this term runs into the next.
	var follows sync.WaitGroup
	defer follows.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	follows.Go(func() { p.w.sessions.Follow(ctx, p.w.log, t.sessionChanged, t.missed) })
	follows.Go(func() { p.w.users.Follow(ctx, p.w.log, t.accountChanged, t.missed) })
	tick := time.NewTicker(t.interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if t.w.userCache.IsSynced() {
				t.pass(ctx)
			}
		}
	}
}

// sessionChanged: a session that went may have been a sandbox session's
// parent; one put for a user without an account (here, yet) may be a
// straggler of a deletion.
func (t *pruneTerm) sessionChanged(key string, present bool) {
	user, _, _ := strings.Cut(key, ".")
	if present {
		if _, ok := t.w.userCache.Get(user); ok {
			return
		}
	}
	t.mark(user)
}

// accountChanged: an account that went leaves its sessions to prune.
func (t *pruneTerm) accountChanged(user string, present bool) {
	if !present {
		t.mark(user)
	}
}

func (t *pruneTerm) missed() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.listAll = true
}

func (t *pruneTerm) mark(user string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.due[user]; !ok {
		t.due[user] = time.Now()
	}
}

// pass looks at every user marked at least an interval ago, after
// listing every session key when that is owed.
func (t *pruneTerm) pass(ctx context.Context) {
	t.passes.Inc()
	t.mu.Lock()
	listAll := t.listAll
	t.listAll = false
	t.mu.Unlock()
	if listAll && !t.markGone(ctx) {
		t.missed() // try again next pass
	}
	ripe := time.Now().Add(-t.interval)
	var users []string
	t.mu.Lock()
	for user, since := range t.due {
		if !since.After(ripe) {
			users = append(users, user)
			delete(t.due, user)
		}
	}
	t.mu.Unlock()
	for _, user := range users {
		if err := t.check(ctx, user); err != nil {
			if !errors.Is(err, context.Canceled) {
				t.w.log.Warn("prune: look at sessions", "user", user, "err", err)
			}
			t.mark(user)
		}
	}
}

// markGone lists every session key and marks the users without an
// account here: their sessions go on a later pass if the account is
// still missing then. The keys stream past, held by nobody: at a million
// accounts there are five million of them.
func (t *pruneTerm) markGone(ctx context.Context) bool {
	last := ""
	err := t.w.sessions.EachKey(ctx, ">", func(k string) {
		user, _, _ := strings.Cut(k, ".")
		if user == last {
			return // a user's keys come together: looked at already
		}
		last = user
		if _, ok := t.w.userCache.Get(user); !ok {
			t.mark(user)
		}
	})
	if err != nil {
		t.w.log.Warn("prune: list sessions", "err", err)
		return false
	}
	t.full.Inc()
	return true
}

// check removes user's sessions when the account is gone, and otherwise
// the sandbox sessions whose gateway session is gone: it reads that
// user's keys (at most MAX_SESSIONS_PER_USER and their sandbox sessions)
// and nobody else's.
func (t *pruneTerm) check(ctx context.Context, user string) error {
	t.checked.Inc()
	keys, err := t.w.sessions.Keys(ctx, user+".*")
	if err != nil || len(keys) == 0 {
		return err
	}
	if _, ok := t.w.userCache.Get(user); !ok {
		for _, k := range keys {
			t.purge(ctx, k, user)
		}
		return nil
	}
	present := make(map[string]bool, len(keys))
	for _, k := range keys {
		present[k] = true
	}
	for _, k := range keys {
		e, err := t.w.sessions.Get(ctx, k)
		if err != nil {
			continue // gone since, or unreadable: nothing to decide by
		}
		if e.Value.Host != "" && e.Value.Parent != "" && !present[state.SessionKey(user, e.Value.Parent)] {
			t.purge(ctx, k, user)
		}
	}
	return nil
}

func (t *pruneTerm) purge(ctx context.Context, key, user string) {
	if err := t.w.sessions.Purge(ctx, key); err != nil {
		if !errors.Is(err, context.Canceled) {
			t.w.log.Warn("prune: purge session", "user", user, "err", err)
		}
		return
	}
	t.pruned.Inc()
}
