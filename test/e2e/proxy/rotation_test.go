package proxy_test

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/testenv"
)

// HANDSHAKE_KEYS rotates as README says (new key appended, then first,
// then alone), each step a rolling restart of lifecycle and both edges,
// while a user keeps working through a balancer: not one request fails, and
// at the end the cookie in use is sealed with the new key only.
func TestHandshakeKeyRotationUnderTraffic(t *testing.T) {
	w := newStack(t, nil)
	lc := w.Procs[0]
	lbAddr := w.FrontAddr()
	a, b := w.Edge("edge-a", nil), w.Edge("edge-b", nil)
	// The pooling front, as in production: it retries an idempotent
	// request on another edge when a restarting one closes a connection
	// without answering (a plain TCP balancer cannot, and a test through
	// one fails on that race, not on the rotation).
	lb := testenv.NewFrontAt(t, lbAddr, a.URL[len("http://"):], b.URL[len("http://"):])
	c := testenv.NewClient(t, lb.URL())
	token := c.Signup("rot", "")

	var sent, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		client := &http.Client{Timeout: 30 * time.Second}
		get := func() (*http.Response, error) {
			req, _ := http.NewRequest("GET", lb.URL()+"/u/rot/api/files", nil)
			req.Header.Set("Authorization", "Bearer "+token)
			return client.Do(req)
		}
		for ctx.Err() == nil {
			// A draining replica still serves what reaches it.
			resp, err := get()
			sent.Add(1)
			if err != nil || resp.StatusCode != http.StatusOK {
				failed.Add(1)
				mu.Lock()
				if err != nil {
					failures = append(failures, err.Error())
				} else {
					failures = append(failures, resp.Status)
				}
				mu.Unlock()
			}
			if resp != nil {
				resp.Body.Close()
			}
			time.Sleep(20 * time.Millisecond)
		}
	})

	oldKey, newKey := w.Key, testenv.HandshakeKey()
	for _, ring := range []string{oldKey + "," + newKey, newKey + "," + oldKey, newKey} {
		for _, p := range []*testenv.Proc{lc, a.Proc, b.Proc} {
			p.Stop()
			p.Env["HANDSHAKE_KEYS"] = ring
			p.Restart(t)
			p.WaitReady(t, time.Minute)
			time.Sleep(300 * time.Millisecond) // traffic on the restarted replica
		}
	}
	time.Sleep(time.Second)
	stop()
	wg.Wait()
	t.Logf("%d requests across three rolling restarts of three processes, %d failed", sent.Load(), failed.Load())
	if failed.Load() > 0 {
		t.Fatalf("%d requests failed: %v", failed.Load(), failures)
	}

	// The cookie now in use opens with the new key alone.
	box := w.Box("rot")
	entries, err := handshakes(t, w).Keys(testenv.Context(t, time.Minute), "rot.>")
	if err != nil || len(entries) == 0 {
		t.Fatalf("no handshake of rot: %v", err)
	}
	k, _ := handshake.ParseKey(newKey)
	only, _ := handshake.NewSealer(k)
	opened := 0
	for _, key := range entries {
		e, err := handshakes(t, w).Get(testenv.Context(t, time.Minute), key)
		if err != nil || e.Value.PodUID != box.PodUID || e.Value.Error != "" {
			continue
		}
		if _, err := only.Open(e.Value.Sealed, []byte(key)); err == nil {
			opened++
		}
	}
	if opened == 0 {
		t.Fatalf("no cookie of rot's pod is sealed with the new key")
	}
}

func handshakes(t *testing.T, w *testenv.Stack) *kv.Bucket[state.Handshake] {
	t.Helper()
	b, err := kv.Open[state.Handshake](testenv.Context(t, time.Minute), w.JS, state.BucketHandshakes)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
