package proxy_test

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
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
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("hal", "")
	expect(t, c.Do("GET", "/u/hal/api/files", nil), http.StatusOK, "the edge's own host")
	// Handshakes as the audit stream has them, once lifecycle has settled
	// every command asked for.
	handshakes := func() int { return handshakesOf(t, w, "hal") }
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
	// The download holds the user's only slot once it is in flight.
	testutil.Eventually(t, 30*time.Second, func() error {
		if n := metric(t, edge.Proc, "aaas_edge_in_flight"); n != 1 {
			return fmt.Errorf("%v requests in flight, want the stalled download", n)
		}
		return nil
	})
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

// trickle is a request body of n chunks of size bytes, one every gap.
type trickle struct {
	n, size int
	gap     time.Duration
	sent    int
}

func (r *trickle) Read(p []byte) (int, error) {
	if r.sent >= r.n {
		return 0, io.EOF
	}
	if r.sent > 0 {
		time.Sleep(r.gap)
	}
	r.sent++
	return copy(p[:min(len(p), r.size)], strings.Repeat("x", r.size)), nil
}

// HTTP_READ_TIMEOUT drops a client that sends its request headers too
// slowly (slowloris, however steadily it trickles) or stops in the middle
// of a body, and nothing it sent takes effect; meanwhile everyone else is
// served, and a body whose chunks keep coming within the timeout is never
// cut, however long it takes in all.
func TestReadTimeoutDropsSlowClientsOnly(t *testing.T) {
	const timeout = 2 * time.Second
	w := newStack(t, nil)
	edge := w.Edge("edge-a", map[string]string{"HTTP_READ_TIMEOUT": timeout.String()})
	host := strings.TrimPrefix(edge.URL, "http://")
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("sid", "")
	auth := "Bearer " + token
	expect(t, c.Do("GET", "/u/sid/api/files", nil, "Authorization", auth), http.StatusOK, "warm-up (handshake)")

	// Slow clients: ten header trickles and one body that stops halfway.
	type dropped struct {
		name  string
		after time.Duration
		err   error
	}
	results := make(chan dropped, 11)
	slow := func(name string, start string, trickle string) {
		// The edge's clock starts when it accepts the connection.
		began := time.Now()
		conn, err := net.Dial("tcp", host)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		go func() {
			_, _ = io.WriteString(conn, start)
			go func() {
				for i := 0; i < len(trickle); i++ {
					if _, err := conn.Write([]byte{trickle[i]}); err != nil {
						return
					}
					time.Sleep(timeout / 4)
				}
			}()
			// A hang guard: the edge must end it long before.
			_ = conn.SetReadDeadline(time.Now().Add(time.Minute))
			_, err := io.Copy(io.Discard, conn)
			results <- dropped{name, time.Since(began), err}
		}()
	}
	for i := range 10 {
		slow(fmt.Sprintf("header trickle %d", i), "GET /u/sid/api/files HTTP/1.1\r\nHost: "+host+"\r\n",
			"Authorization: "+auth+"\r\nX-Padding: "+strings.Repeat("p", 200)+"\r\n\r\n")
	}
	slow("body stopped halfway", "PUT /u/sid/api/files/halfway.bin HTTP/1.1\r\nHost: "+host+"\r\nAuthorization: "+auth+
		"\r\nContent-Length: 1048576\r\n\r\n"+strings.Repeat("x", 512<<10), "")

	// Meanwhile another client is served throughout, and a body that
	// takes three timeouts in all, a chunk every half of one, arrives whole.
	other := testenv.NewClient(t, edge.URL)
	served := 0
	long := &trickle{n: 13, size: 4096, gap: timeout / 2}
	upload := make(chan *testenv.Response, 1)
	go func() { upload <- c.Do("PUT", "/u/sid/api/files/steady.bin", long, "Authorization", auth) }()
	var got []dropped
	for len(got) < 11 {
		select {
		case d := <-results:
			got = append(got, d)
		default:
			expect(t, other.Do("GET", "/u/sid/api/files", nil, "Authorization", auth), http.StatusOK, "another client during the slow ones")
			served++
		}
	}
	for _, d := range got {
		var ne net.Error
		if errors.As(d.err, &ne) && ne.Timeout() {
			t.Errorf("%s: still connected after a minute", d.name)
		}
		if d.after < timeout-100*time.Millisecond {
			t.Errorf("%s: dropped after %s, before HTTP_READ_TIMEOUT (%s)", d.name, d.after, timeout)
		}
	}
	if r := <-upload; r.StatusCode != http.StatusCreated {
		t.Fatalf("a steady body of %d chunks %s apart: %d %s", long.n, long.gap, r.StatusCode, r.Body)
	}
	files := string(c.Do("GET", "/u/sid/api/files", nil, "Authorization", auth).Body)
	if strings.Contains(files, "halfway") || !strings.Contains(files, "steady.bin") {
		t.Fatalf("files after the slow clients: %s", files)
	}
	t.Logf("11 slow clients dropped after %s-%s (HTTP_READ_TIMEOUT %s); %d requests of another client served meanwhile",
		slices.MinFunc(got, func(a, b dropped) int { return cmp.Compare(a.after, b.after) }).after.Round(time.Millisecond),
		slices.MaxFunc(got, func(a, b dropped) int { return cmp.Compare(a.after, b.after) }).after.Round(time.Millisecond), timeout, served)
	if served == 0 {
		t.Fatal("no other request was served while the slow clients were connected")
	}
}

// UPSTREAM_HEADER_ALLOWLIST end to end: with it set, only the listed
// browser headers reach DSH (the denylist still holds for them, and the
// edge's own Host, Cookie and X-Forwarded-* are set as always); without
// it, the same request's other headers arrive (the control).
func TestHeaderAllowlistEndToEnd(t *testing.T) {
	w := newStack(t, nil)
	narrow := w.Edge("edge-narrow", map[string]string{"UPSTREAM_HEADER_ALLOWLIST": "Accept,X-Custom,Content-Type,X-Forwarded-User,Cookie"})
	wide := w.Edge("edge-wide", nil)
	c := testenv.NewClient(t, narrow.URL)
	token := c.Signup("amy", "")
	send := []string{"Authorization", "Bearer " + token, "Accept", "application/json", "X-Custom", "kept", "X-Other", "dropped",
		"User-Agent", "test-agent", "X-Forwarded-User", "mallory", "Content-Type", "text/plain"}
	received := func(e *testenv.Edge) map[string][]string {
		r := testenv.NewClient(t, e.URL).Do("POST", "/u/amy/api/echo", strings.NewReader("body"), send...)
		expect(t, r, http.StatusOK, "echo via "+e.URL)
		return decodeEcho(t, r).Headers
	}
	got := received(narrow)
	for _, h := range []string{"Accept", "X-Custom", "Content-Type"} {
		if len(got[h]) != 1 {
			t.Errorf("allowlist: %s did not reach DSH: %v", h, got)
		}
	}
	for _, h := range []string{"X-Other", "User-Agent", "X-Forwarded-User", "Authorization"} {
		if v, ok := got[h]; ok {
			t.Errorf("allowlist: %s reached DSH: %v", h, v)
		}
	}
	if ck := strings.Join(got["Cookie"], ";"); !strings.Contains(ck, "dsh-auth-") || strings.Count(ck, "=") != 1 {
		t.Errorf("allowlist: DSH got Cookie %q, want its own auth cookie alone", ck)
	}
	for _, h := range []string{"X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host", "X-Forwarded-Prefix"} {
		if len(got[h]) != 1 {
			t.Errorf("allowlist: the edge's own %s missing: %v", h, got[h])
		}
	}
	for h, v := range got {
		switch h {
		// Content-Length frames the body the edge sends; Expect:
		// 100-continue is the edge's own on every body, so that DSH's 401
		// leaves the body unsent for the retry.
		case "Accept", "X-Custom", "Content-Type", "Cookie", "Content-Length", "Expect", "X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host", "X-Forwarded-Prefix":
		default:
			t.Errorf("allowlist: DSH got %s: %v", h, v)
		}
	}
	control := received(wide)
	for _, h := range []string{"X-Other", "User-Agent"} {
		if len(control[h]) != 1 {
			t.Errorf("without the allowlist %s should reach DSH: %v", h, control)
		}
	}
	if _, ok := control["X-Forwarded-User"]; ok {
		t.Error("without the allowlist X-Forwarded-User still must not reach DSH")
	}
}
