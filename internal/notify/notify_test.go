package notify

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// A receiver that fails twice gets the notice on the third attempt, signed,
// with the same delivery id each time; one that always fails gets exactly
// Attempts tries, and the notice is counted failed.
func TestDeliveryIsSignedRetriedAndBounded(t *testing.T) {
	secret := []byte("shared-secret")
	var mu sync.Mutex
	tries := map[string]int{}
	var got []Notice
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Header.Get(SignatureHeader) != Sign(secret, body) {
			t.Errorf("bad signature %q", r.Header.Get(SignatureHeader))
		}
		var x Notice
		if err := json.Unmarshal(body, &x); err != nil || x.ID != r.Header.Get("X-Aaas-Delivery") {
			t.Errorf("notice %s (%v), delivery %q", body, err, r.Header.Get("X-Aaas-Delivery"))
		}
		mu.Lock()
		defer mu.Unlock()
		tries[x.ID]++
		if x.User == "never" || tries[x.ID] < 3 {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		got = append(got, x)
	}))
	defer srv.Close()
	reg := prometheus.NewRegistry()
	n := New(Options{URL: srv.URL, Secret: secret, Attempts: 4, Backoff: time.Millisecond, Queue: 8, Log: slog.New(slog.DiscardHandler), Metrics: reg})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go n.Run(ctx)
	n.Send(Notice{ID: "suspended.ann.1", Kind: KindSuspended, User: "ann", Reason: "idle", At: time.Now()})
	n.Send(Notice{ID: "suspended.never.1", Kind: KindSuspended, User: "never", At: time.Now()})
	testutil.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(got) != 1 || tries["suspended.ann.1"] != 3 || tries["suspended.never.1"] != 4 {
			return fmt.Errorf("delivered %v after tries %v", got, tries)
		}
		return nil
	})
}

// A nil Notifier (no NOTIFY_WEBHOOK_URL) accepts notices and does nothing.
func TestWithoutAURLNothingIsSent(t *testing.T) {
	n := New(Options{})
	if n != nil {
		t.Fatal("a notifier without a URL")
	}
	n.Send(Notice{Kind: KindDormant})
	n.Run(context.Background())
}
