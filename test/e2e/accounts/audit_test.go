package accounts_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
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
