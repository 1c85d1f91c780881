package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	tu "github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// echoHandler answers with what it was sent: method, path, headers, body.
var echoHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"method": r.Method, "uri": r.RequestURI, "host": r.Host, "headers": r.Header, "body": string(body)})
})

type echoed struct {
	Method, URI, Host, Body string
	Headers                 http.Header
}

func readEcho(t *testing.T, resp *http.Response) echoed {
	t.Helper()
	var e echoed
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
		t.Fatal(err)
	}
	return e
}

func TestCachedPathStreamsAndReusesConnections(t *testing.T) {
	f := newFixture(t, payload, nil)
	for _, size := range []int{0, 1, smallBody, smallBody + 1, 3 << 20} {
		for range 5 {
			resp := f.do("GET", fmt.Sprintf("/u/bob/bytes?n=%d", size), nil)
			n, err := io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != http.StatusOK || n != int64(size) || err != nil {
				t.Fatalf("%d bytes: status %d, got %d bytes, %v", size, resp.StatusCode, n, err)
			}
		}
	}
	if n := f.upstreamConns.Load(); n != 1 {
		t.Fatalf("25 sequential requests opened %d upstream connections, want 1", n)
	}
}

// The request DSH sees: our headers set, the browser's credentials and
// claims gone, hop-by-hop headers (and those Connection names) dropped,
// the path and query as sent.
func TestRequestHygiene(t *testing.T) {
	f := newFixture(t, echoHandler, nil)
	e := readEcho(t, f.do("GET", "/u/bob/a/../b%2Fc?x=1&y=%20", nil,
		"X-Forwarded-For", "6.6.6.6", "X-Real-Ip", "6.6.6.6", "Connection", "X-Secret", "X-Secret", "s",
		"X-Custom", "kept", "Cookie", "dsh_gw_session=abc; other=1"))
	if e.URI != "/a/../b%2Fc?x=1&y=%20" {
		t.Errorf("DSH saw %q", e.URI)
	}
	for h, want := range map[string]string{
		"Cookie": "dsh-auth=first", "X-Forwarded-For": "127.0.0.1", "X-Forwarded-Prefix": "/u/bob", "X-Forwarded-Proto": "http", "X-Custom": "kept",
	} {
		if got := e.Headers.Values(h); len(got) != 1 || got[0] != want {
			t.Errorf("DSH saw %s=%q, want %q", h, got, want)
		}
	}
	for _, h := range []string{"Authorization", "X-Real-Ip", "X-Secret"} {
		if v := e.Headers.Values(h); len(v) != 0 {
			t.Errorf("DSH saw %s=%q", h, v)
		}
	}
}

// DSH's answer as the browser sees it: origin-wide and nginx headers
// gone, redirects kept in the prefix, a protocol-relative one refused.
func TestResponseHygiene(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Set-Cookie", "dsh-auth=secret")
		h.Set("X-Accel-Redirect", "/internal")
		h.Set("Connection", "X-Secret")
		h.Set("X-Secret", "s")
		h.Set("X-Custom", "kept")
		switch r.URL.Path {
		case "/away":
			h.Set("Location", "//evil.example/")
			w.WriteHeader(http.StatusFound)
		default:
			h.Set("Location", "/settings/")
			w.WriteHeader(http.StatusFound)
		}
	}), nil)
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(path string) *http.Response {
		req, _ := http.NewRequest("GET", f.url+path, nil)
		req.Header.Set("Authorization", fixtureToken)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	resp := get("/u/bob/here")
	if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/u/bob/settings/" || resp.Header.Get("X-Custom") != "kept" {
		t.Fatalf("%d Location %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	for _, h := range []string{"Set-Cookie", "X-Accel-Redirect", "X-Secret"} {
		if v := resp.Header.Values(h); len(v) != 0 {
			t.Errorf("browser got %s=%q", h, v)
		}
	}
	if resp := get("/u/bob/away"); resp.StatusCode != http.StatusBadGateway || resp.Header.Get("Location") != "" {
		t.Fatalf("protocol-relative redirect: %d Location %q", resp.StatusCode, resp.Header.Get("Location"))
	}
}

// lifecycle plays the handshake worker: every handshake command seals
// the upstream's current cookie. It returns how many it served.
func (f *fixture) lifecycle(t *testing.T) *atomic.Int64 {
	nc, err := nats.Connect(f.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	var n atomic.Int64
	_, err = nc.Subscribe(events.CommandSubject(events.VerbHandshake, fixtureUser), func(m *nats.Msg) {
		var c events.Command
		if json.Unmarshal(m.Data, &c) == nil && c.Handshake != nil {
			n.Add(1)
			f.seal(c.Handshake.Host)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	// The server must have the subscription before the edge publishes: a
	// command sent earlier reaches nobody (the edge's handshake then times
	// out, as a loaded CI machine showed).
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return &n
}

// A handshake that fails because the pod went away meanwhile (here the
// sweeper suspends the sandbox while lifecycle looks for its pod) is not
// the browser's answer: the navigation is answered from the sandbox's new
// state, the starting page and a wake. The same failure of a pod that is
// still the sandbox's is reported as it is.
func TestHandshakeOfAPodGoneWakesTheSandbox(t *testing.T) {
	for _, suspended := range []bool{true, false} {
		t.Run(fmt.Sprintf("suspended=%v", suspended), func(t *testing.T) {
			f := newFixture(t, echoHandler, nil)
			// A pod with no handshake yet: the request asks lifecycle.
			pod := state.Sandbox{User: fixtureUser, Phase: state.PhaseReady, PodUID: "pod-2", Address: f.upstream.Listener.Addr().String()}
			f.putBox(pod)
			nc, err := nats.Connect(f.natsURL)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			failed := make(chan error, 1)
			_, err = nc.Subscribe(events.CommandSubject(events.VerbHandshake, fixtureUser), func(m *nats.Msg) {
				var c events.Command
				if json.Unmarshal(m.Data, &c) != nil || c.Handshake == nil {
					return
				}
				if suspended {
					pod.Phase, pod.Address = state.PhaseSuspended, ""
					f.putBox(pod)
				}
				key := state.HandshakeKey(fixtureUser, c.Handshake.PodUID, c.Handshake.Host)
				_, err := f.hs.Put(context.Background(), key, state.Handshake{User: fixtureUser, PodUID: c.Handshake.PodUID, Host: c.Handshake.Host,
					Error: "the sandbox's pod changed or stopped before the handshake", At: time.Now()})
				failed <- err
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			page := f.do("GET", "/u/bob/", nil, "Accept", "text/html")
			if err := <-failed; err != nil {
				t.Fatal(err)
			}
			text := body(t, page)
			s, err := f.js.Stream(context.Background(), events.StreamCommands)
			if err != nil {
				t.Fatal(err)
			}
			_, wakeErr := s.GetLastMsgForSubject(context.Background(), events.CommandSubject(events.VerbWake, fixtureUser))
			switch {
			case page.StatusCode != http.StatusServiceUnavailable:
				t.Fatalf("%d %s", page.StatusCode, text)
			case suspended && (!strings.Contains(text, "Starting your sandbox") || wakeErr != nil):
				t.Fatalf("the sandbox was suspended during the handshake; the page says %q, wake: %v", text, wakeErr)
			case !suspended && (!strings.Contains(text, "could not sign in") || !errors.Is(wakeErr, jetstream.ErrMsgNotFound)):
				t.Fatalf("the pod is still the sandbox's; the page says %q, wake: %v", text, wakeErr)
			}
		})
	}
}

// A rotated DSH cookie costs one 401, one handshake and one retry, with
// the body (kept unread by Expect: 100-continue) sent once.
func TestRefusedCookieIsRefreshedOnce(t *testing.T) {
	f := newFixture(t, echoHandler, nil)
	// Two rotations in a row: not paced here (TestRefreshesArePacedPerPodAndHost is).
	f.proxy.resolver.refreshes = handshake.NewBackoff(0, 0)
	handshakes := f.lifecycle(t)
	var refused atomic.Int64
	f.onRefuse = func() { refused.Add(1) }

	f.rotate("dsh-auth=second")
	if e := readEcho(t, f.do("GET", "/u/bob/x", nil)); e.Headers.Get("Cookie") != "dsh-auth=second" {
		t.Fatalf("GET retried with %q", e.Headers.Get("Cookie"))
	}
	f.rotate("dsh-auth=third")
	e := readEcho(t, f.do("POST", "/u/bob/upload", strings.NewReader("hello body"), "Content-Type", "text/plain"))
	if e.Body != "hello body" || e.Headers.Get("Cookie") != "dsh-auth=third" {
		t.Fatalf("POST retried with %q, body %q", e.Headers.Get("Cookie"), e.Body)
	}
	if refused.Load() != 2 || handshakes.Load() != 2 {
		t.Fatalf("%d refusals and %d handshakes, want 2 and 2", refused.Load(), handshakes.Load())
	}
}

// Bodies above MAX_BODY get 413: by their length before DSH is asked,
// and chunked ones by their bytes.
func TestBodyLimit(t *testing.T) {
	f := newFixture(t, echoHandler, nil)
	big := bytes.Repeat([]byte("x"), 2<<20)
	resp := f.do("PUT", "/u/bob/f", bytes.NewReader(big))
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("2 MiB with a length: %d", resp.StatusCode)
	}
	resp = f.do("PUT", "/u/bob/f", io.MultiReader(bytes.NewReader(big))) // no length: chunked
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("2 MiB chunked: %d", resp.StatusCode)
	}
	if e := readEcho(t, f.do("PUT", "/u/bob/f", io.MultiReader(bytes.NewReader(big[:1<<20])))); len(e.Body) != 1<<20 {
		t.Fatalf("1 MiB chunked arrived as %d bytes", len(e.Body))
	}
}

// DSH answering before it has read an upload: the browser gets the
// answer, and the next request is served.
func TestEarlyAnswer(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == "PUT" {
			// One byte asks for the body (100 Continue), then the answer
			// comes while the edge is still sending the rest.
			_, _ = r.Body.Read(make([]byte, 1))
			w.WriteHeader(http.StatusCreated)
			return
		}
		echoHandler(w, r)
	}), nil)
	for range 5 {
		resp := f.do("PUT", "/u/bob/f", bytes.NewReader(make([]byte, 1<<20)))
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("early answer: %d", resp.StatusCode)
		}
		readEcho(t, f.do("GET", "/u/bob/after", nil))
	}
}

// A client that leaves while its request waits for a sandbox cancels the
// wait: the slot comes back and the request is counted as 499.
func TestClientGoneCancelsTheWait(t *testing.T) {
	reg := prometheus.NewRegistry()
	f := newFixture(t, echoHandler, func(o *Options) { o.Metrics = reg; o.WakeTimeout = time.Minute })
	f.putBox(state.Sandbox{User: fixtureUser, Phase: state.PhaseSuspended, PodUID: fixturePod})
	client := &http.Client{Timeout: 400 * time.Millisecond}
	req, _ := http.NewRequest("GET", f.url+"/u/bob/x", nil)
	req.Header.Set("Authorization", fixtureToken)
	if resp, err := client.Do(req); err == nil {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("the request did not wait for the sandbox: %d %s", resp.StatusCode, b)
	}
	left := func() error {
		if n := testutil.ToFloat64(f.proxy.m.byClass[sourceClient][classIndex(web.StatusClientClosed)]); n != 1 {
			return fmt.Errorf("%v requests counted as 499", n)
		}
		if !f.proxy.o.Slots.Acquire(fixtureUser) {
			return fmt.Errorf("slot still held")
		}
		f.proxy.o.Slots.Release(fixtureUser)
		return nil
	}
	tu.Eventually(t, 5*time.Second, left)
}

// The edge's own answers negotiate one way: a page for text/html, RFC 9457
// JSON for everything else.
func TestProblemNegotiation(t *testing.T) {
	f := newFixture(t, echoHandler, nil)
	resp := f.do("GET", "/u/nobody/x", nil, "Authorization", "")
	var p struct {
		Status int
		Title  string
	}
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil || resp.Header.Get("Content-Type") != "application/problem+json" || p.Status != http.StatusUnauthorized {
		t.Fatalf("*/*: %d %s %+v %v", resp.StatusCode, resp.Header.Get("Content-Type"), p, err)
	}
	resp = f.do("GET", "/u/nobody/x", nil, "Authorization", "", "Accept", "text/html,*/*")
	if b, _ := io.ReadAll(resp.Body); resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") || !bytes.Contains(b, []byte("<html")) {
		t.Fatalf("text/html: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	resp = f.do("GET", "/u/bob/x", nil, "Accept", "application/json")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("bob: %d", resp.StatusCode)
	}
}

// Server-sent events arrive one by one (DSH sends the next only once the
// browser has the previous one) and the stream ends when DSH ends it (a
// chunked body, which fasthttp reads past its end).
func TestEventStream(t *testing.T) {
	next := make(chan struct{})
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			if i > 0 {
				<-next
			}
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
		}
	}), nil)
	for range 2 { // the second on the reused connection
		resp := f.do("GET", "/u/bob/events", nil)
		r := bufio.NewReader(resp.Body)
		for i := range 3 {
			line, err := r.ReadString('\n')
			if err != nil || line != fmt.Sprintf("data: %d\n", i) {
				t.Fatalf("event %d: %q %v", i, line, err)
			}
			_, _ = r.ReadString('\n')
			if i < 2 {
				next <- struct{}{}
			}
		}
		if rest, err := io.ReadAll(r); err != nil || len(rest) != 0 {
			t.Fatalf("after the last event: %q %v", rest, err)
		}
	}
	if n := f.upstreamConns.Load(); n != 1 {
		t.Fatalf("%d upstream connections", n)
	}
}

func TestCloseCodes(t *testing.T) {
	for _, tt := range []struct {
		err  *web.Error
		want int
	}{
		{errUnauthorized, closeUnauthorized},
		{errNotYours, closeUnauthorized},
		{errCrossSite, closeForbidden},
		{web.Refuse(http.StatusForbidden, "not allowed"), closeForbidden},
		{errBusy, 1011},
		{errDraining, 1001},
		{asProxyError(io.ErrUnexpectedEOF), 1011},
	} {
		if got := closeCode(tt.err); got != tt.want {
			t.Errorf("%q: close %d, want %d", tt.err.Detail, got, tt.want)
		}
	}
}

// A WebSocket through the proxy: messages both ways, DSH's close code
// passed to the browser, the cookie refreshed when DSH refuses the
// upgrade.
// A refused upgrade whose cookie refresh fails tells the browser why (the
// handshake timed out here: no lifecycle answers), not that the sandbox
// refused the connection.
func TestWebSocketRefreshFailureSaysWhy(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = (&websocket.Upgrader{}).Upgrade(w, r, nil) // never reached: the cookie is stale
	}), nil)
	f.rotate("dsh-auth=fresh")
	ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(f.url, "http")+"/u/bob/ws", http.Header{"Authorization": {fixtureToken}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	_, _, err = ws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != 1011 || !strings.Contains(ce.Text, "timed out") {
		t.Fatalf("close: %v, want 1011 saying the handshake timed out", err)
	}
}

func TestWebSocketBridge(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		up := websocket.Upgrader{}
		c, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		for {
			typ, msg, err := c.ReadMessage()
			if err != nil {
				return
			}
			if string(msg) == "bye" {
				_ = c.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(4000, "as asked"))
				return
			}
			_ = c.WriteMessage(typ, msg)
		}
	}), nil)
	handshakes := f.lifecycle(t)
	f.rotate("dsh-auth=fresh")
	ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(f.url, "http")+"/u/bob/ws", http.Header{"Authorization": {fixtureToken}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	for _, m := range []string{"one", strings.Repeat("x", 100<<10)} {
		if err := ws.WriteMessage(websocket.TextMessage, []byte(m)); err != nil {
			t.Fatal(err)
		}
		if _, got, err := ws.ReadMessage(); err != nil || string(got) != m {
			t.Fatalf("echo of %d bytes: %d bytes, %v", len(m), len(got), err)
		}
	}
	_ = ws.WriteMessage(websocket.TextMessage, []byte("bye"))
	_, _, err = ws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != 4000 || ce.Text != "as asked" {
		t.Fatalf("close: %v", err)
	}
	if handshakes.Load() != 1 {
		t.Fatalf("%d handshakes, want 1 (the refused upgrade's refresh)", handshakes.Load())
	}
}

// A tenant's own 5xx is counted apart from the gateway's: a sandbox that
// answers 500 to everything must not trip the operator's 5xx alert,
// which reads source="gateway".
func TestTenantAnswersAreCountedApartFromTheGateways(t *testing.T) {
	reg := prometheus.NewRegistry()
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/away" {
			w.Header().Set("Location", "//evil.example/") // refused by the edge: 502
			w.WriteHeader(http.StatusFound)
			return
		}
		w.WriteHeader(http.StatusInternalServerError)
	}), func(o *Options) { o.Metrics = reg })
	for path, want := range map[string]int{"/u/bob/boom": http.StatusInternalServerError, "/u/bob/away": http.StatusBadGateway} {
		resp := f.do("GET", path, nil, "Authorization", fixtureToken)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("%s: %d, want %d", path, resp.StatusCode, want)
		}
	}
	for _, tc := range []struct {
		source int
		want   float64
	}{{sourceTenant, 1}, {sourceGateway, 1}, {sourceClient, 0}} {
		if n := testutil.ToFloat64(f.proxy.m.byClass[tc.source][classIndex(500)]); n != tc.want {
			t.Errorf("5xx from %s: %v, want %v", sources[tc.source], n, tc.want)
		}
	}
}

// A WebSocket answers the handshake on the client's connection itself
// (proxy.upgrade), after fasthttp is done with the request: a request that
// is not a handshake gets its 400 before anything is hijacked, and both it
// and a socket that ends give the user's slot back.
func TestWebSocketHandshake(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		typ, msg, err := c.ReadMessage()
		if err == nil {
			_ = c.WriteMessage(typ, msg)
		}
	}), nil)
	inFlight := func() error {
		v, ok := f.proxy.o.Slots.users.Load(fixtureUser)
		if !ok {
			return fmt.Errorf("no slot was ever taken")
		}
		if n := v.(*atomic.Int64).Load(); n != 0 {
			return fmt.Errorf("%d slots held", n)
		}
		return nil
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(f.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /u/bob/ws HTTP/1.1\r\nHost: %s\r\nAuthorization: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\r\n", strings.TrimPrefix(f.url, "http://"), fixtureToken)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("a handshake without a key: %d, want 400", resp.StatusCode)
	}
	tu.Eventually(t, 5*time.Second, inFlight)

	ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(f.url, "http")+"/u/bob/ws", http.Header{"Authorization": {fixtureToken}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ws.WriteMessage(websocket.TextMessage, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if _, got, err := ws.ReadMessage(); err != nil || string(got) != "hello" {
		t.Fatalf("echo: %q, %v", got, err)
	}
	if err := inFlight(); err == nil {
		t.Fatal("an open socket holds no slot: the count tells nothing")
	}
	ws.Close()
	tu.Eventually(t, 5*time.Second, inFlight)
}
