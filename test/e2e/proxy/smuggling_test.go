package proxy_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/testenv"
)

// smuggled is the second request an attacker hides in a body.
const smuggled = "GET /_/status HTTP/1.1\r\nHost: smuggled.example\r\n\r\n"

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

// Every route that answers without reading the body must not leave the
// body on the connection, where it would be parsed as the next request:
// behind a pooling front that lets an attacker inject requests into other
// clients' connections. One request in, one response out — directly and
// through nginx.
func TestNoRequestHidesInAnUnreadBody(t *testing.T) {
	w := newStack(t, nil)
	w.PublicHosts = append(w.PublicHosts, "edge.example")
	frontAddr := w.FrontAddr()
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	token := c.Signup("sam", "")
	front := testenv.NewFrontAt(t, frontAddr, edge.URL[len("http://"):])

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
	for _, addr := range []struct{ name, addr string }{{"edge", edge.URL[len("http://"):]}, {"nginx front", front.Addr}} {
		for _, r := range routes {
			// The hidden request at the start of the body, and behind more
			// padding than the edge buffers.
			for _, pad := range []int{0, 64 << 10} {
				body := strings.Repeat("x", pad) + smuggled
				if pad > 0 {
					body = smuggled + strings.Repeat("x", pad) + smuggled
				}
				raw := r.head + "Host: edge.example\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", len(body)) + body
				// One answer, then the last request's 200 — unless the edge
				// closed the connection instead of reading the body.
				got := responses(t, addr.addr, raw)
				if len(got) == 0 || len(got) > 2 || len(got) == 2 && got[1] != http.StatusOK {
					t.Errorf("%s, %s, %d bytes: responses %v to two requests: the body was parsed as a request", addr.name, r.name, len(body), got)
				}
			}
		}
	}
	if strings.Contains(edge.Logs(), "smuggled.example") {
		t.Error("the smuggled request reached a handler")
	}
}
