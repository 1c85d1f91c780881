package accounts_test

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// auditEvents is the stack's audit stream, decoded: the tests read
// outcomes from its fields, never from text that happens to match.
func auditEvents(t *testing.T, w *testenv.Stack) []events.AuditEvent {
	t.Helper()
	var out []events.AuditEvent
	for _, line := range strings.Split(strings.TrimSpace(w.AuditLog()), "\n") {
		if line == "" {
			continue
		}
		e, err := events.Decode[events.AuditEvent]([]byte(line))
		if err != nil {
			t.Fatalf("audit event %q: %v", line, err)
		}
		out = append(out, e)
	}
	return out
}

// count is how many of evs match.
func count(evs []events.AuditEvent, match func(events.AuditEvent) bool) int {
	n := 0
	for _, e := range evs {
		if match(e) {
			n++
		}
	}
	return n
}

// kind matches events of k (about user, unless user is "").
func kind(k events.AuditKind, user string) func(events.AuditEvent) bool {
	return func(e events.AuditEvent) bool { return e.Kind == k && (user == "" || e.User == user) }
}

// refusal matches an audited refusal of a client (not a summary of the
// ones left unaudited).
func refusal(e events.AuditEvent) bool {
	switch {
	case e.Kind == events.AuditRateLimited:
		return e.Outcome != "audits_suppressed"
	case e.Kind == events.AuditLogin:
		return e.Outcome == "rejected"
	}
	return e.Kind == events.AuditInviteRejected || e.Kind == events.AuditSSORefused
}

// account is user's record in the users bucket, if it has one.
func account(t *testing.T, w *testenv.Stack, user string) (state.User, bool) {
	t.Helper()
	b, err := kv.Open[state.User](testenv.Context(t, time.Minute), w.JS, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	e, err := b.Get(testenv.Context(t, time.Minute), user)
	if err != nil && !errors.Is(err, kv.ErrNotFound) {
		t.Fatal(err)
	}
	return e.Value, err == nil
}

// One request id follows a request across processes: the ingress's
// X-Request-Id (the test's client is the trusted ingress) is the edge's
// answer header, its audit event's, and, carried by the command,
// lifecycle's audit events' and log lines' for the work the request asked
// for: a signup's claim, and a wake.
func TestOneRequestIDAcrossProcesses(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a"})
	edge := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1/32"})
	lc := w.Procs[0]
	c := testenv.NewClient(t, edge.URL)
	const signupID, wakeID = "4f2d3c1b0a9e8d7c6b5a49382716aabb", "123e4567-e89b-12d3-a456-426614174000"
	r := c.Do(http.MethodPost, "/users", strings.NewReader("user=rita"),
		"Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json", "X-Request-Id", signupID)
	if r.StatusCode != http.StatusCreated || r.Header.Get("X-Request-Id") != signupID {
		t.Fatalf("signup: %d, X-Request-Id %q: %s", r.StatusCode, r.Header.Get("X-Request-Id"), r.Body)
	}
	w.WaitPhase(t, "rita", state.PhaseReady, 2*time.Minute)
	w.Suspend("rita")
	if r := c.Do(http.MethodGet, "/u/rita/api/files", nil, "X-Request-Id", wakeID); r.StatusCode != http.StatusOK || r.Header.Get("X-Request-Id") != wakeID {
		t.Fatalf("wake: %d, X-Request-Id %q", r.StatusCode, r.Header.Get("X-Request-Id"))
	}
	// A request from no trusted ingress gets an id of the edge's own.
	other := testenv.NewClient(t, edge.URL).From("127.0.0.2")
	if got := other.Do(http.MethodGet, "/", nil, "X-Request-Id", wakeID).Header.Get("X-Request-Id"); got == wakeID || got == "" {
		t.Errorf("an untrusted client's request id %q was used (got %q)", wakeID, got)
	}

	evs := auditEvents(t, w)
	for _, want := range []struct {
		kind    events.AuditKind
		outcome string
		id      string
	}{
		{events.AuditSignup, state.OutcomeCreated, signupID}, // the edge's
		{events.AuditClaim, state.OutcomeCreated, signupID},  // lifecycle's
		{events.AuditWake, "woken", wakeID},                  // lifecycle's
	} {
		if n := count(evs, func(e events.AuditEvent) bool {
			return e.Kind == want.kind && e.User == "rita" && e.Outcome == want.outcome && e.RequestID == want.id
		}); n != 1 {
			t.Errorf("%d %s/%s audit events of rita with request id %s, want 1", n, want.kind, want.outcome, want.id)
		}
	}
	// lifecycle's line for each command quotes it.
	for _, id := range []string{signupID, wakeID} {
		found := false
		for _, l := range strings.Split(lc.Logs(), "\n") {
			found = found || strings.Contains(l, `"msg":"command done"`) && strings.Contains(l, `"request_id":"`+id+`"`)
		}
		if !found {
			t.Errorf("lifecycle logged no command done with request id %s", id)
		}
	}
}
