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
	// Usage holds the months of the users the edge serves (bounded, read
	// on a miss); Months reads every user's month for the admin view (nil
	// where nothing reads a whole month: the broker).
	Usage   *kv.Cache[state.Usage]
	Months  *Months
	Budgets *kv.Cache[state.Budget]
	Groups  *kv.Cache[state.UserGroups]
	// DefaultMicros is BROKER_BUDGET_DEFAULT.
	DefaultMicros int64
}

// Synced reports whether the caches are complete.
func (b *Book) Synced() bool {
	return b.Usage.IsSynced() && b.Budgets.IsSynced() && b.Groups.IsSynced()
}

// Spent is user's usage in month (zero when none), read if not held.
func (b *Book) Spent(ctx context.Context, user, month string) state.Usage {
	e, ok := b.Usage.Load(ctx, state.UsageKey(user, month))
	if !ok || e.Value.User != user || e.Value.Month != month {
		return state.Usage{User: user, Month: month}
	}
	return e.Value
}

// Budget is the budget that applies to user now. The user's SSO groups
// are read if not held (an edge holds those of the users it serves).
func (b *Book) Budget(ctx context.Context, user string) state.Applied {
	var own *state.Budget
	if e, ok := b.Budgets.Get(state.BudgetKey(state.BudgetUser, user)); ok {
		own = &e.Value
	}
	var groups []state.Budget
	if e, ok := b.Groups.Load(ctx, user); ok {
		for _, g := range e.Value.Groups {
			if gb, ok := b.Budgets.Get(state.BudgetKey(state.BudgetGroup, g)); ok {
				groups = append(groups, gb.Value)
			}
		}
	}
	return state.ApplyBudget(own, groups, b.DefaultMicros)
}

// Months reads every user's usage in a month, by the keys' month
// ("*.<month>"), so what it costs grows with that month's users, not with
// every account or month there has been. The current month is followed
// by a cache of its own (the admin's spend order reads it on every page),
// opened on the first ask and closed when the next month takes its place;
// any other month is read once.
type Months struct {
	Bucket *kv.Bucket[state.Usage]
	Log    *slog.Logger
	// Life bounds the followed month's watch (the process's).
	Life context.Context
	// Now is the clock that says which month is current (nil: time.Now).
	Now func() time.Time

	mu     sync.Mutex
	month  string
	cache  *kv.Cache[state.Usage]
	cancel context.CancelFunc
}

// Month is every user's usage in month, by name: from the followed
// month's cache when current is that month (now's), else read once.
func (m *Months) Month(ctx context.Context, month string) ([]state.Usage, error) {
	var out []state.Usage
	keep := func(e kv.Entry[state.Usage]) {
		if e.Value.Month == month && e.Key == state.UsageKey(e.Value.User, month) {
			out = append(out, e.Value)
		}
	}
	filter := "*." + month
	now := time.Now
	if m.Now != nil {
		now = m.Now
	}
	if month != state.Month(now()) {
		es, err := m.Bucket.List(ctx, filter)
		if err != nil {
			return nil, err
		}
		for _, e := range es {
			keep(e)
		}
	} else {
		c, err := m.follow(ctx, month, filter)
		if err != nil {
			return nil, err
		}
		c.Range(func(e kv.Entry[state.Usage]) bool { keep(e); return true })
	}
	slices.SortFunc(out, func(x, y state.Usage) int { return strings.Compare(x.User, y.User) })
	return out, nil
}

// follow is the cache of month, opened (and the last month's closed) on
// the first ask, and synced.
func (m *Months) follow(ctx context.Context, month, filter string) (*kv.Cache[state.Usage], error) {
	m.mu.Lock()
	if m.month != month {
		if m.cancel != nil {
			m.cancel()
		}
		life, cancel := context.WithCancel(m.Life)
		c, err := kv.NewCache(life, m.Bucket, filter, m.Log)
		if err != nil {
			cancel()
			m.mu.Unlock()
			return nil, err
		}
		m.month, m.cache, m.cancel = month, c, cancel
	}
	c := m.cache
	m.mu.Unlock()
	select {
	case <-c.Synced():
		return c, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("%s's usage is still loading: %w", month, ctx.Err())
	}
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
// proxy's, comma-separated). It does not wait for the read or the write,
// so it copies both first: the edge's strings live in the request's
// buffer, which fasthttp reuses once the request is answered.
func (r *Recorder) Seen(user, header string) {
	current := func(e kv.Entry[state.UserGroups], ok bool, groups []string) bool {
		return ok && slices.Equal(e.Value.Groups, groups) && time.Since(e.Value.Seen) < r.Refresh
	}
	// The hot path: the record held (the cache holds the users this edge
	// serves) and current.
	if e, ok := r.Cache.Get(user); ok && current(e, ok, state.Groups(header)) {
		return
	}
	user, header = strings.Clone(user), strings.Clone(header)
	groups := state.Groups(header)
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
		// Not held: read, so that a record another edge keeps current is
		// not written again.
		if e, ok := r.Cache.Load(ctx, user); !current(e, ok, groups) {
			v := state.UserGroups{User: user, Groups: groups, Seen: time.Now().UTC()}
			rev, err := r.Bucket.Put(ctx, user, v)
			if err != nil {
				r.Log.Warn("SSO groups not recorded", "user", user, "err", err)
			} else {
				r.Cache.Note(user, v, rev)
			}
		}
		r.mu.Lock()
		if r.pending[user] == key {
			delete(r.pending, user)
		}
		r.mu.Unlock()
	}()
}
