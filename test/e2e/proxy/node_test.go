package proxy_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// nodeSandbox makes user's sandbox the Node.js upstream at addr, as the
// sandbox and handshake records lifecycle would write (no lifecycle runs
// in these tests, so nothing rewrites them), for requests with the given
// Host headers. It returns the user's bearer token.
func nodeSandbox(t *testing.T, s *testenv.Stack, user, addr string, hosts ...string) string {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	token := ident.NewToken(user)
	users, err := kv.Open[state.User](ctx, s.JS, state.BucketUsers)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := users.Put(ctx, user, state.User{Name: user, TokenHash: ident.HashHex(token), Claim: "dsh-" + user, Managed: true, Created: time.Now()}); err != nil {
		t.Fatal(err)
	}
	boxes, err := kv.Open[state.Sandbox](ctx, s.JS, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	pod := "node-" + user
	if _, err := boxes.Put(ctx, user, state.Sandbox{User: user, Phase: state.PhaseReady, Managed: true, Claim: "dsh-" + user, PodName: pod, PodUID: pod, Address: addr, ReadySince: time.Now()}); err != nil {
		t.Fatal(err)
	}
	hs, err := kv.Open[state.Handshake](ctx, s.JS, state.BucketHandshakes)
	if err != nil {
		t.Fatal(err)
	}
	k, _ := handshake.ParseKey(s.Key)
	sealer, _ := handshake.NewSealer(k)
	for _, host := range hosts {
		key := state.HandshakeKey(user, pod, host)
		if _, err := hs.Put(ctx, key, state.Handshake{User: user, PodUID: pod, Host: host, Sealed: sealer.Seal([]byte("dsh-auth-node=1"), []byte(key)), At: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	return token
}

// nodeWorld is an edge (and the nginx front) whose user "nod" is served by
// the Node.js upstream.
type nodeWorld struct {
	edge  *testenv.Edge
	front *testenv.Front
	token string
}

func newNodeWorld(t *testing.T) *nodeWorld {
	s := pkg.NewStack(t, testenv.StackOptions{})
	upstream := testenv.NodeUpstream(t)
	frontAddr := s.FrontAddr()
	edge := s.Edge("edge-a", nil)
	front := testenv.NewFrontAt(t, frontAddr, strings.TrimPrefix(edge.URL, "http://"))
	token := nodeSandbox(t, s, "nod", upstream, strings.TrimPrefix(edge.URL, "http://"), front.Addr)
	w := &nodeWorld{edge: edge, front: front, token: token}
	// The edge learns the records from its watch caches, a moment later.
	testutil.Eventually(t, 30*time.Second, func() error {
		if resp, body := w.do(t, edge.URL, "GET", "/u/nod/hostile", nil, -1); resp == nil || resp.StatusCode != http.StatusOK {
			return fmt.Errorf("the edge does not serve nod yet: %s", body)
		}
		return nil
	})
	return w
}

func (w *nodeWorld) do(t *testing.T, base, method, path string, body io.Reader, size int64) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, base+path, body)
	req.Header.Set("Authorization", "Bearer "+w.token)
	if size >= 0 {
		req.ContentLength = size
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// pattern is size bytes of a seeded pseudo-random stream, and its sha256.
func pattern(seed uint64, size int64) (io.Reader, string) {
	r := rand.New(rand.NewPCG(seed, seed))
	h := sha256.New()
	buf := make([]byte, size)
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	h.Write(buf)
	return bytes.NewReader(buf), hex.EncodeToString(h.Sum(nil))
}

// zeros is an endless body that costs no memory.
type zeros struct{ left int64 }

func (z *zeros) Read(p []byte) (int, error) {
	if z.left <= 0 {
		return 0, io.EOF
	}
	n := min(int64(len(p)), z.left)
	clear(p[:n])
	z.left -= n
	return int(n), nil
}

// Node answers an upload before reading it (201 at once on a 64 MiB PUT)
// while the browser is still sending: the edge must neither crash (the
// transport reading a recycled body stream) nor let the unread rest of one
// body reach the next request. Fifty times, interleaved with uploads whose
// checksum Node reports, directly and through the pooling front.
//
// The client may miss an early answer: when the rest of its body does not
// arrive within the drain's 3 s, the edge closes the connection, and the
// kernel's reset can overtake the answer. Such misses must be connection
// errors, few (at most a fifth), and never hide a wrong answer: the edge
// counts a 2xx for every request sent.
func TestNodeAnswersUploadsEarly(t *testing.T) {
	w := newNodeWorld(t)
	const early = 50
	answered := func() float64 { return metric(t, w.edge.Proc, `aaas_edge_requests_total{class="2xx"}`) }
	for _, base := range []string{w.edge.URL, w.front.URL()} {
		before, sent, missed := answered(), 0, 0
		for i := range early {
			resp, body := w.do(t, base, "PUT", "/u/nod/early", &zeros{64 << 20}, 64<<20)
			sent++
			switch {
			case resp == nil:
				missed++
				if !strings.Contains(string(body), "connection reset") && !strings.Contains(string(body), "broken pipe") && !strings.Contains(string(body), "EOF") {
					t.Fatalf("early answer %d via %s: %s, want a 201 or a connection closed under the upload", i, base, body)
				}
			case resp.StatusCode != http.StatusCreated:
				t.Fatalf("early answer %d via %s: %d %s\n%s", i, base, resp.StatusCode, body, w.edge.Logs())
			}
			if i%10 == 0 {
				data, sum := pattern(uint64(i), 1<<20+int64(i))
				resp, body := w.do(t, base, "PUT", "/u/nod/upload", data, 1<<20+int64(i))
				if resp == nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("upload after early answers via %s: %v %s", base, resp, body)
				}
				var got struct {
					Bytes  int64
					Sha256 string
				}
				_ = json.Unmarshal(body, &got)
				if got.Bytes != 1<<20+int64(i) || got.Sha256 != sum {
					t.Fatalf("upload via %s arrived as %d bytes %s, sent %d bytes %s: another body's bytes reached it", base, got.Bytes, got.Sha256, 1<<20+i, sum)
				}
				sent++
			}
		}
		t.Logf("via %s: %d of %d early answers missed by the client", base, missed, early)
		if missed > early/5 {
			t.Errorf("via %s: %d of %d early answers missed by the client, want at most %d", base, missed, early, early/5)
		}
		testutil.Eventually(t, 10*time.Second, func() error {
			if n := answered() - before; n != float64(sent) {
				return fmt.Errorf("via %s: the edge answered %v of %d requests with a 2xx", base, n, sent)
			}
			return nil
		})
		if w.edge.Exited() {
			t.Fatalf("the edge died:\n%s", w.edge.Logs())
		}
	}
	if strings.Contains(w.edge.Logs(), "panic") || strings.Contains(w.edge.Logs(), "DATA RACE") {
		t.Fatalf("edge:\n%s", w.edge.Logs())
	}
}

// Node's own behaviour through the edge: it answers Expect: 100-continue
// by itself, streams with chunked encoding, and speaks WebSocket through
// the ws module.
func TestNodeStreamsAndWebSocketsThroughTheFront(t *testing.T) {
	w := newNodeWorld(t)
	for _, base := range []string{w.edge.URL, w.front.URL()} {
		req, _ := http.NewRequest("GET", base+"/u/nod/stream?count=4&interval=150", nil)
		req.Header.Set("Authorization", "Bearer "+w.token)
		start := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var arrivals []time.Duration
		s := bufio.NewScanner(resp.Body)
		for s.Scan() {
			if strings.HasPrefix(s.Text(), "data:") {
				arrivals = append(arrivals, time.Since(start))
			}
		}
		resp.Body.Close()
		if len(arrivals) != 4 || arrivals[3]-arrivals[0] < 300*time.Millisecond {
			t.Fatalf("stream via %s arrived at %v: not one by one", base, arrivals)
		}

		u, _ := url.Parse(base)
		d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
		ws, _, err := d.Dial("ws://"+u.Host+"/u/nod/ws", http.Header{"Authorization": {"Bearer " + w.token}})
		if err != nil {
			t.Fatalf("websocket via %s: %v", base, err)
		}
		for i := range 3 {
			msg := fmt.Sprintf("hello %d", i)
			_ = ws.WriteMessage(websocket.TextMessage, []byte(msg))
			_ = ws.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, got, err := ws.ReadMessage(); err != nil || string(got) != msg {
				t.Fatalf("echo via %s: %q %v", base, got, err)
			}
		}
		ws.Close()
	}
	// Concurrent uploads share the front's pooled connections.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			data, sum := pattern(uint64(100+i), 256<<10)
			resp, body := w.do(t, w.front.URL(), "PUT", "/u/nod/upload", data, 256<<10)
			if resp == nil || resp.StatusCode != http.StatusOK || !strings.Contains(string(body), sum) {
				t.Errorf("concurrent upload %d: %v %s", i, resp, body)
			}
		})
	}
	wg.Wait()
}

// A tenant's server answers with headers that would act on the whole
// gateway origin (a root-scoped service worker, wiped site data, HSTS, an
// nginx internal redirect, a cookie) and with redirects out of its prefix:
// none of it reaches the browser as sent, directly or through the front
// (where nginx would obey X-Accel-Redirect).
func TestTenantHeadersCannotActOnTheOrigin(t *testing.T) {
	w := newNodeWorld(t)
	for _, base := range []string{w.edge.URL, w.front.URL()} {
		resp, body := w.do(t, base, "GET", "/u/nod/hostile", nil, -1)
		if resp == nil || resp.StatusCode != http.StatusOK || string(body) != "hostile\n" {
			t.Fatalf("via %s: %v %s", base, resp, body)
		}
		for _, h := range []string{"Set-Cookie", "Service-Worker-Allowed", "Clear-Site-Data", "Strict-Transport-Security", "X-Accel-Redirect", "X-Hop-One", "X-Hop-Two"} {
			if v := resp.Header.Values(h); len(v) != 0 {
				t.Errorf("via %s: %s: %v reached the browser", base, h, v)
			}
		}
		if resp.Header.Get("X-Kept") != "yes" || resp.Header.Get("Refresh") != "0; url=/u/nod/elsewhere" {
			t.Errorf("via %s: X-Kept %q, Refresh %q", base, resp.Header.Get("X-Kept"), resp.Header.Get("Refresh"))
		}
		// Marked public by the tenant, private to this browser on the way
		// out (security review S14).
		if cc := resp.Header.Values("Cache-Control"); len(cc) != 1 || cc[0] != "private, max-age=86400" {
			t.Errorf("via %s: Cache-Control %q, want private, max-age=86400", base, cc)
		}
		if vary := strings.Join(resp.Header.Values("Vary"), ", "); !strings.Contains(vary, "Accept-Encoding") || !strings.Contains(vary, "Cookie") {
			t.Errorf("via %s: Vary %q, want DSH's Accept-Encoding and Cookie", base, vary)
		}

		client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		for _, tc := range []struct {
			redirect, location string
			status             int
		}{
			{"/settings/", "/u/nod/settings/", http.StatusFound},
			{"//evil.example/", "", http.StatusBadGateway},
			{`/\evil.example/`, "", http.StatusBadGateway},
			// Dot segments as browsers read them stay in the prefix
			// (security review S13).
			{"/u/nod/../alice/", "/u/nod/u/alice/", http.StatusFound},
			{"/u/nod/%2E%2e/alice/", "/u/nod/u/alice/", http.StatusFound},
			{`/u/nod/..\alice/`, "/u/nod/u/alice/", http.StatusFound},
			{"../../alice/", "/u/nod/alice/", http.StatusFound},
			{"http://2130706433/u/alice/", "", http.StatusBadGateway},
		} {
			req, _ := http.NewRequest("GET", base+"/u/nod/hostile?redirect="+url.QueryEscape(tc.redirect), nil)
			req.Header.Set("Authorization", "Bearer "+w.token)
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.status || resp.Header.Get("Location") != tc.location {
				t.Errorf("via %s, redirect %q: %d Location %q, want %d %q", base, tc.redirect, resp.StatusCode, resp.Header.Get("Location"), tc.status, tc.location)
			}
		}
	}
}
