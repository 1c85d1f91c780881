package admin

import (
	"strings"
	"testing"
	"time"
)

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

// FuzzAuditTime: whatever an administrator's client sends as since or
// until, when answers a time or an error, never a time in the future of
// an age (an age counts back), and "" is the default.
func FuzzAuditTime(f *testing.F) {
	for _, s := range []string{"", "24h", "7d", "-5m", "3651d", "2026-12-05T10:00:00Z", "9999999999999999d", "1e9h", "d", "0d"} {
		f.Add(s)
	}
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, s string) {
		got, err := when(s, now, now.Add(-time.Hour))
		switch {
		case s == "" && (err != nil || !got.Equal(now.Add(-time.Hour))):
			t.Fatalf("when(%q) = %v, %v; want the default", s, got, err)
		case err == nil && s != "" && !strings.Contains(s, "T") && got.After(now):
			t.Fatalf("the age %q counts forward: %v", s, got)
		}
	})
}
