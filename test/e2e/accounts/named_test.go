package accounts_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// TestANamedSandboxIsKeptAwakeAndWatchedAlone: a named sandbox has its own
// status, status stream and keep-awake. Kept awake, it outlives the idle
// timeout that suspends its owner's first sandbox in the same window (the
// positive control), and sleeps once the keep-awake ends. Asking for a
// sandbox the caller has not, or for too long, is refused and keeps
// nothing awake.
func TestANamedSandboxIsKeptAwakeAndWatchedAlone(t *testing.T) {
	idle, hold := 3*time.Second, 15*time.Second
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite, "MAX_SANDBOXES_PER_USER": "2",
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": "200ms", "MAX_KEEPAWAKE": "1m",
	}, Lifecycle: "lc-a"})
	edge := w.Edge("edge-a", nil)
	kim, bob := testenv.NewClient(t, edge.URL), testenv.NewClient(t, edge.URL)
	kim.Signup("kim", invite)
	bob.Signup("bob", invite)
	if r := kim.Form("/_/sandboxes", "name", "work"); r.StatusCode != http.StatusCreated {
		t.Fatalf("kim makes work: %d %s", r.StatusCode, r.Body)
	}
	ready := func(key string) {
		t.Helper()
		testutil.Eventually(t, 2*time.Minute, func() error {
			if e, _ := w.Sandboxes().Get(key); e.Value.Phase != state.PhaseReady {
				return fmt.Errorf("%s is %s", key, e.Value.Phase)
			}
			return nil
		})
	}
	ready("kim")
	ready("kim--work")

	// Its status and stream are its own.
	var st struct{ User, Phase, URL string }
	if r := kim.Do("GET", "/_/sandboxes/work/status", nil); r.StatusCode != http.StatusOK || json.Unmarshal(r.Body, &st) != nil || st.User != "kim--work" || st.Phase != "Ready" || !strings.Contains(st.URL, "kim--work") {
		t.Fatalf("work's status: %d %s", r.StatusCode, r.Body)
	}
	if ev := firstEvent(t, kim, "/_/sandboxes/work/status/stream"); !strings.Contains(ev, `"user":"kim--work"`) {
		t.Fatalf("work's status stream said %s", ev)
	}
	for path, want := range map[string]int{"/_/sandboxes/play/status": http.StatusNotFound, "/_/sandboxes/Work/status": http.StatusBadRequest} {
		if r := kim.Do("GET", path, nil); r.StatusCode != want {
			t.Fatalf("GET %s: %d %s, want %d", path, r.StatusCode, r.Body, want)
		}
	}
	if r := bob.Do("GET", "/_/sandboxes/work/status", nil); r.StatusCode != http.StatusNotFound || strings.Contains(string(r.Body), "kim") {
		t.Fatalf("bob asks for work's status: %d %s", r.StatusCode, r.Body)
	}

	// Refusals keep nothing awake.
	for _, c := range []struct {
		who  *testenv.Client
		path string
		fr   string
		want int
	}{
		{bob, "/_/sandboxes/work/keepawake", "1m", http.StatusNotFound},
		{kim, "/_/sandboxes/play/keepawake", "1m", http.StatusNotFound},
		{kim, "/_/sandboxes/work/keepawake", "2m", http.StatusBadRequest},
		{kim, "/_/sandboxes/work/keepawake", "soon", http.StatusBadRequest},
	} {
		if r := c.who.Form(c.path, "for", c.fr); r.StatusCode != c.want {
			t.Fatalf("POST %s for %s: %d %s, want %d", c.path, c.fr, r.StatusCode, r.Body, c.want)
		}
	}
	if r := kim.Do("POST", "/_/sandboxes/work/keepawake", strings.NewReader("for=30s"), "Content-Type", "application/x-www-form-urlencoded", "Origin", "http://evil.example"); r.StatusCode != http.StatusForbidden {
		t.Fatalf("a cross-origin keep-awake: %d", r.StatusCode)
	}
	awake := testutil.Open[state.KeepAwake](t, w.JS, state.BucketKeepAwake)
	if keys, err := awake.Keys(testenv.Context(t, time.Minute), ">"); err != nil || len(keys) != 0 {
		t.Fatalf("keep-awakes after the refusals: %v %v", keys, err)
	}

	w.Sweeper("sw-a", nil)
	r := kim.Form("/_/sandboxes/work/keepawake", "for", hold.String())
	until, err := time.Parse(time.RFC3339, fmt.Sprint(r.JSON()["keep_awake_until"]))
	if r.StatusCode != http.StatusOK || err != nil || r.JSON()["user"] != "kim--work" {
		t.Fatalf("keep work awake: %d %s", r.StatusCode, r.Body)
	}
	if keys, err := awake.Keys(testenv.Context(t, time.Minute), ">"); err != nil || strings.Join(keys, " ") != "kim--work" {
		t.Fatalf("keep-awakes: %v %v, want work's alone", keys, err)
	}
	// kim's first sleeps by the idle timeout; work, kept awake, not
	// before its keep-awake ends.
	firstAt := suspended(t, w, "kim", time.Minute)
	if e, _ := w.Sandboxes().Get("kim--work"); firstAt.Before(until) && e.Value.Phase != state.PhaseReady {
		t.Fatalf("work is %s when kim's first sleeps, before its keep-awake ends", e.Value.Phase)
	}
	if workAt := suspended(t, w, "kim--work", 2*time.Minute); workAt.Before(until) {
		t.Fatalf("work slept at %s, before its keep-awake until %s", workAt, until)
	}
	if a := w.Audit(events.AuditKeepAwake, "kim"); len(a) != 1 || !strings.HasPrefix(a[0].Detail, "sandbox work, until ") {
		t.Fatalf("keep-awakes audited: %+v", a)
	}
}

// suspended waits until key's sandbox is Suspended, and returns when it
// was first seen going.
func suspended(t *testing.T, w *testenv.Stack, key string, within time.Duration) time.Time {
	t.Helper()
	var at time.Time
	testutil.Eventually(t, within, func() error {
		e, _ := w.Sandboxes().Get(key)
		if at.IsZero() && (e.Value.Phase == state.PhaseSuspending || e.Value.Phase == state.PhaseSuspended) {
			at = time.Now()
		}
		if e.Value.Phase != state.PhaseSuspended {
			return fmt.Errorf("%s is %s", key, e.Value.Phase)
		}
		return nil
	})
	return at
}
