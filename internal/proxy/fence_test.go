package proxy

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	tu "github.com/aaas-project/aaas/internal/dev/testutil"
)

// With NATS gone the edge keeps serving Ready sandboxes from its cache
// (invariant 8), but only while its copy of the sandboxes bucket was
// confirmed current within MaxStaleness: past it the address may belong
// to another pod by now, so nothing (no body, no DSH cookie) is sent
// there, and the answer is a 503 that says why. When NATS is back the
// edge routes again by itself.
func TestStaleStateIsNotRouted(t *testing.T) {
	const fence = 8 * time.Second
	var hits atomic.Int64
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, "ok")
	}), func(o *Options) { o.MaxStaleness = fence })
	post := func() *http.Response {
		return f.do("POST", "/u/bob/upload", strings.NewReader("a body for bob's pod only"))
	}
	if r := post(); r.StatusCode != http.StatusOK {
		t.Fatalf("before the outage: %d", r.StatusCode)
	}

	f.nats.Stop()
	// Within the bound: still routed. The cache was confirmed at most one
	// look (2 s) before the stop; say so if the machine was slower.
	if age := time.Since(f.boxCache.Current()); age > fence-2*time.Second {
		t.Fatalf("the cache was last confirmed %s before the control request: too close to the %s bound to test within it", age, fence)
	}
	if r := post(); r.StatusCode != http.StatusOK {
		t.Fatalf("within %s of the last confirmation: %d, want the Ready sandbox served", fence, r.StatusCode)
	}

	// Past the bound: refused, and nothing reaches the address.
	tu.Eventually(t, fence+30*time.Second, func() error {
		if r := post(); r.StatusCode != http.StatusServiceUnavailable {
			return fmt.Errorf("status %d %s after the cache went %s unconfirmed", r.StatusCode, r.Header.Get("Content-Type"), time.Since(f.boxCache.Current()).Round(time.Second))
		}
		return nil
	})
	if age := time.Since(f.boxCache.Current()); age <= fence {
		t.Fatalf("refused with the cache confirmed %s ago, within the %s bound", age, fence)
	}
	seen := hits.Load()
	r := post()
	body, _ := io.ReadAll(r.Body)
	if r.StatusCode != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" || !strings.Contains(string(body), "lost touch with its state store") {
		t.Fatalf("stale route: %d Retry-After %q %s", r.StatusCode, r.Header.Get("Retry-After"), body)
	}
	if n := hits.Load() - seen; n != 0 {
		t.Fatalf("%d requests reached the stale address after the bound", n)
	}
	if n := testutil.ToFloat64(f.proxy.m.staleRefusals); n < 2 {
		t.Fatalf("aaas_edge_stale_route_refusals_total %v, want every refusal counted", n)
	}

	back, err := f.nats.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Stop)
	tu.Eventually(t, time.Minute, func() error {
		if r := post(); r.StatusCode != http.StatusOK {
			return fmt.Errorf("after NATS returned: %d", r.StatusCode)
		}
		return nil
	})
}
