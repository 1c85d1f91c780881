package proxy_test

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
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

	// Every cookie of rot's current pod opens with the new key alone and
	// none with the old one: nothing sealed before the rotation is left
	// in use (or lying in NATS) for that pod.
	box := w.Box("rot")
	entries, err := handshakes(t, w).Keys(testenv.Context(t, time.Minute), "rot.>")
	if err != nil || len(entries) == 0 {
		t.Fatalf("no handshake of rot: %v", err)
	}
	sealers := map[string]*handshake.Sealer{}
	for name, key := range map[string]string{"new": newKey, "old": oldKey} {
		k, err := handshake.ParseKey(key)
		if err != nil {
			t.Fatal(err)
		}
		if sealers[name], err = handshake.NewSealer(k); err != nil {
			t.Fatal(err)
		}
	}
	current := 0
	for _, key := range entries {
		e, err := handshakes(t, w).Get(testenv.Context(t, time.Minute), key)
		if err != nil {
			t.Fatalf("handshake %s: %v", key, err)
		}
		if e.Value.PodUID != box.PodUID {
			continue
		}
		current++
		if e.Value.Error != "" {
			t.Errorf("handshake %s of the current pod failed: %s", key, e.Value.Error)
			continue
		}
		if _, err := sealers["new"].Open(e.Value.Sealed, []byte(key)); err != nil {
			t.Errorf("handshake %s of the current pod does not open with the new key: %v", key, err)
		}
		if _, err := sealers["old"].Open(e.Value.Sealed, []byte(key)); err == nil {
			t.Errorf("handshake %s of the current pod still opens with the retired key", key)
		}
	}
	if current == 0 {
		t.Fatalf("no handshake entry for rot's current pod %s among %v", box.PodUID, entries)
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
