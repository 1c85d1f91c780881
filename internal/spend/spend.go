// Package spend is the one reading of model spend and budgets, for the
// user's own page, the admin view and the brokers' ledger: each user's month from the usage
// bucket the brokers write, and the budget that applies to them (their
// own, their SSO groups', or BROKER_BUDGET_DEFAULT; state.ApplyBudget).
// It also records the SSO groups users sign in with into user_groups,
// when they change, so the brokers can apply group budgets.
package spend

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Book reads spend and budgets from the edge's caches.
type Book struct {
	Usage   *kv.Cache[state.Usage]
	Budgets *kv.Cache[state.Budget]
	Groups  *kv.Cache[state.UserGroups]
	// DefaultMicros is BROKER_BUDGET_DEFAULT.
	DefaultMicros int64
}

// Synced reports whether the caches are complete.
func (b *Book) Synced() bool {
	return b.Usage.IsSynced() && b.Budgets.IsSynced() && b.Groups.IsSynced()
}

// Spent is user's usage in month (zero when none).
func (b *Book) Spent(user, month string) state.Usage {
	e, ok := b.Usage.Get(state.UsageKey(user, month))
	if !ok || e.Value.User != user || e.Value.Month != month {
		return state.Usage{User: user, Month: month}
	}
	return e.Value
}

// Budget is the budget that applies to user now.
func (b *Book) Budget(user string) state.Applied {
	var own *state.Budget
	if e, ok := b.Budgets.Get(state.BudgetKey(state.BudgetUser, user)); ok {
		own = &e.Value
	}
	var groups []state.Budget
	if e, ok := b.Groups.Get(user); ok {
		for _, g := range e.Value.Groups {
			if gb, ok := b.Budgets.Get(state.BudgetKey(state.BudgetGroup, g)); ok {
				groups = append(groups, gb.Value)
			}
		}
	}
	return state.ApplyBudget(own, groups, b.DefaultMicros)
}

// Month is every user's usage in month, by name.
func (b *Book) Month(month string) []state.Usage {
	var out []state.Usage
	b.Usage.Range(func(e kv.Entry[state.Usage]) bool {
		if e.Value.Month == month && e.Key == state.UsageKey(e.Value.User, month) {
			out = append(out, e.Value)
		}
		return true
	})
	slices.SortFunc(out, func(x, y state.Usage) int {
		switch {
		case x.User < y.User:
			return -1
		case x.User > y.User:
			return 1
		}
		return 0
	})
	return out
}

// USD writes micro-USD as dollars and cents ("$1.23"), with more places
// for amounts under a cent so a small spend is not shown as nothing.
func USD(micros int64) string {
	sign := ""
	if micros < 0 {
		sign, micros = "-", -micros
	}
	if micros != 0 && micros < 10_000 {
		return fmt.Sprintf("%s$%.4f", sign, float64(micros)/1e6)
	}
	cents := (micros + 5_000) / 10_000
	return fmt.Sprintf("%s$%d.%02d", sign, cents/100, cents%100)
}

// Describe is an applied budget in words: "$20.00 (your own)", "no budget".
func Describe(a state.Applied) string {
	switch {
	case a.Scope == "":
		return "no budget"
	case !a.Limited:
		return "unlimited (" + source(a) + ")"
	}
	return USD(a.Micros) + " a month (" + source(a) + ")"
}

func source(a state.Applied) string {
	switch a.Scope {
	case state.BudgetUser:
		return "set for the user"
	case state.BudgetGroup:
		return "group " + a.Group
	}
	return "the default"
}

// Recorder writes the SSO groups users sign in with into user_groups:
// when they differ from the record, or the record is half its bucket's
// TTL old (it lapses with the sessions), never on every request.
type Recorder struct {
	Bucket *kv.Bucket[state.UserGroups]
	Cache  *kv.Cache[state.UserGroups]
	// Refresh is how old a record may be before it is written again
	// (half the bucket's TTL, the session lifetime).
	Refresh time.Duration
	Log     *slog.Logger

	mu      sync.Mutex
	pending map[string]string // user → groups being written
}

// Seen records that user signed in with the groups header (the SSO
// proxy's, comma-separated). It does not wait for the write, so it copies
// both first: the edge's strings live in the request's buffer, which
// fasthttp reuses once the request is answered.
func (r *Recorder) Seen(user, header string) {
	user, header = strings.Clone(user), strings.Clone(header)
	groups := state.Groups(header)
	if e, ok := r.Cache.Get(user); ok && slices.Equal(e.Value.Groups, groups) && time.Since(e.Value.Seen) < r.Refresh {
		return
	}
	key := fmt.Sprint(groups)
	r.mu.Lock()
	if r.pending == nil {
		r.pending = map[string]string{}
	}
	if r.pending[user] == key {
		r.mu.Unlock()
		return
	}
	r.pending[user] = key
	r.mu.Unlock()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		v := state.UserGroups{User: user, Groups: groups, Seen: time.Now().UTC()}
		rev, err := r.Bucket.Put(ctx, user, v)
		if err != nil {
			r.Log.Warn("SSO groups not recorded", "user", user, "err", err)
		} else {
			r.Cache.Note(user, v, rev)
		}
		r.mu.Lock()
		if r.pending[user] == key {
			delete(r.pending, user)
		}
		r.mu.Unlock()
	}()
}
