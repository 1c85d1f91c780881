package proxy

import (
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/handshake"
)

// A DSH that refuses every cookie gets a refresh now and then, not one per
// request (security review S6): the first refusal is refreshed at once,
// those within the pacing after it are answered as refused without asking
// lifecycle or DSH again, and another host's cookie is not held by it.
func TestRefreshesArePacedPerPodAndHost(t *testing.T) {
	var upstream atomic.Int64
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		upstream.Add(1)
		http.Error(w, "unauthorized", http.StatusUnauthorized) // even the current cookie
	}), nil)
	handshakes := f.lifecycle(t)

	const n = 50
	start := time.Now()
	for i := range n {
		if resp := f.do("GET", "/u/bob/x", nil, "Accept", "application/json"); resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("request %d: %d, want 503 (DSH keeps refusing)", i, resp.StatusCode)
		}
	}
	elapsed := time.Since(start)
	// What the pacing allows in the time the requests took: the first at
	// once, then one each time its wait has run out.
	allowed := paced(handshake.EdgeRefreshes(), elapsed)
	got := handshakes.Load()
	if got < 1 || got > allowed {
		t.Fatalf("%d requests refused by DSH in %s caused %d refreshes, want 1..%d", n, elapsed, got, allowed)
	}
	// Each request reached DSH once, plus one retry per refresh: the
	// paced ones were not sent again.
	if u := upstream.Load(); u != n+got {
		t.Fatalf("DSH saw %d requests, want %d (one each, and a retry per refresh)", u, n+got)
	}

	// Another host's cookie for the same pod is asked for and refreshed at
	// once, in the same window.
	req, _ := http.NewRequest("GET", f.url+"/u/bob/x", nil)
	req.Host = "other.example"
	req.Header.Set("Authorization", fixtureToken)
	req.Header.Set("Accept", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || handshakes.Load() != got+2 {
		t.Fatalf("other host: %d after %d handshakes, want 503 after a handshake and a refresh (%d)", resp.StatusCode, handshakes.Load(), got+2)
	}
}

// paced is how many goes b allows for one key asked for without pause
// during d.
func paced(b *handshake.Backoff, d time.Duration) int64 {
	t0 := time.Unix(0, 0)
	var n int64
	for at := t0; !at.After(t0.Add(d)); {
		wait := b.Next("k", at)
		if wait == 0 {
			n++
			continue
		}
		at = at.Add(wait)
	}
	return n
}
