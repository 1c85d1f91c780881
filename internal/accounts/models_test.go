package accounts

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/ratelimit"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
)

var quiet = slog.New(slog.DiscardHandler)

// page is the account endpoints over a real NATS server: ann with a
// token and a session cookie, sam an SSO user (X-Forwarded-User), the
// providers openai and anthropic open to users' own keys, sealed to ring.
type page struct {
	app        *fiber.App
	js         jetstream.JetStream
	token, sid string
	ring       *credentials.Ring
	creds      *kv.Bucket[state.Credential]
	usage      *kv.Bucket[state.Usage]
	budgets    *kv.Bucket[state.Budget]
	groups     *kv.Bucket[state.UserGroups]
	store      *auth.Store
}

func newPage(t *testing.T) *page {
	t.Helper()
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 5*time.Minute)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	p := &page{js: js, token: ident.NewToken("ann")}
	users := testutil.Open[state.User](t, js, state.BucketUsers)
	for _, u := range []state.User{
		{Name: "ann", Managed: true, Created: time.Now(), TokenHash: ident.HashHex(p.token)},
		{Name: "sam", Managed: true, Created: time.Now(), TokenHash: ident.HashHex("sso\x00login:sam")},
	} {
		if _, err := users.Put(ctx, u.Name, u); err != nil {
			t.Fatal(err)
		}
	}
	k, err := credentials.Generate()
	if err != nil {
		t.Fatal(err)
	}
	if p.ring, err = credentials.NewRing(k.Private[:]); err != nil {
		t.Fatal(err)
	}
	p.creds = testutil.Open[state.Credential](t, js, state.BucketCredentials)
	p.usage = testutil.Open[state.Usage](t, js, state.BucketUsage)
	p.budgets = testutil.Open[state.Budget](t, js, state.BucketBudgets)
	p.groups = testutil.Open[state.UserGroups](t, js, state.BucketUserGroups)
	store, err := auth.NewStore(ctx, js, auth.StoreOptions{TTL: time.Hour, MaxPerUser: 10, Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	p.store = store
	limiter, err := ratelimit.New(ctx, js, 1000, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	uc := cache(t, users)
	// Bounded, as an edge's: it holds the groups of the users it serves.
	groups, err := kv.NewCache(ctx, p.groups, ">", quiet, kv.Bounded[state.UserGroups](100))
	if err != nil {
		t.Fatal(err)
	}
	book := &spend.Book{Usage: cache(t, p.usage), Budgets: cache(t, p.budgets), Groups: groups, DefaultMicros: 20_000_000}
	rec := &spend.Recorder{Bucket: p.groups, Cache: groups, Refresh: time.Hour, Log: quiet}
	pub := events.NewPublisher(js, "edge-test", quiet)
	a := auth.New(auth.Options{Store: store, Limiter: limiter, Users: uc, Publisher: pub, RefusalAuditLimit: 100, CookieName: "dsh_gw_session",
		SSO: auth.SSO{NameHeader: "X-Forwarded-User", GroupsHeader: "X-Forwarded-Groups", Allow: []string{"*"}}, SeenGroups: rec.Seen, Metrics: prometheus.NewRegistry()})
	svc := New(Options{Auth: a, Publisher: pub, Users: uc, Sandboxes: cache(t, testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)),
		Requests: cache(t, testutil.Open[state.Result](t, js, state.BucketRequests)), Queue: capacity.Queue{Cache: cache(t, testutil.Open[state.Queued](t, js, state.BucketQueue))},
		SSO: true, SignOutURL: "/oauth2/sign_out", WakeTimeout: 5 * time.Second, Log: quiet, Spend: book, Profiles: config.Profiles{{Name: "default", WarmPool: "dsh-pool"}},
		BYOK: &BYOK{Credentials: p.creds, PublicKey: k.Public[:], Providers: []string{"openai", "anthropic"}}})
	testutil.Eventually(t, time.Minute, func() error {
		if !svc.Ready() || uc.Len() != 2 {
			return fmt.Errorf("not ready")
		}
		return nil
	})
	if p.sid, err = store.Create(ctx, "ann", "test"); err != nil {
		t.Fatal(err)
	}
	pol, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: []string{"gw.example"}})
	if err != nil {
		t.Fatal(err)
	}
	p.app = fiber.New(fiber.Config{DisableStartupMessage: true, StrictRouting: true, CaseSensitive: true, StreamRequestBody: true})
	p.app.Use(pol.Middleware)
	svc.Register(p.app)
	return p
}

func cache[T any](t testing.TB, b *kv.Bucket[T]) *kv.Cache[T] {
	c, err := kv.NewCache(context.Background(), b, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// do sends a request to gw.example; headers are name, value pairs.
func (p *page) do(t *testing.T, method, path string, body io.Reader, headers ...string) (int, string) {
	t.Helper()
	req := httptest.NewRequest(method, path, body)
	req.Host = "gw.example"
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := p.app.Test(req, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// browser is ann's browser: her cookie, our Origin, a form.
func (p *page) browser(t *testing.T, method, path, form string) (int, string) {
	return p.do(t, method, path, strings.NewReader(form), "Cookie", "dsh_gw_session="+p.sid, "Origin", "http://gw.example",
		"Content-Type", "application/x-www-form-urlencoded", "Accept", "text/html")
}

// The page shows this month's spend from the usage bucket (the brokers
// write it; here the test does), the budget that applies and what is
// left; the API says the same.
func TestPageShowsSpendAndBudget(t *testing.T) {
	p := newPage(t)
	ctx := natstest.Context(t, time.Minute)
	month := state.Month(time.Now())
	if _, err := p.usage.Put(ctx, state.UsageKey("ann", month), state.Usage{User: "ann", Month: month, Calls: 7, CostMicros: 1_234_567, BYOKCalls: 2, BYOKCostMicros: 500_000}); err != nil {
		t.Fatal(err)
	}
	// Last month's spend is not this month's.
	if _, err := p.usage.Put(ctx, state.UsageKey("ann", "2001-01"), state.Usage{User: "ann", Month: "2001-01", Calls: 1, CostMicros: 99_000_000}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if _, body := p.browser(t, http.MethodGet, "/", ""); !strings.Contains(body, `<strong id="spent">$1.23</strong>`) {
			return fmt.Errorf("page without the spend: %.3000s", body)
		}
		return nil
	})
	_, body := p.browser(t, http.MethodGet, "/", "")
	for _, want := range []string{`<span id="calls">7</span> calls.`, `$20.00 a month (the default)`, `<strong id="left">$18.77</strong>`, `<span id="own-spent">$0.50</span>`} {
		if !strings.Contains(body, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	status, js := p.do(t, http.MethodGet, "/_/usage", nil, "Authorization", "Bearer "+p.token)
	var u struct {
		Month      string        `json:"month"`
		Cost       int64         `json:"cost_micros"`
		Budget     state.Applied `json:"budget"`
		LeftMicros *int64        `json:"left_micros"`
	}
	if err := json.Unmarshal([]byte(js), &u); status != 200 || err != nil || u.Month != month || u.Cost != 1_234_567 || u.Budget.Micros != 20_000_000 || u.LeftMicros == nil || *u.LeftMicros != 18_765_433 {
		t.Fatalf("GET /_/usage: %d %s", status, js)
	}

	// Her own budget wins over the default; unlimited shows as such; a
	// spend over it leaves nothing, never less.
	if _, err := p.budgets.Put(ctx, state.BudgetKey(state.BudgetUser, "ann"), state.Budget{Scope: state.BudgetUser, Name: "ann", MonthlyMicros: 1_000_000}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if _, body := p.browser(t, http.MethodGet, "/", ""); !strings.Contains(body, `$1.00 a month (set for the user)</span>; <strong id="left">$0.00</strong>`) {
			return fmt.Errorf("own budget not shown: %.3000s", body)
		}
		return nil
	})
}

// A stored key is sealed (the bucket's bytes do not hold it), the page
// shows only its hint, and the brokers' ring opens it. Hostile input is
// refused and stores nothing.
func TestOwnKeys(t *testing.T) {
	p := newPage(t)
	const key = "sk-ann-secret-0123456789wxyz"
	status, _ := p.browser(t, http.MethodPost, "/_/keys/openai", "key="+key)
	if status != http.StatusSeeOther {
		t.Fatalf("store: %d", status)
	}
	ctx := natstest.Context(t, time.Minute)
	raw, err := p.js.KeyValue(ctx, state.BucketCredentials)
	if err != nil {
		t.Fatal(err)
	}
	e, err := raw.Get(ctx, state.CredentialKey("ann", "openai"))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(e.Value(), []byte(key)) || bytes.Contains(e.Value(), []byte("secret-0123")) {
		t.Fatal("the key is readable in the bucket")
	}
	c, err := p.creds.Get(ctx, state.CredentialKey("ann", "openai"))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.ring.Open(c.Value); err != nil || got != key {
		t.Fatalf("the ring opens %q, %v", got, err)
	}
	_, body := p.browser(t, http.MethodGet, "/", "")
	if strings.Contains(body, key) || strings.Contains(body, "secret") || !strings.Contains(body, `…<span class="hint">wxyz</span>`) {
		t.Fatalf("page: %.4000s", body)
	}
	status, js := p.do(t, http.MethodGet, "/_/usage", nil, "Authorization", "Bearer "+p.token)
	if status != 200 || strings.Contains(js, "secret") || !strings.Contains(js, `{"provider":"openai","hint":"wxyz"`) || !strings.Contains(js, `{"provider":"anthropic"}`) {
		t.Fatalf("GET /_/usage: %d %s", status, js)
	}
	// The API stores with a bearer token, without Origin.
	status, js = p.do(t, http.MethodPut, "/_/keys/anthropic", strings.NewReader(`{"key":"sk-ant-0123456789abcd"}`), "Authorization", "Bearer "+p.token, "Content-Type", "application/json")
	if status != 200 || !strings.Contains(js, `"hint":"abcd"`) || strings.Contains(js, "sk-ant") {
		t.Fatalf("PUT: %d %s", status, js)
	}

	stored := func() []string {
		keys, err := p.creds.Keys(ctx, ">")
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(keys)
		return keys
	}
	before, rev := stored(), c.Revision
	for _, tc := range []struct {
		name, method, path, body string
		headers                  []string
		status                   int
	}{
		{"a key of 100 KiB", "POST", "/_/keys/openai", "key=" + strings.Repeat("k", 100<<10), nil, http.StatusRequestEntityTooLarge},
		{"a key over the bound", "POST", "/_/keys/openai", "key=" + strings.Repeat("k", credentials.MaxKeyLen+1), nil, http.StatusBadRequest},
		{"a key with a line break", "POST", "/_/keys/openai", "key=sk-0123456789%0d%0aX-Evil:%201", nil, http.StatusBadRequest},
		{"an empty key", "POST", "/_/keys/openai", "key=", nil, http.StatusBadRequest},
		{"a provider not configured", "POST", "/_/keys/mistral", "key=sk-0123456789abcd", nil, http.StatusBadRequest},
		{"a provider by path tricks", "POST", "/_/keys/openai%2F..", "key=sk-0123456789abcd", nil, http.StatusBadRequest},
		{"a user name in the form", "POST", "/_/keys/openai", "key=sk-0123456789abcd&user=bob", nil, http.StatusBadRequest},
		{"the key twice", "POST", "/_/keys/openai", "key=sk-0123456789abcd&key=sk-0123456789efgh", nil, http.StatusBadRequest},
		{"another site's page", "POST", "/_/keys/openai", "key=sk-0123456789abcd", []string{"Origin", "https://evil.example"}, http.StatusForbidden},
		{"no credentials", "POST", "/_/keys/openai", "key=sk-0123456789abcd", []string{"Cookie", ""}, http.StatusUnauthorized},
		{"a deletion from another site", "POST", "/_/keys/openai/delete", "", []string{"Origin", "https://evil.example"}, http.StatusForbidden},
	} {
		headers := append([]string{"Cookie", "dsh_gw_session=" + p.sid, "Origin", "http://gw.example", "Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json"}, tc.headers...)
		if status, body := p.do(t, tc.method, tc.path, strings.NewReader(tc.body), headers...); status != tc.status {
			t.Errorf("%s: %d %.200s, want %d", tc.name, status, body, tc.status)
		}
	}
	if after := stored(); !slices.Equal(after, before) {
		t.Fatalf("stored %v, then %v", before, after)
	}
	if c, err := p.creds.Get(ctx, state.CredentialKey("ann", "openai")); err != nil || c.Revision != rev {
		t.Fatalf("ann's openai key changed: %+v %v", c, err)
	}

	// Deleted from the page; the audit trail says stored and deleted,
	// never the key.
	if status, _ := p.browser(t, http.MethodPost, "/_/keys/openai/delete", ""); status != http.StatusSeeOther {
		t.Fatalf("delete: %d", status)
	}
	if status, _ := p.browser(t, http.MethodPost, "/_/keys/openai/delete", ""); status != http.StatusNotFound {
		t.Fatalf("second delete: %d", status)
	}
	if got := stored(); !slices.Equal(got, []string{state.CredentialKey("ann", "anthropic")}) {
		t.Fatalf("after the deletion: %v", got)
	}
	var outcomes []string
	testutil.Eventually(t, time.Minute, func() error {
		outcomes = nil
		for _, e := range audits(t, p.js) {
			if e.Kind == events.AuditCredential && e.User == "ann" {
				outcomes = append(outcomes, e.Outcome+" "+e.Detail)
				if strings.Contains(e.Detail, "sk-") {
					t.Fatalf("a key in the audit trail: %+v", e)
				}
			}
		}
		if len(outcomes) != 3 {
			return fmt.Errorf("credential audits %q", outcomes)
		}
		return nil
	})
	if want := []string{"stored provider openai by cookie", "stored provider anthropic by bearer", "deleted provider openai by cookie"}; !slices.Equal(outcomes, want) {
		t.Fatalf("audits %q, want %q", outcomes, want)
	}
}

// audits is every event of the audit stream.
func audits(t *testing.T, js jetstream.JetStream) []events.AuditEvent {
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
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		e, err := events.Decode[events.AuditEvent](m.Data)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, e)
	}
	return out
}

// The SSO groups a user signs in with are recorded when they change, not
// on every request, nor again by an edge that had not held the record
// another edge wrote; their budget then applies on the page.
func TestSSOGroupsRecordedWhenTheyChange(t *testing.T) {
	p := newPage(t)
	ctx := natstest.Context(t, time.Minute)
	sso := func(groups string) {
		t.Helper()
		if status, body := p.do(t, http.MethodGet, "/_/status", nil, "X-Forwarded-User", "sam", "X-Forwarded-Groups", groups); status != 200 {
			t.Fatalf("status as sam: %d %s", status, body)
		}
	}
	recorded := func(want ...string) uint64 {
		t.Helper()
		var e kv.Entry[state.UserGroups]
		testutil.Eventually(t, time.Minute, func() error {
			var err error
			if e, err = p.groups.Get(ctx, "sam"); err != nil || !slices.Equal(e.Value.Groups, want) {
				return fmt.Errorf("sam's groups %+v %v, want %q", e.Value, err, want)
			}
			return nil
		})
		return e.Revision
	}
	first, err := p.groups.Put(ctx, "sam", state.UserGroups{User: "sam", Groups: []string{"eng", "ops"}, Seen: time.Now().UTC()})
	if err != nil {
		t.Fatal(err)
	}
	sso("Eng, ops")
	for range 20 {
		sso("ops,ENG")
	}
	sso("eng,ops,finance")
	// The bucket's revisions count its writes: one more, the change.
	if next := recorded("eng", "finance", "ops"); next != first+1 {
		t.Fatalf("revision %d after %d: the unchanged groups were written again", next, first)
	}

	if _, err := p.budgets.Put(ctx, state.BudgetKey(state.BudgetGroup, "finance"), state.Budget{Scope: state.BudgetGroup, Name: "finance", MonthlyMicros: 50_000_000}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		_, body := p.do(t, http.MethodGet, "/", nil, "X-Forwarded-User", "sam", "X-Forwarded-Groups", "eng,ops,finance", "Accept", "text/html")
		if !strings.Contains(body, "$50.00 a month (group finance)") {
			return fmt.Errorf("group budget not shown: %.3000s", body)
		}
		return nil
	})
}

// An SSO user's "Sign out" ends the sandbox origins' sessions their
// sign-ins made and sends the browser on to the SSO proxy's sign-out
// (without it the home page would sign them straight back in); another
// user's session stays, and a cross-site form ends nothing.
func TestSSOSignOut(t *testing.T) {
	p := newPage(t)
	ctx := natstest.Context(t, time.Minute)
	sid, err := p.store.CreateSandbox(ctx, "sam", "sam.sbx.example", "", ident.HashHex("sso\x00login:sam"), time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	sessions := testutil.Open[state.Session](t, p.js, state.BucketSessions)
	exists := func(user, sid string) bool {
		_, err := sessions.Get(ctx, state.SessionKey(user, ident.HashHex(sid)))
		return err == nil
	}
	signOut := func(origin string) *http.Response {
		t.Helper()
		req := httptest.NewRequest(http.MethodPost, "/logout", strings.NewReader(""))
		req.Host = "gw.example"
		for k, v := range map[string]string{"X-Forwarded-User": "sam", "Origin": origin, "Content-Type": "application/x-www-form-urlencoded", "Accept": "text/html"} {
			req.Header.Set(k, v)
		}
		resp, err := p.app.Test(req, -1)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	if r := signOut("https://evil.example"); r.StatusCode != http.StatusForbidden || !exists("sam", sid) {
		t.Fatalf("a cross-site sign-out: %d, sam's sandbox session there: %v", r.StatusCode, exists("sam", sid))
	}
	r := signOut("http://gw.example")
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != "/oauth2/sign_out" {
		t.Fatalf("sign-out: %d to %q, want 303 to /oauth2/sign_out", r.StatusCode, r.Header.Get("Location"))
	}
	if exists("sam", sid) {
		t.Fatal("sam's sandbox session outlived his sign-out")
	}
	if !exists("ann", p.sid) {
		t.Fatal("sam's sign-out ended ann's session")
	}
}

// A signed-in SSO user the gateway refuses (here: the login belongs to an
// account of another identity) gets the home page with the reason, its
// 403 and a way to sign in as someone else; a browser with no credentials
// gets the page as it is, 200 and no error (the control).
func TestLandingSaysWhySSORefuses(t *testing.T) {
	p := newPage(t)
	code, body := p.do(t, http.MethodGet, "/", nil, "X-Forwarded-User", "ann", "Accept", "text/html")
	if code != http.StatusForbidden || !strings.Contains(body, "belongs to another identity") || !strings.Contains(body, `id="sso-sign-out" href="/oauth2/sign_out"`) {
		t.Fatalf("a refused SSO user's home page: %d\n%.2000s", code, body)
	}
	code, body = p.do(t, http.MethodGet, "/", nil, "Accept", "text/html")
	if code != http.StatusOK || strings.Contains(body, `role="alert"`) || strings.Contains(body, "sso-sign-out") {
		t.Fatalf("the home page without credentials: %d\n%.2000s", code, body)
	}
}
