package proxy_test

import (
	"bufio"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// How soon a revocation ends its streams is a figure, measured by
// BenchmarkRevocationEndsAWebSocket; the tests below check that it does,
// with hangGuard only to stop a hang, and watch the streams that must live
// on for aliveWindow.
const (
	hangGuard   = 30 * time.Second
	aliveWindow = 2 * time.Second
)

// live is one credential's long-lived exchanges through an edge: a
// WebSocket, an SSE stream from DSH and the landing page's status stream.
type live struct {
	ws     *websocket.Conn
	ended  map[string]chan struct{}
	closed chan int // the WebSocket's close code
}

func openLive(t *testing.T, base, user string, h http.Header) *live {
	t.Helper()
	l := &live{ended: map[string]chan struct{}{}, closed: make(chan int, 1)}
	ws, _, err := wsDial(t, base+"/u/"+user+"/api/ws", h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	l.ws = ws
	go func() {
		for {
			if _, _, err := ws.ReadMessage(); err != nil {
				l.closed <- closeCode(err)
				return
			}
		}
	}()
	for name, path := range map[string]string{
		"dsh events":    "/u/" + user + "/api/events?interval=200&count=100000",
		"status stream": "/_/status/stream",
	} {
		req, _ := http.NewRequest("GET", base+path, nil)
		req.Header = h.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %v %v", name, resp, err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		first := make(chan struct{})
		done := make(chan struct{})
		l.ended[name] = done
		go func() {
			r := bufio.NewReader(resp.Body)
			once := false
			for {
				line, err := r.ReadString('\n')
				if strings.HasPrefix(line, "data:") && !once {
					once = true
					close(first)
				}
				if err != nil {
					close(done)
					return
				}
			}
		}()
		select {
		case <-first:
		case <-time.After(time.Minute):
			t.Fatalf("%s: no first event", name)
		}
	}
	return l
}

// endedWithin checks that every exchange of l ended within d of since, the
// WebSocket with 4401.
func (l *live) endedWithin(t *testing.T, what string, since time.Time, d time.Duration) {
	t.Helper()
	deadline := time.After(time.Until(since.Add(d)))
	select {
	case code := <-l.closed:
		if code != 4401 {
			t.Errorf("%s: WebSocket closed with %d, want 4401", what, code)
		}
		t.Logf("%s: WebSocket closed %s after the revocation returned", what, time.Since(since).Round(time.Millisecond))
	case <-deadline:
		t.Fatalf("%s: WebSocket still open %s after the revocation", what, d)
	}
	for name, done := range l.ended {
		select {
		case <-done:
		case <-deadline:
			t.Fatalf("%s: %s still open %s after the revocation", what, name, d)
		}
	}
}

// alive checks the exchanges of l still work.
func (l *live) alive(t *testing.T, what string) {
	t.Helper()
	if err := l.ws.WriteMessage(websocket.TextMessage, []byte("still here")); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	select {
	case code := <-l.closed:
		t.Fatalf("%s: WebSocket closed with %d", what, code)
	case <-time.After(aliveWindow):
	}
	for name, done := range l.ended {
		select {
		case <-done:
			t.Fatalf("%s: %s ended", what, name)
		default:
		}
	}
}

// A session revoked anywhere ends its streams everywhere: a logout on
// edge B closes the WebSocket, the DSH event stream and the status stream
// the same session holds open through edge A; another session of the same
// user keeps its own. Deleting an account ends its bearer
// streams; a recreate ends its sessions' streams.
func TestRevocationEndsLiveStreams(t *testing.T) {
	w := newStack(t, nil)
	a, b := w.Edge("edge-a", nil), w.Edge("edge-b", nil)

	// Logout on the other edge.
	c := testenv.NewClient(t, a.URL)
	token := c.Signup("rev", "")
	cookie := func(c *testenv.Client) http.Header {
		return http.Header{"Cookie": {"dsh_gw_session=" + c.Cookie("dsh_gw_session").Value}, "Origin": {a.URL}}
	}
	other := testenv.NewClient(t, a.URL)
	expect(t, other.Form("/login", "token", token), http.StatusOK, "a second session")
	revoked, kept := openLive(t, a.URL, "rev", cookie(c)), openLive(t, a.URL, "rev", cookie(other))
	out := testenv.NewClient(t, b.URL)
	r := out.Do("POST", "/logout", nil, "Cookie", "dsh_gw_session="+c.Cookie("dsh_gw_session").Value, "Origin", b.URL)
	if r.StatusCode != http.StatusSeeOther {
		t.Fatalf("logout on edge B: %d %s", r.StatusCode, r.Body)
	}
	revoked.endedWithin(t, "logout on another edge", time.Now(), hangGuard)
	kept.alive(t, "the user's other session")
	if m, err := a.Metric("aaas_edge_revoked_streams_total"); err != nil || !strings.HasSuffix(m, " 2") {
		t.Fatalf("edge A revoked streams: %q %v (want the WebSocket and the DSH stream)", m, err)
	}

	// A recreate ends every session of the user.
	start := time.Now()
	expect(t, out.Do("POST", "/recreate", nil, "Authorization", "Bearer "+token, "Accept", "application/json"), http.StatusAccepted, "recreate")
	kept.endedWithin(t, "recreate (timed from the request)", start, hangGuard)

	// Deleting the account ends its bearer streams.
	d := testenv.NewClient(t, a.URL)
	dtoken := d.Signup("del", "")
	bearer := http.Header{"Authorization": {"Bearer " + dtoken}}
	gone := openLive(t, a.URL, "del", bearer)
	r = out.Do("DELETE", "/users/del", nil, "Authorization", "Bearer "+dtoken)
	if r.StatusCode != http.StatusNoContent {
		t.Fatalf("delete: %d %s", r.StatusCode, r.Body)
	}
	gone.endedWithin(t, "account deleted", time.Now(), hangGuard)
}

// BenchmarkRevocationEndsAWebSocket measures a logout on edge B to the
// close (4401) of the same session's WebSocket through edge A: the
// sessions watch reaching A and A's re-check. Run with -benchtime=20x.
func BenchmarkRevocationEndsAWebSocket(b *testing.B) {
	w := pkg.NewStack(b, testenv.StackOptions{Lifecycle: "lc-a"})
	ea, eb := w.Edge("edge-a", nil), w.Edge("edge-b", nil)
	token := testenv.NewClient(b, ea.URL).Signup("rev", "")
	var lat []time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		c := testenv.NewClient(b, ea.URL)
		if r := c.Form("/login", "token", token); r.StatusCode != http.StatusOK {
			b.Fatalf("login: %d %s", r.StatusCode, r.Body)
		}
		sid := "dsh_gw_session=" + c.Cookie("dsh_gw_session").Value
		d := websocket.Dialer{HandshakeTimeout: 30 * time.Second}
		ws, _, err := d.Dial(strings.Replace(ea.URL, "http://", "ws://", 1)+"/u/rev/api/ws", http.Header{"Cookie": {sid}, "Origin": {ea.URL}})
		if err != nil {
			b.Fatal(err)
		}
		if err := ws.WriteMessage(websocket.TextMessage, []byte("up")); err != nil {
			b.Fatal(err)
		}
		if _, _, err := ws.ReadMessage(); err != nil {
			b.Fatal(err)
		}
		closed := make(chan int, 1)
		go func() {
			for {
				if _, _, err := ws.ReadMessage(); err != nil {
					closed <- closeCode(err)
					return
				}
			}
		}()
		b.StartTimer()
		start := time.Now()
		if r := testenv.NewClient(b, eb.URL).Do("POST", "/logout", nil, "Cookie", sid, "Origin", eb.URL); r.StatusCode != http.StatusSeeOther {
			b.Fatalf("logout: %d %s", r.StatusCode, r.Body)
		}
		select {
		case code := <-closed:
			lat = append(lat, time.Since(start))
			if code != 4401 {
				b.Fatalf("closed with %d, want 4401", code)
			}
		case <-time.After(hangGuard):
			b.Fatal("the WebSocket outlived its session")
		}
		b.StopTimer()
		ws.Close()
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[int(0.99*float64(len(lat)-1))].Microseconds())/1000, "p99-ms")
}
