package state

import (
	"reflect"
	"strings"
	"testing"
)

func TestApplyBudget(t *testing.T) {
	own := &Budget{Scope: BudgetUser, Name: "ann", MonthlyMicros: 5}
	g := func(name string, micros int64, unlimited bool) Budget {
		return Budget{Scope: BudgetGroup, Name: name, MonthlyMicros: micros, Unlimited: unlimited}
	}
	for _, tc := range []struct {
		name   string
		own    *Budget
		groups []Budget
		def    int64
		want   Applied
	}{
		{"nothing", nil, nil, 0, Applied{}},
		{"default", nil, nil, 20, Applied{Micros: 20, Limited: true, Scope: "default"}},
		{"own wins over groups and default", own, []Budget{g("eng", 100, false)}, 20, Applied{Micros: 5, Limited: true, Scope: BudgetUser}},
		{"own unlimited", &Budget{Unlimited: true}, nil, 20, Applied{Scope: BudgetUser}},
		{"own zero is a budget of nothing", &Budget{}, nil, 20, Applied{Limited: true, Scope: BudgetUser}},
		{"largest group", nil, []Budget{g("eng", 100, false), g("ops", 300, false), g("all", 200, false)}, 20, Applied{Micros: 300, Limited: true, Scope: BudgetGroup, Group: "ops"}},
		{"an unlimited group is the largest", nil, []Budget{g("eng", 100, false), g("ops", 0, true)}, 20, Applied{Scope: BudgetGroup, Group: "ops"}},
		{"a group below the default still applies", nil, []Budget{g("eng", 1, false)}, 20, Applied{Micros: 1, Limited: true, Scope: BudgetGroup, Group: "eng"}},
	} {
		if got := ApplyBudget(tc.own, tc.groups, tc.def); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

func TestGroups(t *testing.T) {
	for _, tc := range []struct {
		header string
		want   []string
	}{
		{"", nil},
		{" Eng , ops,eng,,OPS ", []string{"eng", "ops"}},
		{"a\x00b,c\nd,ok", []string{"ok"}},
		{strings.Repeat("x", MaxGroupLen+1) + ",ok", []string{"ok"}},
	} {
		if got := Groups(tc.header); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("Groups(%q) = %q, want %q", tc.header, got, tc.want)
		}
	}
	var many []string
	for i := range 3 * MaxGroups {
		many = append(many, strings.Repeat("g", 1+i%50)+string(rune('a'+i%26)))
	}
	if n := len(Groups(strings.Join(many, ","))); n > MaxGroups {
		t.Errorf("%d groups kept", n)
	}
}

// FuzzGroups: whatever the SSO proxy's header holds, the groups kept are
// few, short, lower-case, without control characters, sorted and once.
func FuzzGroups(f *testing.F) {
	f.Add("Eng, ops,eng")
	f.Add("a\x00b,\u212a,,  ")
	f.Fuzz(func(t *testing.T, header string) {
		gs := Groups(header)
		if len(gs) > MaxGroups {
			t.Fatalf("%d groups", len(gs))
		}
		for i, g := range gs {
			if g == "" || len(g) > MaxGroupLen || GroupName(g) != g || i > 0 && gs[i-1] >= g {
				t.Fatalf("group %q in %q", g, gs)
			}
		}
	})
}
