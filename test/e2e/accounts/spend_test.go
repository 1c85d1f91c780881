package accounts_test

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Through the edge process under its own NATS identity: ann sees her
// spend (a usage record as a broker writes it) and stores her own key,
// sealed for the brokers; the administrator sets her budget, which her
// page then shows, and exports the month.
func TestSpendBudgetAndOwnKeyThroughTheEdge(t *testing.T) {
	pair, err := credentials.Generate()
	if err != nil {
		t.Fatal(err)
	}
	ring, err := credentials.NewRing(pair.Private[:])
	if err != nil {
		t.Fatal(err)
	}
	w := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Env: map[string]string{
		"SIGNUP_INVITE_CODE": invite, "BROKER_BUDGET_DEFAULT": "20", "BROKER_BYOK": "true",
		"BROKER_PROVIDERS":       `[{"name":"openai","api":"openai","base_url":"http://127.0.0.1:1/v1","models":["gpt-4o"]}]`,
		"CREDENTIALS_PUBLIC_KEY": strings.TrimPrefix(strings.Split(pair.Env(), "\n")[1], "CREDENTIALS_PUBLIC_KEY="),
	}})
	a := w.Edge("edge-a", nil)
	boss := testenv.NewClient(t, a.URL)
	bossToken := boss.Signup("boss", invite)
	makeAdmin(t, w, "boss", bossToken, a)
	ann := testenv.NewClient(t, a.URL)
	annToken := ann.Signup("ann", invite)

	ctx := testenv.Context(t, time.Minute)
	month := state.Month(time.Now())
	usage, err := kv.Open[state.Usage](ctx, w.JS, state.BucketUsage)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := usage.Put(ctx, state.UsageKey("ann", month), state.Usage{User: "ann", Month: month, Calls: 4, CostMicros: 3_210_000}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if r := ann.Do(http.MethodGet, "/", nil, "Accept", "text/html"); !bytes.Contains(r.Body, []byte(`<strong id="spent">$3.21</strong>`)) || !bytes.Contains(r.Body, []byte(`<strong id="left">$16.79</strong>`)) {
			return fmt.Errorf("page: %.2000s", r.Body)
		}
		return nil
	})

	const key = "sk-ann-own-0123456789lmno"
	r := ann.Do(http.MethodPut, "/_/keys/openai", strings.NewReader(`{"key":"`+key+`"}`), "Authorization", "Bearer "+annToken, "Content-Type", "application/json")
	expect(t, r, http.StatusOK, "store own key")
	creds, err := kv.Open[state.Credential](ctx, w.JS, state.BucketCredentials)
	if err != nil {
		t.Fatal(err)
	}
	c, err := creds.Get(ctx, state.CredentialKey("ann", "openai"))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := ring.Open(c.Value); err != nil || got != key || bytes.Contains(c.Value.Sealed, []byte(key)) {
		t.Fatalf("stored credential opens to %q, %v", got, err)
	}
	if r := ann.Do(http.MethodGet, "/", nil, "Accept", "text/html"); bytes.Contains(r.Body, []byte(key)) || !bytes.Contains(r.Body, []byte(`…<span class="hint">lmno</span>`)) {
		t.Fatalf("page: %.3000s", r.Body)
	}

	r = boss.Do(http.MethodPut, "/_/admin/budgets/user/ann", strings.NewReader(`{"usd":"5","confirm":"ann"}`), "Authorization", "Bearer "+bossToken, "Content-Type", "application/json", "Accept", "application/json")
	expect(t, r, http.StatusOK, "set ann's budget")
	budgets, err := kv.Open[state.Budget](ctx, w.JS, state.BucketBudgets)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := budgets.Get(ctx, state.BudgetKey(state.BudgetUser, "ann")); err != nil || b.Value.MonthlyMicros != 5_000_000 || b.Value.SetBy != "boss" {
		t.Fatalf("ann's budget %+v %v", b.Value, err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if r := ann.Do(http.MethodGet, "/", nil, "Accept", "text/html"); !bytes.Contains(r.Body, []byte(`$5.00 a month (set for the user)`)) {
			return fmt.Errorf("page: %.2000s", r.Body)
		}
		if n := count(auditEvents(t, w), func(e events.AuditEvent) bool {
			return e.Kind == events.AuditAdmin && e.User == "ann" && strings.HasPrefix(e.Outcome, "budget set")
		}); n != 1 {
			return fmt.Errorf("%d budget audits", n)
		}
		return nil
	})
	r = boss.Do(http.MethodGet, "/_/admin/usage?format=csv&month="+month, nil, "Authorization", "Bearer "+bossToken)
	expect(t, r, http.StatusOK, "export")
	if !strings.Contains(string(r.Body), "ann,"+month+",4,0,0,0,0,0,3210000,0,0") {
		t.Fatalf("export: %s", r.Body)
	}
}
