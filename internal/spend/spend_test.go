package spend

import (
	"testing"

	"github.com/aaas-project/aaas/internal/state"
)

func TestUSD(t *testing.T) {
	for _, tc := range []struct {
		micros int64
		want   string
	}{
		{0, "$0.00"}, {1, "$0.0000"}, {99, "$0.0001"}, {9_999, "$0.0100"}, {10_000, "$0.01"},
		{1_234_567, "$1.23"}, {1_235_000, "$1.24"}, {999_999, "$1.00"}, {19_995_000, "$20.00"},
		{20_000_000, "$20.00"}, {-2_500_000, "-$2.50"},
	} {
		if got := USD(tc.micros); got != tc.want {
			t.Errorf("USD(%d) = %q, want %q", tc.micros, got, tc.want)
		}
	}
}

func TestDescribe(t *testing.T) {
	for _, tc := range []struct {
		a    state.Applied
		want string
	}{
		{state.Applied{}, "no budget"},
		{state.Applied{Micros: 20_000_000, Limited: true, Scope: "default"}, "$20.00 a month (the default)"},
		{state.Applied{Micros: 5_000_000, Limited: true, Scope: state.BudgetUser}, "$5.00 a month (set for the user)"},
		{state.Applied{Scope: state.BudgetGroup, Group: "eng"}, "unlimited (group eng)"},
		{state.Applied{Limited: true, Scope: state.BudgetUser}, "$0.00 a month (set for the user)"},
	} {
		if got := Describe(tc.a); got != tc.want {
			t.Errorf("Describe(%+v) = %q, want %q", tc.a, got, tc.want)
		}
	}
}
