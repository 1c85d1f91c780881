package proxy_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/testenv"
	"github.com/aaas-project/aaas/internal/testutil"
)

// The Host a client sends cannot multiply handshakes (each costs lifecycle
// a pod-log read and a day-long KV entry): the edge serves only its public
// hosts, refusing any other with 421 before anything else happens, and
// names a public host by one canonical form, so its spellings share one
// handshake.
func TestHostsOutsidePublicHostsCostNothing(t *testing.T) {
	w := newStack(t, func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		for i := range c.Env {
			if c.Env[i].Name == "DSH_TRUSTED_HOSTS" {
				c.Env[i] = corev1.EnvVar{Name: "DSH_TRUSTED_HOSTS", Value: "gw.test"}
			}
		}
	})
	w.PublicHosts = append(w.PublicHosts, "gw.test")
	lc := w.Procs[0]
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("hal", "")
	expect(t, c.Do("GET", "/u/hal/api/files", nil), http.StatusOK, "the edge's own host")
	handshakes := func() int {
		last := -1
		for {
			n := strings.Count(lc.Logs(), `"verb":"handshake","user":"hal","outcome":"ok"`)
			if n == last {
				return n
			}
			last = n
			time.Sleep(300 * time.Millisecond)
		}
	}
	before := handshakes()

	get := func(host, path string) (int, string) {
		req, _ := http.NewRequest("GET", edge.URL+path, nil)
		req.Host = host
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Accept", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	port := strings.TrimPrefix(edge.URL, "http://127.0.0.1:")
	for i := range 100 {
		host := fmt.Sprintf("127.0.0.1:%d", 20000+i)
		if host == "127.0.0.1:"+port {
			continue
		}
		if st, body := get(host, "/u/hal/api/files"); st != http.StatusMisdirectedRequest || !strings.Contains(body, host) {
			t.Fatalf("Host %s: %d %s", host, st, body)
		}
	}
	for _, path := range []string{"/", "/_/status", "/u/hal/"} {
		if st, _ := get("evil.example", path); st != http.StatusMisdirectedRequest {
			t.Errorf("%s with Host evil.example: %d", path, st)
		}
	}
	if st, _ := get("evil.example", "/healthz"); st != http.StatusOK {
		t.Errorf("probes use the pod's address: /healthz with another Host answered %d", st)
	}
	if got := handshakes() - before; got != 0 {
		t.Fatalf("100 foreign Host ports caused %d handshakes", got)
	}
	for _, host := range []string{"gw.test", "GW.Test", "gw.test:80", "gw.test."} {
		if st, body := get(host, "/u/hal/api/files"); st != http.StatusOK {
			t.Fatalf("public host spelled %s: %d %s", host, st, body)
		}
	}
	if got := handshakes() - before; got != 1 {
		t.Fatalf("four spellings of one public host caused %d handshakes, want 1", got)
	}
}

// The status stream of the landing page holds one of the user's in-flight
// slots like any proxied request, so a page cannot open unbounded streams.
func TestStatusStreamsCountAgainstTheInFlightCap(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"MAX_IN_FLIGHT_PER_USER": "2"})
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("ida", "")
	open := func() *http.Response {
		req, _ := http.NewRequest("GET", edge.URL+"/_/status/stream", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	a, b := open(), open()
	for _, r := range []*http.Response{a, b} {
		if r.StatusCode != http.StatusOK {
			t.Fatalf("stream within the cap: %d", r.StatusCode)
		}
		if line, _ := bufio.NewReader(r.Body).ReadString('\n'); !strings.HasPrefix(line, "event: state") {
			t.Fatalf("stream: %q", line)
		}
	}
	over := open()
	over.Body.Close()
	if over.StatusCode != http.StatusServiceUnavailable || over.Header.Get("Retry-After") == "" {
		t.Fatalf("third stream: %d", over.StatusCode)
	}
	expect(t, c.Do("GET", "/u/ida/api/files", nil, "Authorization", "Bearer "+token), http.StatusServiceUnavailable, "a request while two streams hold the cap")
	a.Body.Close()
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := c.Do("GET", "/u/ida/api/files", nil, "Authorization", "Bearer "+token); r.StatusCode != http.StatusOK {
			return fmt.Errorf("after a stream closed: %d", r.StatusCode)
		}
		return nil
	})
	b.Body.Close()
}

// HTTP_WRITE_TIMEOUT drops a client that stops reading (its slot comes
// back), but never cuts a stream that keeps flowing or a quiet WebSocket:
// the deadline is renewed for every chunk and every message.
func TestWriteTimeoutDropsStalledReadersOnly(t *testing.T) {
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"HTTP_WRITE_TIMEOUT": "2s", "MAX_IN_FLIGHT_PER_USER": "1"})
	c := testenv.NewClient(t, edge.URL).WithTimeout(5 * time.Minute)
	token := c.Signup("ned", "")
	auth := "Bearer " + token
	expect(t, c.Do("PUT", "/u/ned/api/files/big", &zeros{64 << 20}, "Authorization", auth), http.StatusCreated, "a 64 MiB file")

	// A client that asks for it and never reads.
	conn, err := net.Dial("tcp", strings.TrimPrefix(edge.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	fmt.Fprintf(conn, "GET /u/ned/api/files/big HTTP/1.1\r\nHost: %s\r\nAuthorization: %s\r\n\r\n", strings.TrimPrefix(edge.URL, "http://"), auth)
	time.Sleep(500 * time.Millisecond)
	expect(t, c.Do("GET", "/u/ned/api/files", nil, "Authorization", auth), http.StatusServiceUnavailable, "the stalled download holds the only slot")
	testutil.Eventually(t, 30*time.Second, func() error {
		if r := c.Do("GET", "/u/ned/api/files", nil, "Authorization", auth); r.StatusCode != http.StatusOK {
			return fmt.Errorf("slot still held: %d", r.StatusCode)
		}
		return nil
	})
	// The edge closed that connection: what the client reads now ends
	// well short of 64 MiB.
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	n, _ := io.Copy(io.Discard, conn)
	if n >= 64<<20 {
		t.Fatalf("the stalled client still got the whole file (%d bytes)", n)
	}

	// A stream longer than the write timeout, with gaps shorter than it.
	req, _ := http.NewRequest("GET", edge.URL+"/u/ned/api/events?interval=700&count=6", nil)
	req.Header.Set("Authorization", auth)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	events := 0
	s := bufio.NewScanner(resp.Body)
	for s.Scan() {
		if strings.HasPrefix(s.Text(), "data:") {
			events++
		}
	}
	resp.Body.Close()
	if events != 6 {
		t.Fatalf("a 4 s stream under a 2 s write timeout delivered %d of 6 events", events)
	}

	// A WebSocket quiet for longer than the write timeout still works.
	ws, _, err := wsDial(t, edge.URL+"/u/ned/api/ws", http.Header{"Authorization": {auth}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	for i := range 2 {
		time.Sleep(3 * time.Second)
		msg := fmt.Sprintf("after a quiet spell %d", i)
		if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, got, err := ws.ReadMessage(); err != nil || string(got) != msg {
			t.Fatalf("echo after %d quiet spells: %q %v", i+1, got, err)
		}
	}
}
