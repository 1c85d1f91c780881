package admin

import (
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// send is a request as the administrator's API client (bearer token,
// JSON) or, with html, as their browser's form.
func send(t *testing.T, s *Service, method, path, body, token string, html bool) (int, http.Header, string) {
	t.Helper()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req.Host = "gw.example"
	req.Header.Set("Authorization", "Bearer "+token)
	if html {
		req.Header.Set("Accept", "text/html")
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	} else {
		req.Header.Set("Accept", "application/json")
		req.Header.Set("Content-Type", "application/json")
	}
	if body == "" {
		req.Header.Del("Content-Type")
	}
	resp, err := app(t, s).Test(req, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// adminAudits is the audit stream's admin events.
func adminAudits(t *testing.T, js jetstream.JetStream) []events.AuditEvent {
	t.Helper()
	ctx := natstest.Context(t, time.Minute)
	st, err := js.Stream(ctx, events.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []events.AuditEvent
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		if e, err := events.Decode[events.AuditEvent](m.Data); err == nil && e.Kind == events.AuditAdmin {
			out = append(out, e)
		}
	}
	return out
}

// Budget overrides through the API: refused unconfirmed or malformed
// with nothing written, written when confirmed (and audited), read back
// from the bucket and the API, cleared the same way; per user and per
// SSO group (by its name as the edge records it).
func TestBudgetOverrides(t *testing.T) {
	s, token, js := fixtureJS(t, 3, Options{})
	budgets := testutil.Open[state.Budget](t, js, state.BucketBudgets)
	ctx := natstest.Context(t, time.Minute)
	stored := func(scope, name string) (state.Budget, bool) {
		e, err := budgets.Get(ctx, state.BudgetKey(scope, name))
		if err != nil && !errors.Is(err, kv.ErrNotFound) {
			t.Fatal(err)
		}
		return e.Value, err == nil
	}
	for _, tc := range []struct{ name, method, path, body string }{
		{"unconfirmed", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"5"}`},
		{"confirming another user", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"5","confirm":"u00003"}`},
		{"a negative amount", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"-1","confirm":"u00002"}`},
		{"not an amount", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"lots","confirm":"u00002"}`},
		{"NaN", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"NaN","confirm":"u00002"}`},
		{"too much", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"1e7","confirm":"u00002"}`},
		{"no amount", "PUT", "/_/admin/budgets/user/u00002", `{"confirm":"u00002"}`},
		{"a number, not a string", "PUT", "/_/admin/budgets/user/u00002", `{"usd":5,"confirm":"u00002"}`},
		{"unlimited and an amount", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"5","unlimited":"true","confirm":"u00002"}`},
		{"unlimited maybe", "PUT", "/_/admin/budgets/user/u00002", `{"unlimited":"maybe","confirm":"u00002"}`},
		{"an unknown field", "PUT", "/_/admin/budgets/user/u00002", `{"usd":"5","confirm":"u00002","scope":"group"}`},
		{"an unknown scope", "PUT", "/_/admin/budgets/team/u00002", `{"usd":"5","confirm":"u00002"}`},
		{"not a user name", "PUT", "/_/admin/budgets/user/U..2", `{"usd":"5","confirm":"U..2"}`},
		{"a group name with a control character", "PUT", "/_/admin/budgets/group/eng%0Ateam", `{"usd":"5","confirm":"eng\nteam"}`},
	} {
		status, _, body := send(t, s, tc.method, tc.path, tc.body, token, false)
		if status != http.StatusBadRequest || !strings.Contains(body, `"detail"`) {
			t.Errorf("%s: %d %s, want 400 with a message", tc.name, status, body)
		}
	}
	if keys, err := budgets.Keys(ctx, ">"); err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) || len(keys) != 0 {
		t.Fatalf("bad requests wrote %v (%v)", keys, err)
	}

	status, _, body := send(t, s, "PUT", "/_/admin/budgets/user/u00002", `{"usd":"2.50","confirm":"u00002"}`, token, false)
	if status != 200 || !strings.Contains(body, `"usd":"$2.50"`) {
		t.Fatalf("set: %d %s", status, body)
	}
	if b, ok := stored(state.BudgetUser, "u00002"); !ok || b.MonthlyMicros != 2_500_000 || b.Unlimited || b.SetBy != "u00001" || b.Name != "u00002" {
		t.Fatalf("stored %+v %v", b, ok)
	}
	status, _, body = send(t, s, "PUT", "/_/admin/budgets/group/Eng%20Team", `{"unlimited":"true","confirm":"eng team"}`, token, false)
	if status != 200 || !strings.Contains(body, `"unlimited":true`) {
		t.Fatalf("group: %d %s", status, body)
	}
	if b, ok := stored(state.BudgetGroup, "eng team"); !ok || !b.Unlimited || b.Scope != state.BudgetGroup {
		t.Fatalf("group stored %+v %v", b, ok)
	}
	if status, _, body = send(t, s, "GET", "/_/admin/budgets/user/u00002", "", token, false); status != 200 || !strings.Contains(body, `"set":true`) || !strings.Contains(body, `"monthly_micros":2500000`) {
		t.Fatalf("get: %d %s", status, body)
	}
	// The list shows it at once (this edge notes what it wrote).
	if r := mustPage(t, s, Query{Limit: 1, Prefix: "u00002"}).Users[0]; r.Budget == nil || r.Budget.Micros != 2_500_000 || r.Budget.Scope != state.BudgetUser {
		t.Fatalf("row %+v", r)
	}
	if status, _, body = send(t, s, "DELETE", "/_/admin/budgets/user/u00002", `{"confirm":"u00002"}`, token, false); status != 200 || !strings.Contains(body, `"set":false`) {
		t.Fatalf("clear: %d %s", status, body)
	}
	if b, ok := stored(state.BudgetUser, "u00002"); ok {
		t.Fatalf("cleared budget still stored: %+v", b)
	}
	testutil.Eventually(t, time.Minute, func() error {
		var got []string
		for _, e := range adminAudits(t, js) {
			got = append(got, e.User+": "+e.Outcome+" "+e.Detail)
		}
		want := []string{
			"u00002: budget set to $2.50 a month (set for the user) by u00001 for user u00002",
			": budget set to unlimited (group eng team) by u00001 for group eng team",
			"u00002: budget cleared by u00001 for user u00002",
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("audits %q, want %q", got, want)
		}
		return nil
	})

	// A browser's form asks on a page of its own first, then carries the
	// same fields with the confirmation.
	status, _, body = send(t, s, "POST", "/_/admin/budgets/user/u00003", "usd=7", token, true)
	if status != 200 || !strings.Contains(body, `name="usd" value="7"`) || !strings.Contains(body, `name="confirm" value="u00003"`) {
		t.Fatalf("confirm page: %d %s", status, body)
	}
	if _, ok := stored(state.BudgetUser, "u00003"); ok {
		t.Fatal("stored before it was confirmed")
	}
	if status, h, _ := send(t, s, "POST", "/_/admin/budgets/user/u00003", "usd=7&confirm=u00003", token, true); status != http.StatusSeeOther || !strings.Contains(h.Get("Location"), "budget=user+u00003") {
		t.Fatalf("confirmed form: %d %v", status, h)
	}
	if b, ok := stored(state.BudgetUser, "u00003"); !ok || b.MonthlyMicros != 7_000_000 {
		t.Fatalf("form stored %+v %v", b, ok)
	}
	// The page's group form names the group in a field.
	if status, _, body = send(t, s, "POST", "/_/admin/budgets/group", "group=Ops&usd=3", token, true); status != 200 || !strings.Contains(body, `action="/_/admin/budgets/group/ops"`) {
		t.Fatalf("group confirm page: %d %s", status, body)
	}
}

// Spend this month in the list (JSON and page), sortable by spend, and
// the month's usage exported as CSV and JSON.
func TestSpendListAndExport(t *testing.T) {
	s, token, js := fixtureJS(t, 12, Options{})
	usage := testutil.Open[state.Usage](t, js, state.BucketUsage)
	ctx := natstest.Context(t, time.Minute)
	month := state.Month(time.Now())
	for user, cost := range map[string]int64{"u00003": 5_000_000, "u00007": 12_340_000, "u00011": 10} {
		if _, err := usage.Put(ctx, state.UsageKey(user, month), state.Usage{User: user, Month: month, Calls: 3, InputTokens: 100, OutputTokens: 50, CostMicros: cost}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := usage.Put(ctx, state.UsageKey("u00003", "2001-01"), state.Usage{User: "u00003", Month: "2001-01", Calls: 1, CostMicros: 99}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if spent, err := s.o.Spend.Months.Month(ctx, month); err != nil || len(spent) != 3 {
			return fmt.Errorf("%d users' usage read (%v)", len(spent), err)
		}
		return nil
	})
	status, _, body := send(t, s, "GET", "/_/admin/users?sort=spend&limit=2", "", token, false)
	var p Page
	if err := json.Unmarshal([]byte(body), &p); status != 200 || err != nil {
		t.Fatalf("list: %d %s", status, body)
	}
	if len(p.Users) != 2 || p.Users[0].User != "u00007" || p.Users[0].SpentMicros != 12_340_000 || p.Users[1].User != "u00003" || p.Next != "u00003" {
		t.Fatalf("by spend: %+v next %q", p.Users, p.Next)
	}
	// The next page carries on in the same order: u00011, then everyone
	// who spent nothing, by name.
	p = mustPage(t, s, Query{Sort: "spend", After: "u00003", Limit: 3})
	if len(p.Users) != 3 || p.Users[0].User != "u00011" || p.Users[1].User != "u00000" || p.Users[2].User != "u00001" {
		t.Fatalf("second page by spend: %+v", p.Users)
	}
	// Among those who spent nothing, a page carries on by name and skips
	// the spenders shown first.
	p = mustPage(t, s, Query{Sort: "spend", After: "u00002", Limit: 2})
	if len(p.Users) != 2 || p.Users[0].User != "u00004" || p.Users[1].User != "u00005" {
		t.Fatalf("by spend after u00002: %+v", p.Users)
	}
	if status, _, body := send(t, s, "GET", "/_/admin/users?sort=cost", "", token, false); status != 400 {
		t.Fatalf("sort=cost: %d %s", status, body)
	}
	for _, q := range []string{"profile=huge", "profile=GPU", "profile=" + strings.Repeat("g", 40)} {
		if status, _, body := send(t, s, "GET", "/_/admin/users?"+q, "", token, false); status != 400 || !strings.Contains(body, "small, gpu") {
			t.Fatalf("%s: %d %s, want 400 naming the profiles", q, status, body)
		}
	}
	for _, q := range []string{"revision=AAAAAAAA", "revision=aaaa", "revision=%3Cb%3E"} {
		if status, _, body := send(t, s, "GET", "/_/admin/users?"+q, "", token, false); status != 400 || !strings.Contains(body, "8 hex digits") {
			t.Fatalf("%s: %d %s, want 400 saying what a revision is", q, status, body)
		}
	}
	// The page links each revision to the list of its sandboxes.
	if status, _, page := send(t, s, "GET", "/_/admin?revision=bbbbbbbb&limit=3", "", token, true); status != 200 ||
		!strings.Contains(page, `<a href="/_/admin?revision=bbbbbbbb">bbbbbbbb</a>`) || strings.Contains(page, `id="user-u00000"`) || !strings.Contains(page, `value="bbbbbbbb"`) {
		t.Fatalf("page by revision: %d %s", status, page)
	}
	// The page shows each sandbox's profile, and filters by it.
	status, _, page := send(t, s, "GET", "/_/admin?profile=gpu&limit=3", "", token, true)
	if status != 200 || !strings.Contains(page, `id="profile-u00003">gpu<`) || strings.Contains(page, `id="user-u00000"`) || !strings.Contains(page, `<option selected>gpu</option>`) {
		t.Fatalf("page by profile: %d %s", status, page)
	}
	status, _, page = send(t, s, "GET", "/_/admin?sort=spend", "", token, true)
	if status != 200 || !strings.Contains(page, `id="spent-u00007">$12.34<`) || !strings.Contains(page, `id="spent-u00011">$0.0000<`) ||
		!strings.Contains(page, `id="budget-u00007">$20.00 a month (the default)<`) || strings.Index(page, `id="user-u00007"`) > strings.Index(page, `id="user-u00003"`) {
		t.Fatalf("page: %d %s", status, page)
	}

	status, h, body := send(t, s, "GET", "/_/admin/usage?month="+month+"&format=csv", "", token, false)
	if status != 200 || h.Get("Content-Type") != "text/csv; charset=utf-8" || !strings.Contains(h.Get("Content-Disposition"), "usage-"+month+".csv") {
		t.Fatalf("csv: %d %v %s", status, h, body)
	}
	rows, err := csv.NewReader(strings.NewReader(body)).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{usageColumns,
		{"u00003", month, "3", "0", "100", "50", "0", "0", "5000000", "0", "0"},
		{"u00007", month, "3", "0", "100", "50", "0", "0", "12340000", "0", "0"},
		{"u00011", month, "3", "0", "100", "50", "0", "0", "10", "0", "0"},
	}
	if fmt.Sprint(rows) != fmt.Sprint(want) {
		t.Fatalf("csv rows %q, want %q", rows, want)
	}
	status, h, body = send(t, s, "GET", "/_/admin/usage?month="+month+"&user=u00007&format=json", "", token, false)
	var doc struct {
		Month string     `json:"month"`
		Users []usageRow `json:"users"`
	}
	if err := json.Unmarshal([]byte(body), &doc); status != 200 || err != nil || !strings.HasPrefix(h.Get("Content-Type"), "application/json") {
		t.Fatalf("json: %d %v %s", status, h, body)
	}
	if doc.Month != month || len(doc.Users) != 1 || doc.Users[0].User != "u00007" || doc.Users[0].CostMicros != 12_340_000 {
		t.Fatalf("json: %s", body)
	}
	if _, _, body = send(t, s, "GET", "/_/admin/usage?month=2001-01&format=json", "", token, false); !strings.Contains(body, `"cost_micros":99`) {
		t.Fatalf("another month: %s", body)
	}
	if _, _, body = send(t, s, "GET", "/_/admin/usage?month=1999-02", "", token, false); body != `{"month":"1999-02","users":[]}` {
		t.Fatalf("a month without usage: %s", body)
	}
	for _, q := range []string{"month=2026-13", "month=26-12", "month=2026-1", "month=" + month + "&format=xml", "month=" + month + "&user=U%20x", "month=2026-12%0A"} {
		if status, _, body := send(t, s, "GET", "/_/admin/usage?"+q, "", token, false); status != 400 || !strings.Contains(body, `"detail"`) {
			t.Errorf("%s: %d %s, want 400", q, status, body)
		}
	}
	// Only the administrator.
	if status, _, _ := send(t, s, "GET", "/_/admin/usage?month="+month, "", "u00002.not-a-token", false); status != 404 {
		t.Errorf("a stranger: %d", status)
	}
}

// The per-call export reads the usage stream: the month's calls, one
// user's or everyone's, in the order recorded; other months' calls are
// not in it.
func TestCallExport(t *testing.T) {
	s, token, js := fixtureJS(t, 3, Options{})
	ctx := natstest.Context(t, time.Minute)
	now := time.Now().UTC()
	month := state.Month(now)
	for i, e := range []events.UsageEvent{
		{ID: "c1", User: "u00001", Provider: "openai", Model: "gpt-4o", Status: 200, Stream: true, InputTokens: 10, OutputTokens: 20, CacheWriteTokens: 4, CostMicros: 30, Duration: 1500 * time.Millisecond, At: now, Broker: "broker-a"},
		{ID: "c2", User: "u00002", Provider: "anthropic", Model: "claude", Status: 429, At: now, Broker: "broker-b"},
		{ID: "c3", User: "u00001", Provider: "openai", Model: "gpt-4o", Status: 200, Estimated: true, BYOK: true, At: now, Broker: "broker-a"},
		{ID: "c0", User: "u00001", Provider: "openai", Model: "gpt-4o", Status: 200, At: now.AddDate(0, -1, 0), Broker: "broker-a"}, // counted last month
	} {
		e.V = events.SchemaVersion
		b, _ := json.Marshal(e)
		if _, err := js.Publish(ctx, events.UsageSubject(e.User), b); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	status, h, body := send(t, s, "GET", "/_/admin/usage?rows=calls&format=csv&month="+month, "", token, false)
	rows, err := csv.NewReader(strings.NewReader(body)).ReadAll()
	if status != 200 || err != nil || h.Get("Content-Type") != "text/csv; charset=utf-8" || !strings.Contains(h.Get("Content-Disposition"), "calls-"+month+".csv") {
		t.Fatalf("csv: %d %v %s", status, h, body)
	}
	at := now.Format(time.RFC3339Nano)
	want := [][]string{callColumns,
		{"c1", at, "u00001", "openai", "gpt-4o", "200", "true", "10", "20", "0", "4", "false", "30", "false", "1500", "broker-a"},
		{"c2", at, "u00002", "anthropic", "claude", "429", "false", "0", "0", "0", "0", "false", "0", "false", "0", "broker-b"},
		{"c3", at, "u00001", "openai", "gpt-4o", "200", "false", "0", "0", "0", "0", "true", "0", "true", "0", "broker-a"},
	}
	if fmt.Sprint(rows) != fmt.Sprint(want) {
		t.Fatalf("rows %q\nwant %q", rows, want)
	}
	status, _, body = send(t, s, "GET", "/_/admin/usage?rows=calls&format=json&user=u00001&month="+month, "", token, false)
	var doc struct {
		Calls []events.UsageEvent `json:"calls"`
	}
	if err := json.Unmarshal([]byte(body), &doc); status != 200 || err != nil || len(doc.Calls) != 2 || doc.Calls[0].ID != "c1" || doc.Calls[1].ID != "c3" {
		t.Fatalf("json: %d %s", status, body)
	}
	if status, _, body = send(t, s, "GET", "/_/admin/usage?rows=every&month="+month, "", token, false); status != 400 {
		t.Fatalf("rows=every: %d %s", status, body)
	}
}
