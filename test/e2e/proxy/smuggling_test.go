package proxy_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// hidden is the second request an attacker hides in a body: one the edge
// would proxy to sam's sandbox with sam's token, so that were it ever
// parsed, the edge's count of proxied 2xx answers would show it.
func hidden(host, token string) string {
	return "GET /u/sam/api/files HTTP/1.1\r\nHost: " + host + "\r\nAuthorization: Bearer " + token + "\r\n\r\n"
}

// lastRequest follows the attack on the same connection and ends it.
const lastRequest = "GET /healthz HTTP/1.1\r\nHost: edge.example\r\nConnection: close\r\n\r\n"

// responses sends raw on one connection to addr, then a last request that
// closes the connection, and returns the status of every response.
func responses(t *testing.T, addr, raw string) []int {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(raw + lastRequest)); err != nil {
		t.Fatal(err)
	}
	var statuses []int
	r := bufio.NewReader(c)
	for {
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			return statuses
		}
		_, _ = r.Discard(int(max(resp.ContentLength, 0)))
		if resp.ContentLength < 0 {
			// Chunked: read to the end.
			buf := make([]byte, 4096)
			for {
				if _, err := resp.Body.Read(buf); err != nil {
					break
				}
			}
		}
		resp.Body.Close()
		statuses = append(statuses, resp.StatusCode)
	}
}

// chunk is s as one chunk of a chunked body.
func chunk(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) }

// Every route that answers without reading the body must not leave the
// body on the connection, where it would be parsed as the next request:
// behind a pooling front that lets an attacker inject requests into other
// clients' connections. One request in, one response out, for bodies
// framed by Content-Length, by chunks, and by both at once (each reading
// of which ends the body elsewhere) — directly and through nginx. The
// hidden request would be a proxied one: the edge's count of proxied 2xx
// answers must not move, while one real request in the same window moves
// it by one (the control).
func TestNoRequestHidesInAnUnreadBody(t *testing.T) {
	w := newStack(t, nil)
	w.PublicHosts = append(w.PublicHosts, "edge.example")
	frontAddr := w.FrontAddr()
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("sam", "")
	front := testenv.NewFrontAt(t, frontAddr, edge.URL[len("http://"):])
	expect(t, c.Do("GET", "/u/sam/api/files", nil, "Authorization", "Bearer "+token), http.StatusOK, "warm-up (handshake)")
	smuggled := hidden("edge.example", token)

	routes := []struct{ name, head string }{
		{"landing page", "GET / HTTP/1.1\r\n"},
		{"logout", "POST /logout HTTP/1.1\r\nOrigin: http://edge.example\r\n"},
		{"login with a token", "POST /login HTTP/1.1\r\nAuthorization: Bearer " + token + "\r\n"},
		{"sandbox redirect", "GET /u/sam HTTP/1.1\r\n"},
		{"health", "GET /healthz HTTP/1.1\r\n"},
		{"status", "GET /_/status HTTP/1.1\r\nAuthorization: Bearer " + token + "\r\n"},
		{"unknown route", "GET /nope HTTP/1.1\r\n"},
		{"refused signup", "POST /users HTTP/1.1\r\nContent-Type: text/plain\r\n"},
		{"proxy, not signed in", "POST /u/sam/api/chat HTTP/1.1\r\n"},
	}
	// The hidden request at the start of the body, and behind more
	// padding than the edge buffers.
	pad := strings.Repeat("x", 64<<10)
	bodies := []struct{ name, framing, body string }{
		{"length", "", smuggled},
		{"length, padded", "", smuggled + pad + smuggled},
		{"chunked", "Transfer-Encoding: chunked\r\n", chunk(smuggled) + "0\r\n\r\n"},
		{"chunked, padded", "Transfer-Encoding: chunked\r\n", chunk(pad) + chunk(smuggled) + "0\r\n\r\n"},
		// CL.TE: by its length the hidden request is body; by its chunks
		// it follows the body.
		{"length covering what follows the last chunk", "Transfer-Encoding: chunked\r\nContent-Length: " + fmt.Sprint(len("0\r\n\r\n"+smuggled)) + "\r\n",
			"0\r\n\r\n" + smuggled},
		// TE.CL: by its length the body ends inside the first chunk.
		{"length ending inside the first chunk", "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", chunk(smuggled) + "0\r\n\r\n"},
	}
	proxied := func() float64 { return metric(t, edge.Proc, `aaas_edge_requests_total{class="2xx"}`) }
	before := proxied()
	for _, addr := range []struct{ name, addr string }{{"edge", edge.URL[len("http://"):]}, {"nginx front", front.Addr}} {
		for _, r := range routes {
			for _, b := range bodies {
				framing := b.framing
				if framing == "" {
					framing = fmt.Sprintf("Content-Length: %d\r\n", len(b.body))
				}
				raw := r.head + "Host: edge.example\r\n" + framing + "\r\n" + b.body
				// One answer, then the last request's 200 — unless the
				// edge (or the front) closed the connection instead of
				// reading on.
				got := responses(t, addr.addr, raw)
				if len(got) == 0 || len(got) > 2 || len(got) == 2 && got[1] != http.StatusOK {
					t.Errorf("%s, %s, %s body: responses %v to two requests: the body was parsed as a request", addr.name, r.name, b.name, got)
				}
			}
		}
	}
	expect(t, c.Do("GET", "/u/sam/api/files", nil, "Authorization", "Bearer "+token), http.StatusOK, "the control request")
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := proxied() - before; n != 1 {
			return fmt.Errorf("%v proxied answers since the attacks began, want the control's 1", n)
		}
		return nil
	})
}
