package web_test

import (
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/web"
)

// The user's page counts calls in words that agree with the number.
func TestLandingCountsCalls(t *testing.T) {
	for _, tc := range []struct {
		calls int64
		want  string
	}{
		{0, `<span id="calls">0</span> calls.`},
		{1, `<span id="calls">1</span> call.`},
		{7, `<span id="calls">7</span> calls.`},
	} {
		var b strings.Builder
		if err := web.RenderLanding(&b, web.Landing{User: "ann", Models: &web.Models{Month: "2026-12", Spent: "$0.00", Budget: "none", Calls: tc.calls}}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(b.String(), tc.want) {
			t.Errorf("%d calls: page lacks %q", tc.calls, tc.want)
		}
	}
}
