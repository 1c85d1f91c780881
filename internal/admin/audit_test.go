package admin

import (
	"encoding/csv"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/events"
)

// The audit view filters the trail by user, kind and time, pages it, and
// exports what it shows; a bad filter is a 400 that reads nothing, and a
// user who is not an administrator sees no such path.
func TestAuditView(t *testing.T) {
	s, token, js := fixtureJS(t, 3, Options{})
	ctx := natstest.Context(t, time.Minute)
	for i, e := range []events.AuditEvent{
		{Kind: events.AuditLogin, User: "ann", Outcome: "ok", RequestID: "r1"},
		{Kind: events.AuditWake, User: "ann", Outcome: "woken"},
		{Kind: events.AuditLogin, User: "bob", Outcome: "ok"},
		{Kind: events.AuditLogin, User: "ann", Outcome: "ok", Detail: `a "quoted", comma`},
	} {
		e.V, e.Source, e.At = events.SchemaVersion, "edge-a", time.Now().Add(time.Duration(i)*time.Millisecond)
		data, _ := json.Marshal(e)
		if _, err := js.Publish(ctx, e.Subject(), data); err != nil {
			t.Fatal(err)
		}
	}
	get := func(query string) (int, string) {
		status, _, body := send(t, s, "GET", "/_/admin/audit?"+query, "", token, false)
		return status, body
	}
	decode := func(body string) (evs []events.AuditEvent, more bool) {
		var doc struct {
			Events []events.AuditEvent
			More   bool
		}
		if err := json.Unmarshal([]byte(body), &doc); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
		return doc.Events, doc.More
	}
	for _, tc := range []struct {
		query string
		want  int
		more  bool
	}{
		{"user=ann", 3, false},
		{"user=ann&kind=login", 2, false},
		{"kind=login", 3, false},
		{"kind=login&limit=2", 2, true},
		{"user=carol", 0, false},
		{"since=" + url.QueryEscape(time.Now().Add(time.Hour).Format(time.RFC3339)) + "&until=" + url.QueryEscape(time.Now().Add(2*time.Hour).Format(time.RFC3339)), 0, false},
		{"since=1h", 4, false},
	} {
		status, body := get(tc.query)
		if status != http.StatusOK {
			t.Fatalf("%s: %d %s", tc.query, status, body)
		}
		if evs, more := decode(body); len(evs) != tc.want || more != tc.more {
			t.Errorf("%s: %d events (more %v), want %d (more %v): %s", tc.query, len(evs), more, tc.want, tc.more, body)
		}
	}
	// The CSV export: a header and one record per event, fields quoted.
	status, body := get("user=ann&kind=login&format=csv")
	records, err := csv.NewReader(strings.NewReader(body)).ReadAll()
	if status != http.StatusOK || err != nil || len(records) != 3 || records[0][0] != "at" || records[2][7] != `a "quoted", comma` || records[1][5] != "r1" {
		t.Errorf("csv: %d %v %q", status, err, records)
	}
	// The page, as a browser asks for it.
	status, _, page := send(t, s, "GET", "/_/admin/audit?user=ann", "", token, true)
	if status != http.StatusOK || strings.Count(page, "<tr><td>") != 3 || !strings.Contains(page, "a &#34;quoted&#34;, comma") {
		t.Errorf("page: %d\n%s", status, page)
	}
	for _, q := range []string{"user=A..B", "kind=nonsense", "since=yesterday", "until=-5m", "since=2h&until=3h", "limit=0", "limit=10001", "format=xml"} {
		if status, body := get(q); status != http.StatusBadRequest || !strings.Contains(body, `"detail"`) {
			t.Errorf("%s: %d %s, want 400 saying why", q, status, body)
		}
	}
	if status, _, _ := send(t, s, "GET", "/_/admin/audit", "", "not-a-token", false); status == http.StatusOK {
		t.Errorf("the audit view answered 200 without an administrator's token")
	}

	// More than a page: the view pages, an export holds them all.
	for i := range AuditPage + 5 {
		e := events.AuditEvent{V: events.SchemaVersion, Kind: events.AuditLogin, User: "zed", Outcome: "ok", Source: "edge-a", At: time.Now().Add(time.Duration(i) * time.Microsecond)}
		data, _ := json.Marshal(e)
		if _, err := js.Publish(ctx, e.Subject(), data); err != nil {
			t.Fatal(err)
		}
	}
	_, body = get("user=zed")
	if evs, more := decode(body); len(evs) != AuditPage || !more {
		t.Errorf("the view: %d events (more %v), want a page of %d and more", len(evs), more, AuditPage)
	}
	for format, rows := range map[string]func(string) int{
		"csv":  func(b string) int { r, _ := csv.NewReader(strings.NewReader(b)).ReadAll(); return len(r) - 1 },
		"json": func(b string) int { evs, _ := decode(b); return len(evs) },
	} {
		if status, body := get("user=zed&format=" + format); status != http.StatusOK || rows(body) != AuditPage+5 {
			t.Errorf("the %s export: %d, %d rows, want all %d", format, status, rows(body), AuditPage+5)
		}
	}
}
