package edge

import (
	"context"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/proxy"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
)

// edgeState is every bucket and watch cache the edge reads or writes.
type edgeState struct {
	store            *auth.Store
	limiter, actions *ratelimit.Limiter
	users            *kv.Cache[state.User]
	boxes            *kv.Cache[state.Sandbox]
	// names are every account's (the first source) and sandbox's name,
	// for the admin list and MAX_USERS, loaded when first needed.
	names        *kv.Names
	tokensBucket *kv.Bucket[state.APIToken]
	apiTokens    *kv.Cache[state.APIToken]
	handshakes   *kv.Cache[state.Handshake]
	requests     *kv.Cache[state.Result]
	queued       *kv.Cache[state.Queued]
	queue        capacity.Queue
	// rollouts is a record per profile, for the admin view.
	rollouts   *kv.Cache[state.Rollout]
	book       *spend.Book
	recorder   *spend.Recorder
	budgets    *kv.Bucket[state.Budget]
	keepAwake  *kv.Bucket[state.KeepAwake]
	keepAwakes *kv.Cache[state.KeepAwake]
	// codes is the sign-in codes of sandbox origins (SANDBOX_DOMAIN set).
	codes *kv.Bucket[state.SigninCode]
	// credentials is users' own provider keys (BYOK set).
	credentials *kv.Bucket[state.Credential]
	// changes is told whose session ended and whose account or API token
	// changed, here or on another edge: the proxy re-checks their open
	// streams.
	changes *proxy.Changes
}

func openState(ctx context.Context, p *process.Process, cfg config.Edge) (*edgeState, error) {
	s := &edgeState{changes: proxy.NewChanges()}
	var err error
	if s.store, err = auth.NewStore(ctx, p.JS, auth.StoreOptions{
		TTL: cfg.Buckets.SessionTTL, MaxPerUser: cfg.MaxSessionsPerUser, Limit: cfg.CacheLimits().Sessions, OnRevoke: s.changes.User, Log: p.Log,
	}); err != nil {
		return nil, err
	}
	if s.limiter, err = ratelimit.New(ctx, p.JS, cfg.AuthRateLimit, cfg.Buckets.RateWindow); err != nil {
		return nil, err
	}
	if s.actions, err = ratelimit.New(ctx, p.JS, cfg.RecreateRateLimit, cfg.Buckets.RateWindow); err != nil {
		return nil, err
	}
	// The records of users this edge serves: bounded (EDGE_CACHE_USERS),
	// read on first use.
	limits := cfg.CacheLimits()
	users, err := kv.Open[state.User](ctx, p.JS, state.BucketUsers)
	if err != nil {
		return nil, err
	}
	if s.users, err = kv.NewCache(ctx, users, ">", p.Log, kv.Bounded[state.User](limits.Users), kv.OnChange(func(user string, _ kv.Entry[state.User], _ bool) { s.changes.User(user) })); err != nil {
		return nil, err
	}
	boxes, err := kv.Open[state.Sandbox](ctx, p.JS, state.BucketSandboxes)
	if err != nil {
		return nil, err
	}
	if s.boxes, err = kv.NewCache(ctx, boxes, ">", p.Log, kv.Bounded[state.Sandbox](limits.Sandboxes)); err != nil {
		return nil, err
	}
	s.names = kv.NewNames(ctx, p.Log, users.KeySource(), boxes.KeySource())
	// The API tokens this edge authenticated: one deleted or lapsed
	// anywhere ends the streams it opened (a token held here is kept
	// true by the watch).
	if s.tokensBucket, err = kv.Open[state.APIToken](ctx, p.JS, state.BucketAPITokens); err != nil {
		return nil, err
	}
	if s.apiTokens, err = kv.NewCache(ctx, s.tokensBucket, ">", p.Log, kv.Bounded[state.APIToken](limits.APITokens),
		kv.OnChange(func(key string, _ kv.Entry[state.APIToken], _ bool) { s.changes.User(state.APITokenUser(key)) })); err != nil {
		return nil, err
	}
	if s.handshakes, err = cache(ctx, p, state.BucketHandshakes, kv.Bounded[state.Handshake](limits.Handshakes)); err != nil {
		return nil, err
	}
	if s.requests, err = cache[state.Result](ctx, p, state.BucketRequests); err != nil {
		return nil, err
	}
	if s.queued, err = cache[state.Queued](ctx, p, state.BucketQueue); err != nil {
		return nil, err
	}
	s.queue = capacity.NewQueue(s.queued)
	if s.rollouts, err = cache[state.Rollout](ctx, p, state.BucketRollouts); err != nil {
		return nil, err
	}
	if err := s.openSpending(ctx, p, cfg); err != nil {
		return nil, err
	}
	if s.keepAwake, err = kv.Open[state.KeepAwake](ctx, p.JS, state.BucketKeepAwake); err != nil {
		return nil, err
	}
	// Keep-awakes and SSO groups, like the records above, only of the
	// users this edge serves.
	if s.keepAwakes, err = kv.NewCache(ctx, s.keepAwake, ">", p.Log, kv.Bounded[state.KeepAwake](limits.Users)); err != nil {
		return nil, err
	}
	if cfg.SandboxDomain != "" {
		if s.codes, err = kv.Open[state.SigninCode](ctx, p.JS, state.BucketSigninCodes); err != nil {
			return nil, err
		}
	}
	if cfg.BYOK {
		if s.credentials, err = kv.Open[state.Credential](ctx, p.JS, state.BucketCredentials); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// openSpending opens the caches of model spend, budgets and SSO groups
// the user's page and the admin view read, the recorder of the groups,
// and the bucket budget overrides are written to.
func (s *edgeState) openSpending(ctx context.Context, p *process.Process, cfg config.Edge) error {
	usageBucket, err := kv.Open[state.Usage](ctx, p.JS, state.BucketUsage)
	if err != nil {
		return err
	}
	// Spend, like the records above, only of the users this edge serves;
	// the admin view reads a whole month by the month (spend.Months).
	usage, err := kv.NewCache(ctx, usageBucket, ">", p.Log, kv.Bounded[state.Usage](cfg.CacheLimits().Users))
	if err != nil {
		return err
	}
	budgets, err := cache[state.Budget](ctx, p, state.BucketBudgets)
	if err != nil {
		return err
	}
	if s.budgets, err = kv.Open[state.Budget](ctx, p.JS, state.BucketBudgets); err != nil {
		return err
	}
	groupsBucket, err := kv.Open[state.UserGroups](ctx, p.JS, state.BucketUserGroups)
	if err != nil {
		return err
	}
	groups, err := kv.NewCache(ctx, groupsBucket, ">", p.Log, kv.Bounded[state.UserGroups](cfg.CacheLimits().Users))
	if err != nil {
		return err
	}
	s.book = &spend.Book{Usage: usage, Months: &spend.Months{Bucket: usageBucket, Log: p.Log, Life: ctx}, Budgets: budgets, Groups: groups, DefaultMicros: cfg.DefaultMicros}
	s.recorder = &spend.Recorder{Bucket: groupsBucket, Cache: groups, Refresh: cfg.Buckets.SessionTTL / 2, Log: p.Log}
	return nil
}

func cache[T any](ctx context.Context, p *process.Process, bucket string, opts ...kv.CacheOption[T]) (*kv.Cache[T], error) {
	b, err := kv.Open[T](ctx, p.JS, bucket)
	if err != nil {
		return nil, err
	}
	return kv.NewCache(ctx, b, ">", p.Log, opts...)
}
