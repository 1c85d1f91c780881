package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/valyala/fasthttp"
)

// FuzzSplitUserPath takes a request target through fasthttp's request
// parser and the edge's user split (serve: splitUserPath on the raw path,
// then the account-name check), and asks a browser's reading of the same
// path (Node's WHATWG URL parser: dot segments, "%2e", backslashes) which
// user's prefix it is under. Whenever the edge takes the request for a
// user, that is the user the path means; and the rest it forwards is the
// raw path after the user's prefix, byte for byte.
func FuzzSplitUserPath(f *testing.F) {
	for _, s := range []string{
		"/u/alice/", "/u/alice", "/u/alice/a/../b", "/u/alice/x?y=1", "/u/alice%2Fbob/x", "/u//alice/", "/x/alice/",
		"/u/alice/./", "/u/Alice/", "/u/al%69ce/", "/u/alice#/../bob", "/u/dsh-x/", "/u/admin/",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, target string) {
		var req fasthttp.Request
		if err := req.Header.Read(bufio.NewReader(strings.NewReader("GET " + target + " HTTP/1.1\r\nHost: " + fuzzHost + "\r\n\r\n"))); err != nil {
			return // the edge answers 400
		}
		raw := string(req.URI().PathOriginal())
		user, rest, ok := splitUserPath(raw)
		if !ok || ident.ValidateUser(user) != nil {
			return // refused: no user's pod gets it
		}
		if "/u/"+user+rest != raw {
			t.Fatalf("%q: user %q and rest %q are not the raw path %q", target, user, rest, raw)
		}
		if !strings.HasPrefix(raw, "/") {
			t.Fatalf("%q: a user from a path %q that is not absolute", target, raw)
		}
		u := resolve(t, "https://"+fuzzHost+"/", "https://"+fuzzHost+raw, false)
		segments := strings.SplitN(u.Pathname, "/", 4)
		if u.None || len(segments) < 3 || segments[1] != "u" || segments[2] != user {
			t.Fatalf("%q: the edge takes it for %q; a browser reads the path %q as %s", target, user, raw, u.Pathname)
		}
	})
}

// A chunked upload the proxy streamed to DSH whole leaves the browser's
// connection open for its next request: ConsumeBody's drain reads the
// body through httpguard.Body, which remembers its end, where another read
// of fasthttp's chunked reader waited for a next chunk until the drain's
// deadline and then closed the connection. (FuzzConsumeBody led here.)
func TestAChunkedUploadKeepsItsConnection(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		_, _ = w.Write(b)
	}), nil)
	host := strings.TrimPrefix(f.url, "http://") // the host the fixture's handshake is for
	c, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	for i := range 2 {
		if _, err := io.WriteString(c, "POST /u/bob/upload HTTP/1.1\r\nHost: "+host+"\r\nAuthorization: "+fixtureToken+
			"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("upload %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || string(body) != "hello" || resp.Close {
			t.Fatalf("upload %d: %d %q, Connection: close %v", i, resp.StatusCode, body, resp.Close)
		}
	}
}
