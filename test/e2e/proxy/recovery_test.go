package proxy_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A sandbox whose pod ended for good (evicted) is healed: lifecycle
// deletes the pod, the controller makes a new one on the same volume, and
// the user's next request is served with their files intact. Meanwhile the
// user is told the sandbox is restarting, never that it failed.
func TestEvictedPodIsReplacedWithTheFilesKept(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("eve", "")
	expect(t, c.Do("PUT", "/u/eve/api/files/keep.txt", strings.NewReader("kept")), http.StatusCreated, "upload")
	old := w.Box("eve").PodUID

	w.EndPod("eve", "Evicted", "The node was low on resource: memory.")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, _, err := w.Sandboxes().Wait(ctx, "eve", func(e kv.Entry[state.Sandbox], ok bool) bool {
		return ok && e.Value.Phase == state.PhaseReady && e.Value.PodUID != old
	}); err != nil {
		t.Fatalf("not healed: %+v", w.Box("eve"))
	}
	// What the user was shown on the way, from the audit trail (every
	// phase change is in it; a watch may skip a short-lived one).
	var shown []string
	for _, l := range strings.Split(w.AuditLog(), "\n") {
		if strings.Contains(l, `"kind":"state"`) && strings.Contains(l, `"user":"eve"`) {
			shown = append(shown, l)
		}
	}
	all := strings.Join(shown, "\n")
	if strings.Contains(all, `"outcome":"Failed"`) {
		t.Fatalf("the user was shown Failed:\n%s", all)
	}
	if !strings.Contains(all, `"outcome":"Waking"`) || !strings.Contains(all, "restarting: the previous pod failed: Evicted") {
		t.Fatalf("the user was not shown the sandbox restarting:\n%s", all)
	}
	if !strings.Contains(all, `"outcome":"restarting"`) {
		t.Fatalf("the pod's replacement is not in the audit trail:\n%s", all)
	}
	r := c.Do("GET", "/u/eve/api/files/keep.txt", nil)
	if r.StatusCode != http.StatusOK || string(r.Body) != "kept" {
		t.Fatalf("file after the new pod: %d %q", r.StatusCode, r.Body)
	}
}
