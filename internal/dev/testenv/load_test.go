package testenv

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// A request that hangs counts as failed once it has waited Stall, in a
// report taken while it still hangs, and once only when it is answered
// in the end.
func TestLoadCountsARequestHangingPastStall(t *testing.T) {
	release := make(chan struct{})
	var served atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served.Add(1) == 1 {
			<-release // the first request hangs
		}
		if strings.HasSuffix(r.URL.Path, "/api/events") {
			fmt.Fprint(w, strings.Repeat("event: tick\n\n", 3))
		}
	}))
	defer srv.Close()
	l := StartLoad(t, srv.URL, LoadOptions{Users: map[string]*Client{"x": NewClient(t, srv.URL)}, NoSockets: true, Stall: 300 * time.Millisecond})
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := l.Report(); r.Failed != 1 || r.Stalled != 1 || r.Slowest < 300*time.Millisecond {
			return fmt.Errorf("while the request hangs: %d failed, %d stalled, slowest %s", r.Failed, r.Stalled, r.Slowest)
		}
		return nil
	})
	close(release)
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := l.Report(); r.Sent < 2 {
			return fmt.Errorf("%d answered", r.Sent)
		}
		return nil
	})
	l.Stop()
	if r := l.Report(); r.Failed != 1 || r.Stalled != 1 || r.Requests["GET small stalled"] != 1 {
		t.Fatalf("after the answer: %d failed, %d stalled, %v; want the one stalled request counted once", r.Failed, r.Stalled, r.Requests)
	}
}
