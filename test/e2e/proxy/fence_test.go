package proxy_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/state"
)

// stranger is another tenant's server at an address the edge still has
// on record for a pod that is gone: it answers anything, as a hostile pod
// would, and keeps what reaches it.
type stranger struct {
	mu       sync.Mutex
	requests []string // method, path, Cookie and body of each
	srv      *http.Server
}

func (s *stranger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.requests = append(s.requests, fmt.Sprintf("%s %s cookie=%q body=%q", r.Method, r.URL.Path, r.Header.Get("Cookie"), body))
	s.mu.Unlock()
	_, _ = io.WriteString(w, "I am whoever you think I am\n")
}

func (s *stranger) seen() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.requests...)
}

// listenAt takes over addr once the pod that had it is gone.
func listenAt(t *testing.T, addr string) *stranger {
	t.Helper()
	var ln net.Listener
	testutil.Eventually(t, time.Minute, func() error {
		var err error
		ln, err = net.Listen("tcp", addr)
		return err
	})
	s := &stranger{}
	s.srv = &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.srv.Serve(ln) }()
	t.Cleanup(func() { _ = s.srv.Close() })
	return s
}

// Security review S8, beside invariant 8. An edge cut off from NATS keeps
// serving Ready sandboxes from its cache, but only while that copy was
// confirmed current within ROUTE_MAX_STALENESS. Meanwhile alice's pod
// goes (lifecycle, still on the bus, suspends it) and a stranger takes its
// address: a pod cannot prove it is the recorded one, so past the bound
// the edge sends it nothing — no request, no body, no DSH cookie — and
// bob, whose pod never moved, gets the same 503. Once the bus is back the
// edge routes again by itself, alice's sandbox wakes on a new pod, and
// the stranger still has nothing.
func TestStaleRecordsAreNotRouted(t *testing.T) {
	const fence = 8 * time.Second
	w := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Faults: true})
	edge := w.Edge("edge-a", map[string]string{"ROUTE_MAX_STALENESS": fence.String()})
	alice, bob := testenv.NewClient(t, edge.URL), testenv.NewClient(t, edge.URL)
	alice.Signup("alice", "")
	bob.Signup("bob", "")
	expect(t, alice.Do("GET", "/u/alice/api/files", nil), http.StatusOK, "alice before the cut")
	expect(t, bob.Do("GET", "/u/bob/api/files", nil), http.StatusOK, "bob before the cut")
	old := w.Box("alice")
	age := func() time.Duration {
		return time.Duration(metric(t, edge.Proc, "aaas_edge_sandboxes_state_age_seconds") * float64(time.Second))
	}
	reconnects := metric(t, edge.Proc, "aaas_nats_reconnects_total")

	w.Faults.Cut("edge-a")
	cut := time.Now()
	// Within the bound, Ready sandboxes are served from the cache
	// (invariant 8's positive control).
	if a := age(); a > fence-3*time.Second {
		t.Fatalf("the edge's copy was %s old right after the cut: too close to the %s bound to test within it", a, fence)
	}
	expect(t, bob.Do("GET", "/u/bob/api/files", nil), http.StatusOK, "bob within the bound, cut off from NATS")

	// alice's pod goes; a stranger takes its address.
	w.Suspend("alice")
	s := listenAt(t, old.Address)
	direct, err := http.Get("http://" + old.Address + "/probe")
	if err != nil {
		t.Fatal(err)
	}
	direct.Body.Close()
	if n := len(s.seen()); n != 1 {
		t.Fatalf("the stranger at %s recorded %d requests of the control, want 1", old.Address, n)
	}

	// Past the bound nothing is routed: bob first (his record is right,
	// but no longer known to be).
	testutil.Eventually(t, fence+time.Minute, func() error {
		r := bob.Do("GET", "/u/bob/api/files", nil, "Accept", "application/json")
		if r.StatusCode != http.StatusServiceUnavailable {
			return fmt.Errorf("bob %s after the cut (copy %s old): %d", time.Since(cut).Round(time.Second), age().Round(time.Second), r.StatusCode)
		}
		if !strings.Contains(string(r.Body), "lost touch with its state store") || r.Header.Get("Retry-After") == "" {
			return fmt.Errorf("bob's 503 does not say why, or when to retry: %s", r.Body)
		}
		return nil
	})
	if a := age(); a <= fence {
		t.Fatalf("refused with the copy %s old, within the %s bound", a, fence)
	}
	if time.Since(cut) < fence-3*time.Second {
		t.Fatalf("refused %s after the cut, before the bound could pass", time.Since(cut))
	}
	secret := "alice's secret, for her pod only"
	r := alice.Do("PUT", "/u/alice/api/files/secret.txt", strings.NewReader(secret), "Accept", "application/json")
	expect(t, r, http.StatusServiceUnavailable, "alice's upload to her stale address")
	ws, _, err := wsDial(t, edge.URL+"/u/alice/api/ws", http.Header{"Cookie": {"dsh_gw_session=" + alice.Cookie("dsh_gw_session").Value}, "Origin": {edge.URL}})
	if err != nil {
		t.Fatalf("alice's WebSocket: %v, want the upgrade and a close", err)
	}
	if _, _, err := ws.ReadMessage(); closeCode(err) < 1000 {
		t.Fatalf("alice's WebSocket to a stale address: %v, want a close", err)
	}
	ws.Close()
	if got := s.seen(); len(got) != 1 {
		t.Fatalf("the stranger at alice's old address got %v", got[1:])
	}
	if n := metric(t, edge.Proc, "aaas_edge_stale_route_refusals_total"); n < 3 {
		t.Fatalf("aaas_edge_stale_route_refusals_total %v, want bob's, alice's upload and her WebSocket counted", n)
	}

	// The bus returns: the edge routes again by itself.
	w.Faults.Restore("edge-a")
	testutil.Eventually(t, 2*time.Minute, func() error {
		if r := bob.Do("GET", "/u/bob/api/files", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK {
			return fmt.Errorf("bob after the bus returned: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
	if n := metric(t, edge.Proc, "aaas_nats_reconnects_total"); n <= reconnects {
		t.Fatalf("the edge's NATS connection never dropped (reconnects %v, before the cut %v): the cut did not happen", n, reconnects)
	}
	// alice's sandbox is Suspended, as the edge now knows: her request
	// wakes it on a new pod (the stranger holds the old address).
	r = alice.Do("PUT", "/u/alice/api/files/secret.txt", strings.NewReader(secret))
	expect(t, r, http.StatusCreated, "alice's upload after the bus returned")
	if now := w.Box("alice"); now.Phase != state.PhaseReady || now.Address == old.Address || now.PodUID == old.PodUID {
		t.Fatalf("alice after the wake: %+v (old pod %s at %s)", now, old.PodUID, old.Address)
	}
	if got := s.seen(); len(got) != 1 {
		t.Fatalf("the stranger at alice's old address got %v", got[1:])
	}
	// The upload reached her pod (a GET reads it back).
	if r := alice.Do("GET", "/u/alice/api/files/secret.txt", nil); string(r.Body) != secret {
		t.Fatalf("alice's file on her new pod: %d %q", r.StatusCode, r.Body)
	}
}
