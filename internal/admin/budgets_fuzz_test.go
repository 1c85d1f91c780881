package admin

import "testing"

// FuzzParseUSD: an amount is accepted only within [0, maxBudgetUSD].
func FuzzParseUSD(f *testing.F) {
	for _, s := range []string{"20", "2.50", "$3", "-1", "NaN", "Inf", "1e7", "0x10", " 5 ", "1e-9"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := parseUSD(s)
		if err == nil && (m < 0 || m > int64(maxBudgetUSD*1e6)) {
			t.Fatalf("%q accepted as %d micro-USD", s, m)
		}
	})
}
