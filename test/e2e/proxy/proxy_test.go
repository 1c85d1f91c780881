// Package proxy tests the edge's proxy end to end: real edges, lifecycle,
// NATS, devcluster and dshsim pods, and headless Chromium.
package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

// newStack is a stack with one lifecycle worker.
func newStack(t *testing.T, mutate func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool)) *testenv.Stack {
	return pkg.NewStack(t, testenv.StackOptions{Sandbox: mutate, Lifecycle: "lc-a"})
}

func expect(t *testing.T, r *testenv.Response, status int, what string) {
	t.Helper()
	if r.StatusCode != status {
		t.Fatalf("%s: status %d, want %d (%.300s)", what, r.StatusCode, status, r.Body)
	}
}

type echo struct {
	Method  string              `json:"method"`
	Path    string              `json:"path"`
	Query   string              `json:"query"`
	Host    string              `json:"host"`
	Headers map[string][]string `json:"headers"`
}

func decodeEcho(t *testing.T, r *testenv.Response) echo {
	t.Helper()
	var e echo
	if err := json.Unmarshal(r.Body, &e); err != nil {
		t.Fatalf("echo: %v (%s)", err, r.Body)
	}
	return e
}

func TestDSHEndpointsThroughTheProxy(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("bob", "")

	// The app page with relative URLs, and the redirect to the prefix.
	r := c.Do("GET", "/u/bob", nil)
	expect(t, r, http.StatusMovedPermanently, "prefix without slash")
	if r.Header.Get("Location") != "/u/bob/" {
		t.Fatalf("Location %q", r.Header.Get("Location"))
	}
	expect(t, c.Do("POST", "/u/bob?x=1", nil), http.StatusPermanentRedirect, "POST to the bare prefix")
	r = c.Do("GET", "/u/bob/", nil)
	expect(t, r, http.StatusOK, "app page")
	if !bytes.Contains(r.Body, []byte(`<base href="./">`)) || !bytes.Contains(r.Body, []byte(`src="app.js"`)) {
		t.Fatalf("app page: %.300s", r.Body)
	}
	expect(t, c.Do("GET", "/u/bob/app.js", nil), http.StatusOK, "relative asset")

	// Root-absolute redirect rewritten under the prefix.
	r = c.Do("GET", "/u/bob/settings", nil)
	expect(t, r, http.StatusFound, "/settings")
	if loc := r.Header.Get("Location"); loc != "/u/bob/settings/" {
		t.Fatalf("Location %q, want /u/bob/settings/", loc)
	}

	// Header hygiene, seen from DSH's side.
	r = c.Do("GET", "/u/bob/api/echo?q=1", nil,
		"Cookie", "dsh_gw_session="+c.Cookie("dsh_gw_session").Value+"; other=1",
		"X-Forwarded-User", "alice", "X-Auth-Request-User", "alice", "X-Auth-Request-Email", "a@x",
		"Forwarded", "for=6.6.6.6", "X-Forwarded-Host", "evil.example", "X-Forwarded-Prefix", "/u/alice",
		"X-Real-IP", "6.6.6.6", "X-Custom", "kept")
	expect(t, r, http.StatusOK, "echo")
	e := decodeEcho(t, r)
	if e.Path != "/api/echo" || e.Query != "q=1" {
		t.Fatalf("DSH saw %s ? %s", e.Path, e.Query)
	}
	host := strings.TrimPrefix(edge.URL, "http://")
	if e.Host != host {
		t.Fatalf("DSH saw Host %q, want the browser's %q", e.Host, host)
	}
	for _, h := range []string{"X-Forwarded-User", "X-Auth-Request-User", "X-Auth-Request-Email", "Forwarded", "X-Real-Ip", "Authorization"} {
		if v, ok := e.Headers[h]; ok {
			t.Errorf("DSH received %s: %v", h, v)
		}
	}
	want := map[string]string{"X-Forwarded-Host": host, "X-Forwarded-Prefix": "/u/bob", "X-Forwarded-Proto": "http", "X-Forwarded-For": "127.0.0.1", "X-Custom": "kept"}
	for h, v := range want {
		if got := e.Headers[h]; len(got) != 1 || got[0] != v {
			t.Errorf("DSH received %s=%v, want %q", h, got, v)
		}
	}
	if ck := strings.Join(e.Headers["Cookie"], ";"); strings.Contains(ck, "dsh_gw_session") || strings.Contains(ck, "other=") || !strings.Contains(ck, "dsh-auth-") {
		t.Errorf("DSH received Cookie %q: only its own auth cookie may pass", ck)
	}
	// A bearer client: Authorization is ours, never DSH's.
	api := testenv.NewClient(t, edge.URL)
	e = decodeEcho(t, api.Do("GET", "/u/bob/api/echo", nil, "Authorization", "Bearer "+token))
	if _, ok := e.Headers["Authorization"]; ok {
		t.Error("DSH received the bearer token")
	}

	// Upstream Set-Cookie never reaches the browser, even DSH's own auth
	// cookie from a handshake a client might attempt through the proxy.
	tok, err := handshake.TokenFromLog([]byte(w.PodLog("bob")))
	if err != nil {
		t.Fatal(err)
	}
	r = c.Do("GET", "/u/bob/?token="+tok, nil)
	if r.StatusCode != http.StatusSeeOther || len(r.Header.Values("Set-Cookie")) != 0 {
		t.Fatalf("handshake through the proxy: %d, Set-Cookie %v", r.StatusCode, r.Header.Values("Set-Cookie"))
	}

	// SSE: events arrive one by one, as DSH sends them 700 ms apart, not
	// all at once when the stream ends. The bound comes from the events:
	// the first and last of four arrive at least one interval apart (three
	// apart as sent; buffering would put them together).
	const interval = 700 * time.Millisecond
	req, _ := http.NewRequest("GET", edge.URL+"/u/bob/api/events?interval=700&count=4", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var arrivals []time.Time
	sse := bufio.NewScanner(resp.Body)
	for sse.Scan() {
		if sse.Text() == "event: tick" {
			arrivals = append(arrivals, time.Now())
		}
	}
	resp.Body.Close()
	if len(arrivals) != 4 {
		t.Fatalf("SSE delivered %d events, want 4", len(arrivals))
	}
	if spread := arrivals[3].Sub(arrivals[0]); spread < interval {
		t.Fatalf("SSE: four events sent %s apart arrived within %s: buffered, not streamed", interval, spread)
	}

	// Chat streams and persists.
	r = c.Do("POST", "/u/bob/api/chat", strings.NewReader(`{"message":"hello there","session":"s1"}`), "Content-Type", "application/json")
	expect(t, r, http.StatusOK, "chat")
	if !bytes.Contains(r.Body, []byte("event: done")) {
		t.Fatalf("chat reply %q", r.Body)
	}
	r = c.Do("GET", "/u/bob/api/chat?session=s1", nil)
	if !bytes.Contains(r.Body, []byte("hello there")) {
		t.Fatalf("history %s", r.Body)
	}
}

// genReader produces n pseudo-random bytes without holding them.
type genReader struct {
	n, off int64
	seed   uint64
}

func (g *genReader) Read(p []byte) (int, error) {
	if g.off >= g.n {
		return 0, io.EOF
	}
	if rem := g.n - g.off; int64(len(p)) > rem {
		p = p[:rem]
	}
	for i := range p {
		g.seed = g.seed*6364136223846793005 + 1442695040888963407
		p[i] = byte(g.seed >> 56)
	}
	g.off += int64(len(p))
	return len(p), nil
}

func vmHWM(t *testing.T, pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

func TestUploadsStreamAndBodyLimits(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"MAX_BODY_MB": "1100"})
	small := w.Edge("edge-small", map[string]string{"MAX_BODY_MB": "1"})
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("cy", "")

	before := vmHWM(t, edge.PID())
	const size = 1 << 30
	h := sha256.New()
	body := io.TeeReader(&genReader{n: size, seed: 42}, h)
	req, _ := http.NewRequest("PUT", edge.URL+"/u/cy/api/files/big.bin", body)
	req.ContentLength = size
	req.Header.Set("Authorization", "Bearer "+token)
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	growth := vmHWM(t, edge.PID()) - before
	t.Logf("1 GiB upload through the edge in %s; edge peak RSS grew %d MiB", time.Since(start).Round(time.Millisecond), growth>>20)
	if resp.StatusCode != http.StatusCreated || !strings.Contains(string(got), hex.EncodeToString(h.Sum(nil))) {
		t.Fatalf("upload: %d %s", resp.StatusCode, got)
	}
	if growth > 64<<20 {
		t.Fatalf("edge peak RSS grew %d MiB during a 1 GiB upload", growth>>20)
	}

	// Over MAX_BODY_MB: refused from Content-Length before DSH is asked,
	// and by counting bytes when the body is chunked.
	api := testenv.NewClient(t, small.URL)
	r := api.Do("PUT", "/u/cy/api/files/too-big.bin", bytes.NewReader(make([]byte, 2<<20)), "Authorization", "Bearer "+token)
	expect(t, r, http.StatusRequestEntityTooLarge, "Content-Length over the limit")
	// A chunked body is refused once it passes the limit, while the
	// client may still be sending: it either reads the 413, or finds the
	// connection closed under its write. Either way the edge counted one
	// 4xx answer for it, and nothing was stored.
	refused := metric(t, small.Proc, `aaas_edge_requests_total{class="4xx"}`)
	req, _ = http.NewRequest("PUT", small.URL+"/u/cy/api/files/chunked.bin", io.MultiReader(&genReader{n: 2 << 20}))
	req.ContentLength = -1
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err = http.DefaultClient.Do(req)
	switch {
	case err == nil:
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("chunked body over the limit: %d", resp.StatusCode)
		}
	case !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET):
		t.Fatalf("chunked body over the limit: %v, want a 413 or the connection closed under the write", err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := metric(t, small.Proc, `aaas_edge_requests_total{class="4xx"}`) - refused; n != 1 {
			return fmt.Errorf("the edge counted %v refusals for the chunked body, want 1", n)
		}
		return nil
	})
	files := c.Do("GET", "/u/cy/api/files", nil)
	if bytes.Contains(files.Body, []byte("too-big")) || bytes.Contains(files.Body, []byte("chunked")) {
		t.Fatalf("a refused upload left a file: %s", files.Body)
	}
}

func wsDial(t *testing.T, url string, h http.Header) (*websocket.Conn, *http.Response, error) {
	t.Helper()
	d := websocket.Dialer{HandshakeTimeout: 30 * time.Second}
	return d.Dial(strings.Replace(url, "http://", "ws://", 1), h)
}

func closeCode(err error) int {
	var ce *websocket.CloseError
	if errors.As(err, &ce) {
		return ce.Code
	}
	return -1
}

func TestWebSocketBridge(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"MAX_IN_FLIGHT_PER_USER": "2"})
	c := testenv.NewClient(t, edge.URL)
	c.Signup("dee", "")
	cookie := http.Header{"Cookie": {"dsh_gw_session=" + c.Cookie("dsh_gw_session").Value}}

	ws, _, err := wsDial(t, edge.URL+"/u/dee/api/ws", cookie)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	if err := ws.WriteMessage(websocket.TextMessage, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	typ, msg, err := ws.ReadMessage()
	if err != nil || typ != websocket.TextMessage || string(msg) != "hello" {
		t.Fatalf("echo: %d %q %v", typ, msg, err)
	}
	_ = ws.WriteMessage(websocket.BinaryMessage, []byte{0, 1, 2})
	if typ, msg, _ = ws.ReadMessage(); typ != websocket.BinaryMessage || !bytes.Equal(msg, []byte{0, 1, 2}) {
		t.Fatalf("binary echo: %d %v", typ, msg)
	}
	// Ping through to DSH and the pong back.
	pong := make(chan string, 1)
	ws.SetPongHandler(func(d string) error { pong <- d; return nil })
	_ = ws.WriteControl(websocket.PingMessage, []byte("p1"), time.Now().Add(time.Second))
	_ = ws.WriteMessage(websocket.TextMessage, []byte("after-ping"))
	if _, msg, err = ws.ReadMessage(); err != nil || string(msg) != "after-ping" {
		t.Fatalf("after ping: %q %v", msg, err)
	}
	select {
	case d := <-pong:
		if d != "p1" {
			t.Fatalf("pong %q", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no pong")
	}
	// 1 MiB from DSH passes; 17 MiB exceeds WS_MAX_MESSAGE_BYTES (16 MiB).
	_ = ws.WriteMessage(websocket.TextMessage, []byte("big:1048576"))
	if _, msg, err = ws.ReadMessage(); err != nil || len(msg) != 1<<20 {
		t.Fatalf("1 MiB message: %d bytes, %v", len(msg), err)
	}
	_ = ws.WriteMessage(websocket.TextMessage, []byte("big:17825792"))
	_, _, err = ws.ReadMessage()
	if code := closeCode(err); code != websocket.CloseMessageTooBig {
		t.Fatalf("17 MiB message: %v (close %d), want close 1009", err, code)
	}

	// No session: the upgrade succeeds and closes with 4401.
	anon, resp, err := wsDial(t, edge.URL+"/u/dee/api/ws", nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("anonymous upgrade: %v", err)
	}
	if _, _, err = anon.ReadMessage(); closeCode(err) != 4401 {
		t.Fatalf("anonymous socket: %v, want close 4401", err)
	}
	// Cross-site page with the cookie: refused.
	cross := cookie.Clone()
	cross.Set("Origin", "http://evil.example")
	// The edge takes the upgrade and closes at once with a reason, so a
	// failed dial is a failure too.
	xs, _, err := wsDial(t, edge.URL+"/u/dee/api/ws", cross)
	if err != nil {
		t.Fatalf("cross-site upgrade: %v, want it accepted and closed with 4403", err)
	}
	if _, _, err = xs.ReadMessage(); closeCode(err) != 4403 {
		t.Fatalf("cross-site socket: %v, want close 4403", err)
	}
	// The per-user cap counts sockets: two open, the third closes 1011.
	a, _, err := wsDial(t, edge.URL+"/u/dee/api/ws", cookie)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, _, err := wsDial(t, edge.URL+"/u/dee/api/ws", cookie)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	over, _, err := wsDial(t, edge.URL+"/u/dee/api/ws", cookie)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err = over.ReadMessage(); closeCode(err) != websocket.CloseInternalServerErr {
		t.Fatalf("third socket: %v, want close 1011", err)
	}
	r := c.Do("GET", "/u/dee/api/files", nil)
	expect(t, r, http.StatusServiceUnavailable, "HTTP over the cap")
	if r.Header.Get("Retry-After") == "" {
		t.Fatal("503 without Retry-After")
	}
	// Close code from the browser reaches DSH and comes back.
	_ = a.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(4000, "bye"), time.Now().Add(time.Second))
	if _, _, err = a.ReadMessage(); closeCode(err) != 4000 {
		t.Fatalf("close code passthrough: %v", err)
	}
	b.Close()
	testutil.Eventually(t, 5*time.Second, func() error {
		if r := c.Do("GET", "/u/dee/api/files", nil); r.StatusCode != http.StatusOK {
			return fmt.Errorf("slots not released: %d", r.StatusCode)
		}
		return nil
	})
}

// reaching sends each path exactly as written with the gateway session
// cookie gw, and returns those an echo answered from under prefix.
func reaching(t *testing.T, edge *testenv.Edge, gw string, paths []string, prefix string) []string {
	t.Helper()
	var reached []string
	for _, p := range paths {
		req, _ := http.NewRequest("GET", edge.URL+"/x", nil)
		req.URL.Opaque = p // sent exactly as written
		req.Header.Set("Cookie", "dsh_gw_session="+gw)
		req.Header.Set("Accept", "application/json")
		resp, err := testenv.NoRedirects().Do(req)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && bytes.Contains(body, []byte(`"`+prefix)) {
			reached = append(reached, p)
		}
		t.Logf("%-40s %d", p, resp.StatusCode)
	}
	return reached
}

func TestOneUsersCookieNeverReachesAnotherUsersPod(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	alice := testenv.NewClient(t, edge.URL)
	alice.Signup("alice", "")
	expect(t, alice.Do("GET", "/u/alice/api/files", nil), http.StatusOK, "alice on her own sandbox")
	bob := testenv.NewClient(t, edge.URL)
	bob.Signup("bob", "")
	before := strings.Count(w.PodLog("alice"), "/api/echo")

	paths := []string{
		"/u/alice/api/echo", "/u/alice/", "/u/%61lice/api/echo", "/u/alice%2fapi/echo", "/U/alice/api/echo",
		"/u/bob/../alice/api/echo", "/u/bob/%2e%2e/alice/api/echo", "/u/bob/%2e%2e%2falice%2fapi/echo",
		"/u/bob%2f..%2falice/api/echo", "/u//alice/api/echo", "//u/alice/api/echo", "/u/./alice/api/echo",
		"/u/bob/..%5calice/api/echo",
	}
	for _, p := range reaching(t, edge, bob.Cookie("dsh_gw_session").Value, paths, "/u/alice") {
		t.Errorf("%s reached alice's pod", p)
	}
	ws, _, err := wsDial(t, edge.URL+"/u/alice/api/ws", http.Header{"Cookie": {"dsh_gw_session=" + bob.Cookie("dsh_gw_session").Value}})
	if err != nil {
		t.Fatalf("bob's upgrade to alice: %v, want it accepted and closed with 4401", err)
	}
	if _, _, err = ws.ReadMessage(); closeCode(err) != 4401 {
		t.Fatalf("bob's socket to alice: %v, want close 4401", err)
	}
	if after := strings.Count(w.PodLog("alice"), "/api/echo"); after != before {
		t.Fatalf("alice's pod logged %d echo requests from bob", after-before)
	}
}

func TestWakeOnConnectAndTokenRotation(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("eve", "")
	expect(t, c.Do("PUT", "/u/eve/api/files/keep.txt", strings.NewReader("kept")), http.StatusCreated, "upload")
	oldPod := w.Box("eve").PodUID

	// An API call to a suspended sandbox is held and then served.
	w.Suspend("eve")
	start := time.Now()
	r := c.Do("GET", "/u/eve/api/files/keep.txt", nil, "Authorization", "Bearer "+token)
	expect(t, r, http.StatusOK, "held request")
	if string(r.Body) != "kept" || w.Box("eve").PodUID == oldPod {
		t.Fatalf("after wake: %q on pod %s (was %s)", r.Body, w.Box("eve").PodUID, oldPod)
	}
	t.Logf("held request served after the wake in %s", time.Since(start).Round(time.Millisecond))

	// A browser navigation to a sleeping sandbox gets the starting page.
	w.Suspend("eve")
	r = c.Do("GET", "/u/eve/", nil, "Accept", "text/html")
	expect(t, r, http.StatusServiceUnavailable, "navigation while asleep")
	if !bytes.Contains(r.Body, []byte(`id="starting"`)) || r.Header.Get("Retry-After") == "" {
		t.Fatalf("starting page: %.200s", r.Body)
	}
	w.Sandboxes().Wait(testenv.Context(t, time.Minute), "eve", func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase == state.PhaseReady })

	// Token rotation: the next request re-handshakes once, transparently,
	// also for a request with a body.
	expect(t, c.Do("GET", "/u/eve/api/files", nil), http.StatusOK, "before rotation")
	handshakes := func() int { return handshakesOf(t, w, "eve") }
	n := handshakes()
	if err := pkg.Cluster.Node.Signal(w.NS.Name, w.Box("eve").PodName, "dsh", syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if !strings.Contains(w.PodLog("eve"), "dsh: token rotated") && strings.Count(w.PodLog("eve"), "?token=") < 2 {
			return errors.New("no rotation yet")
		}
		return nil
	})
	expect(t, c.Do("PUT", "/u/eve/api/files/after.txt", strings.NewReader("after rotation")), http.StatusCreated, "upload after rotation")
	expect(t, c.Do("GET", "/u/eve/api/files", nil), http.StatusOK, "after rotation")
	if got := handshakes() - n; got != 1 {
		t.Fatalf("%d handshakes after one rotation, want 1", got)
	}
}

func TestHandshakeFailureIsA503SayingWhy(t *testing.T) {
	w := newStack(t, func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		c.Env = append(c.Env, corev1.EnvVar{Name: "DSHSIM_NO_TOKEN", Value: "1"})
	})
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("fay", "")
	r := c.Do("GET", "/u/fay/api/files", nil, "Accept", "application/json")
	expect(t, r, http.StatusServiceUnavailable, "no launch token")
	if !bytes.Contains(r.Body, []byte("missing launch token")) {
		t.Fatalf("body %s", r.Body)
	}
}

func TestClientThatLeavesIsLogged499AndItsSlotFreed(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"MAX_IN_FLIGHT_PER_USER": "1", "LOG_LEVEL": "info"})
	c := testenv.NewClient(t, edge.URL)
	c.Signup("gil", "")
	w.Suspend("gil")
	// Block the wake: the sandbox stays asleep while the client waits.
	lc := w.Procs[0]
	lc.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "PUT", edge.URL+"/u/gil/api/files/x.txt", strings.NewReader("never"))
	req.Header.Set("Cookie", "dsh_gw_session="+c.Cookie("dsh_gw_session").Value)
	req.Header.Set("Origin", edge.URL)
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("request returned before the client gave up")
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := metric(t, edge.Proc, `aaas_edge_requests_total{class="4xx",source="client"}`); n != 1 {
			return fmt.Errorf("%v requests counted as left by the client (nginx's 499), want 1", n)
		}
		return nil
	})
	lc.Restart(t)
	lc.WaitReady(t, time.Minute)
	// The slot (cap 1) was released: the next request gets through.
	expect(t, c.Do("GET", "/u/gil/api/files", nil, "Accept", "application/json"), http.StatusOK, "after the abandoned request")
	if bytes.Contains(c.Do("GET", "/u/gil/api/files", nil).Body, []byte("x.txt")) {
		t.Fatal("the abandoned upload reached DSH")
	}
}

func TestNATSOutage(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("hal", "")
	expect(t, c.Do("GET", "/u/hal/api/files", nil), http.StatusOK, "before the outage")

	w.NATS.Stop()
	for i := 0; i < 5; i++ {
		expect(t, c.Do("GET", "/u/hal/api/files", nil), http.StatusOK, "Ready sandbox while NATS is down")
	}
	r := testenv.NewClient(t, edge.URL).WithTimeout(30*time.Second).Form("/users", "user", "ida")
	expect(t, r, http.StatusServiceUnavailable, "signup while NATS is down")

	s, err := w.NATS.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	testutil.Eventually(t, 30*time.Second, func() error {
		if r := testenv.NewClient(t, edge.URL).Form("/users", "user", "ida"); r.StatusCode != http.StatusCreated {
			return fmt.Errorf("signup after recovery: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
	expect(t, c.Do("GET", "/u/hal/api/files", nil), http.StatusOK, "after the outage")
}

// NATS loses everything and starts empty; setup runs again (as
// lifecycle's init container would, or an operator). No aaas process is
// restarted: their caches notice the recreated buckets, lifecycle's
// mirror writes the account and the sandbox back from the claim, and the
// user's bearer token works again; her session is gone (sign in again);
// the sweeper, following the new activity stream, still suspends her
// sandbox once she is idle (audited in the new audit stream).
func TestNATSLosesEverything(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Env: map[string]string{
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "IDLE_TIMEOUT": "5s", "SWEEP_INTERVAL": "200ms",
	}})
	w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("kim", "")
	sid := c.Cookie("dsh_gw_session").Value
	expect(t, c.Do("GET", "/u/kim/api/files", nil), http.StatusOK, "before the loss")

	w.LoseNATS()
	users, err := kv.Open[state.User](context.Background(), w.JS, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := users.Get(context.Background(), "kim"); err == nil {
		t.Log("lifecycle already wrote kim back")
	}

	bearer := testenv.NewClient(t, edge.URL)
	testutil.Eventually(t, 90*time.Second, func() error {
		if _, err := users.Get(context.Background(), "kim"); err != nil {
			return fmt.Errorf("kim's account not back: %v", err)
		}
		if r := bearer.Do("GET", "/u/kim/api/files", nil, "Authorization", "Bearer "+token); r.StatusCode != http.StatusOK {
			return fmt.Errorf("kim's token after the loss: %d %.200s", r.StatusCode, r.Body)
		}
		return nil
	})
	// The session was in NATS: gone, so the cookie is refused once the
	// edge's cache has reloaded the recreated bucket (its next look).
	testutil.Eventually(t, 30*time.Second, func() error {
		if r := testenv.NewClient(t, edge.URL).Do("GET", "/_/status", nil, "Cookie", "dsh_gw_session="+sid); r.StatusCode != http.StatusUnauthorized {
			return fmt.Errorf("the lost session: %d", r.StatusCode)
		}
		return nil
	})
	if n := metric(t, edge.Proc, `aaas_kv_cache_reloads_total`); n < 1 {
		t.Fatalf("the edge's caches reloaded %v times", n)
	}
	// New work goes on: another user signs up.
	testenv.NewClient(t, edge.URL).Signup("lou", "")
	// The new audit stream holds only what happened since the loss: a
	// suspend of kim there is the sweeper's, after it.
	testutil.Eventually(t, time.Minute, func() error {
		if n := len(w.Audit(events.AuditSuspend, "kim")); n == 0 {
			return errors.New("kim's idle sandbox not suspended since the loss")
		}
		return nil
	})
}

func TestGracefulShutdownClosesSocketsWith1001(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"SHUTDOWN_TIMEOUT": "10s"})
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("jay", "")
	ws, _, err := wsDial(t, edge.URL+"/u/jay/api/ws", http.Header{"Authorization": {"Bearer " + token}})
	if err != nil {
		t.Fatal(err)
	}
	// A slow SSE stream in flight finishes within the deadline.
	req, _ := http.NewRequest("GET", edge.URL+"/u/jay/api/events?interval=500&count=4", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	go func() { edge.Stop(); close(stopped) }()
	if _, _, err := ws.ReadMessage(); closeCode(err) != websocket.CloseGoingAway {
		t.Fatalf("socket on shutdown: %v, want close 1001", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || bytes.Count(body, []byte("event: tick")) != 4 {
		t.Fatalf("in-flight stream cut short: %d events, %v", bytes.Count(body, []byte("event: tick")), err)
	}
	<-stopped
	if code := edge.ExitCode(); code != 0 {
		t.Fatalf("edge exit code %d", code)
	}
}
