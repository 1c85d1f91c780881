package state

import (
	"slices"
	"strings"
)

// MaxGroups and MaxGroupLen bound the SSO groups kept per user (the SSO
// proxy's header is trusted, but its length is not ours to vouch for).
const (
	MaxGroups   = 100
	MaxGroupLen = 256
)

// GroupName is an SSO group as the budgets and user_groups buckets name
// it: trimmed and lower-case (SSO proxies disagree on case; the edge
// matches ADMIN_GROUPS and AUTH_PROXY_ALLOW without it too). "" for a
// name that cannot be one.
func GroupName(g string) string {
	g = strings.ToLower(strings.TrimSpace(g))
	if len(g) > MaxGroupLen || strings.ContainsFunc(g, func(r rune) bool { return r < ' ' || r == 0x7f }) {
		return ""
	}
	return g
}

// Groups is a header's comma-separated group list as UserGroups keeps
// it: each by GroupName, sorted, once, at most MaxGroups.
func Groups(header string) []string {
	var out []string
	for _, g := range strings.Split(header, ",") {
		if g = GroupName(g); g != "" {
			out = append(out, g)
		}
	}
	slices.Sort(out)
	out = slices.Compact(out)
	if len(out) > MaxGroups {
		out = out[:MaxGroups]
	}
	return out
}

// Applied is the budget that applies to a user and where it comes from.
type Applied struct {
	// Micros is the monthly budget in micro-USD; 0 with Limited false is
	// no budget at all.
	Micros  int64 `json:"micros"`
	Limited bool  `json:"limited"`
	// Scope is BudgetUser (their own), BudgetGroup (Group's, the largest
	// of their groups'), "default" (BROKER_BUDGET_DEFAULT) or "" (none).
	Scope string `json:"scope,omitempty"`
	Group string `json:"group,omitempty"`
}

// ApplyBudget is the rule of the budgets bucket: the user's own budget
// wins; else the largest of their groups' (Unlimited being the largest);
// else the default (0: none).
func ApplyBudget(own *Budget, groups []Budget, defaultMicros int64) Applied {
	if own != nil {
		return Applied{Micros: own.MonthlyMicros, Limited: !own.Unlimited, Scope: BudgetUser}
	}
	var best *Budget
	for i := range groups {
		g := &groups[i]
		if best == nil || g.Unlimited && !best.Unlimited || !best.Unlimited && !g.Unlimited && g.MonthlyMicros > best.MonthlyMicros {
			best = g
		}
	}
	if best != nil {
		return Applied{Micros: best.MonthlyMicros, Limited: !best.Unlimited, Scope: BudgetGroup, Group: best.Name}
	}
	if defaultMicros > 0 {
		return Applied{Micros: defaultMicros, Limited: true, Scope: "default"}
	}
	return Applied{}
}
