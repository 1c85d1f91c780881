package proxy

import (
	"testing"
	"time"
)

// A stream counts as work in flight while the browser's input on it is
// recent, then is reported apart; input brings it back; closing a stale
// stream does not move the user's clock, closing a live one does.
func TestStreamsStopCountingWithoutBrowserInput(t *testing.T) {
	const ict = time.Hour
	tr := newTracker(nil, "edge-a", time.Second, 3*time.Second, ict, nil)
	counts := func(a *userActivity) (live, idle int, requests int64) {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.live, a.idle, a.requests.Load()
	}
	a := tr.get("ann")
	tab := tr.open("ann")
	typing := tr.open("ann")
	tr.begin("ann")
	sse := tr.promote("ann") // a request whose answer became a stream
	if live, idle, req := counts(a); live != 3 || idle != 0 || req != 0 {
		t.Fatalf("open: live %d idle %d requests %d, want 3 0 0", live, idle, req)
	}
	opened := tab.input.Load()
	later := time.Now().Add(ict + time.Minute).UnixNano()
	typing.input.Store(later - int64(time.Minute)) // the user typed a minute ago
	tr.age(a, later)
	if live, idle, _ := counts(a); live != 1 || idle != 2 {
		t.Fatalf("after %s: live %d idle %d, want 1 2", ict, live, idle)
	}
	if want := opened + int64(ict); a.last.Load() < want {
		t.Fatalf("clock %d, want at least when the tab stopped counting (%d)", a.last.Load(), want)
	}
	if a.liveNow.Load() != 1 {
		t.Fatalf("liveNow %d", a.liveNow.Load())
	}
	tab.browserInput()
	if live, idle, _ := counts(a); live != 2 || idle != 1 {
		t.Fatalf("after input: live %d idle %d, want 2 1", live, idle)
	}
	before := a.last.Load()
	sse.close() // stale
	if a.last.Load() != before {
		t.Fatal("closing a stale stream moved the clock")
	}
	sse.close() // twice changes nothing
	typing.close()
	tab.close()
	if live, idle, _ := counts(a); live != 0 || idle != 0 || a.liveNow.Load() != 0 {
		t.Fatalf("all closed: live %d idle %d", live, idle)
	}
}
