package state

import (
	"crypto/sha256"
	"encoding/hex"
	"time"
)

// Buckets of the model-API broker (cmd/broker).
const (
	// BucketUsage holds each user's model-call totals per calendar month
	// (UTC), written by the brokers after every call and read back before
	// the next to enforce the budget.
	BucketUsage = "usage"
	// BucketBudgets holds the monthly budget overrides an administrator
	// set, per user and per SSO group; the default is BROKER_BUDGET_DEFAULT.
	BucketBudgets = "budgets"
	// BucketModelCalls holds each user's model calls in flight on any
	// broker, for the per-user concurrency cap.
	BucketModelCalls = "model_calls"
	// BucketCredentials holds the provider keys users brought (BYOK),
	// sealed to the brokers' key ring: only a broker can open one.
	BucketCredentials = "credentials"
	// BucketUserGroups holds the SSO groups an edge last saw a user
	// authenticate with, so a broker can apply a group's budget.
	BucketUserGroups = "user_groups"
)

// Month is the calendar month (UTC) a call at t is counted in: "2026-12".
func Month(t time.Time) string { return t.UTC().Format("2006-01") }

// UsageKey is <user>.<month>.
func UsageKey(user, month string) string { return user + "." + month }

// Usage is one user's model calls in one month. Costs are in micro-USD
// (a price of p USD per million tokens is p micro-USD per token). Calls
// made with the user's own key (BYOK) are counted apart and are not
// charged to the budget.
type Usage struct {
	User  string `json:"user"`
	Month string `json:"month"`
	// Calls counts every call that reached a provider; Estimated those
	// whose tokens the provider did not report (counted from the bytes).
	Calls            int64 `json:"calls"`
	Estimated        int64 `json:"estimated"`
	InputTokens      int64 `json:"input_tokens"`
	OutputTokens     int64 `json:"output_tokens"`
	CachedTokens     int64 `json:"cached_tokens"`
	CacheWriteTokens int64 `json:"cache_write_tokens,omitempty"`
	// CostMicros is what the organisation pays, the budget's measure.
	CostMicros int64 `json:"cost_micros"`
	// BYOKCalls and BYOKCostMicros are the calls made with the user's
	// own key: metered, never charged.
	BYOKCalls      int64     `json:"byok_calls,omitempty"`
	BYOKCostMicros int64     `json:"byok_cost_micros,omitempty"`
	Updated        time.Time `json:"updated"`
	// Recent are the ids of the last UsageRecentCalls calls added, oldest
	// first, so a call whose update was applied but whose acknowledgement
	// was lost is not added again when its record is retried.
	Recent []string `json:"recent,omitempty"`
}

// UsageRecentCalls bounds Usage.Recent. A retried record is recognised
// as long as fewer calls of the same user were added since its first
// attempt; a record is retried in the order it was held, so that window
// is the user's calls in flight (BROKER_MAX_CONCURRENT_CALLS, 4 by
// default) with room to spare, and it costs a month's record about 2 KiB.
const UsageRecentCalls = 64

// Budget scopes.
const (
	BudgetUser  = "user"
	BudgetGroup = "group"
)

// BudgetKey is <scope>.<user> for a user, group.<hash> for an SSO group
// (group names carry characters keys cannot).
func BudgetKey(scope, name string) string {
	if scope == BudgetGroup {
		sum := sha256.Sum256([]byte(name))
		return BudgetGroup + "." + hex.EncodeToString(sum[:16])
	}
	return scope + "." + name
}

// Budget is a monthly budget an administrator set for a user or an SSO
// group. A user's own budget wins over their groups'; of several groups'
// the largest applies. Unlimited means no cap at all.
type Budget struct {
	Scope         string    `json:"scope"`
	Name          string    `json:"name"`
	MonthlyMicros int64     `json:"monthly_micros"`
	Unlimited     bool      `json:"unlimited,omitempty"`
	SetBy         string    `json:"set_by"`
	At            time.Time `json:"at"`
}

// ModelCalls is one user's calls in flight on any broker: call id →
// the moment the slot lapses even if its broker never releases it
// (killed mid-call).
type ModelCalls struct {
	User  string               `json:"user"`
	Slots map[string]time.Time `json:"slots"`
}

// CredentialKey is <user>.<provider>.
func CredentialKey(user, provider string) string { return user + "." + provider }

// Credential is a provider key a user brought, sealed so that only a
// broker can open it: the edge that stored it cannot read it back.
type Credential struct {
	User     string `json:"user"`
	Provider string `json:"provider"`
	// Sealed is the key sealed to the broker key ring's public key KeyID.
	Sealed []byte `json:"sealed"`
	KeyID  string `json:"key_id"`
	// Hint is the key's last four characters, all the user is shown again.
	Hint string    `json:"hint"`
	Set  time.Time `json:"set"`
}

// UserGroups is the SSO groups an edge last saw user sign in with.
type UserGroups struct {
	User   string    `json:"user"`
	Groups []string  `json:"groups"`
	Seen   time.Time `json:"seen"`
}
