package httpguard_test

import (
	"bufio"
	"bytes"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
)

// FuzzConsumeBody sends one request with fuzzed framing (its header
// lines: Content-Length, Transfer-Encoding, anything) and a fuzzed body,
// then a request for /after, on one connection to an edge-like server
// (the guards first, StreamRequestBody, the edge's buffer size) whose
// routes answer without reading the body (/skip), read one byte of it
// (/peek) or all of it (/read), and reads the same stream with net/http's
// request reader as the strict framing: the requests the server serves
// are those net/http reads, in order, up to where the server stops, so a
// byte of a body the handler left unread is never
// served as a request of its own (a request smuggled in a body); a request
// whose framing net/http refuses is the last one served; and each stream
// is done with within the drain's time bound.
func FuzzConsumeBody(f *testing.F) {
	hidden := "GET /hidden HTTP/1.1\r\nHost: x\r\n\r\n"
	for _, s := range []struct{ route, framing, body string }{
		{"skip", "Content-Length: 33\r\n", hidden},
		{"peek", "Content-Length: 33\r\n", hidden},
		{"read", "Content-Length: 33\r\n", hidden},
		{"skip", "Transfer-Encoding: chunked\r\n", "21\r\n" + hidden + "\r\n0\r\n\r\n"},
		{"peek", "Transfer-Encoding: chunked\r\n", "21;ext=1\r\n" + hidden + "\r\n0\r\nTrailer: 1\r\n\r\n"},
		{"skip", "Content-Length: 33\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\n" + hidden},
		{"skip", "Content-Length: 5\r\nContent-Length: 33\r\n", hidden},
		{"skip", "Content-Length: 100\r\n", hidden},
		{"skip", "Transfer-Encoding: chunked\r\n", "zz\r\n" + hidden},
		{"skip", "Content-Length: 33\r\nConnection: close\r\n", hidden},
		{"skip", "", hidden},
	} {
		f.Add(s.route, []byte(s.framing), []byte(s.body))
	}
	s := newRecorder(f)
	f.Fuzz(func(t *testing.T, route string, framing, body []byte) {
		if !fieldLines(framing) || strings.ContainsAny(route, " \t\r\n?#%") {
			return // what a strict reader refuses for its syntax, not its framing
		}
		stream := slices.Concat([]byte("POST /"+route+" HTTP/1.1\r\nHost: x\r\n"), framing, []byte("\r\n"), body, []byte("GET /after HTTP/1.1\r\nHost: x\r\n\r\n"))
		want, refused, lenient := strictRequests(stream)
		start := time.Now()
		// Requests for "*" or "0" are served by no route of the edge's.
		got := slices.DeleteFunc(s.serve(t, stream), func(p string) bool { return !strings.HasPrefix(p, "/") })
		if took := time.Since(start); took > 20*time.Second {
			t.Fatalf("the stream took %s (the drain is bounded by 3 s)", took)
		}
		switch {
		case lenient && !slices.Equal(got[:min(len(got), len(want))], want[:min(len(got), len(want))]):
			t.Fatalf("served %q; net/http reads the requests %q (and refuses a chunk size fasthttp reads) in:\n%q", got, want, stream)
		case lenient:
		case refused && len(got) > len(want)+1:
			t.Fatalf("served %q; net/http reads %q and refuses the framing of the next:\n%q", got, want, stream)
		case !refused && len(got) > len(want), !slices.Equal(got[:min(len(got), len(want))], want[:min(len(got), len(want))]):
			t.Fatalf("served %q; net/http reads the requests %q in:\n%q", got, want, stream)
		}
	})
}

// fieldLines: every line of b is a field line, a token, a colon and a
// value of visible characters, spaces and tabs, ending in CRLF.
func fieldLines(b []byte) bool {
	for len(b) > 0 {
		line, rest, ok := bytes.Cut(b, []byte("\r\n"))
		name, value, colon := bytes.Cut(line, []byte(":"))
		if !ok || !colon || len(name) == 0 {
			return false
		}
		for _, c := range name {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0) {
				return false
			}
		}
		for _, c := range value {
			if c < ' ' && c != '\t' || c == 0x7f {
				return false
			}
		}
		b = rest
	}
	return true
}

// strictRequests are the targets of the requests net/http's reader reads in
// stream, until a body fails (a server streaming bodies has
// served the request whose body it then refuses), or it refuses a head's
// framing (refused). lenient: what follows is not judged, as net/http
// refused a request line or header for its syntax, a trailer field's
// syntax (both end the trailer at its first empty line), or a chunk size
// with bytes after the hex digits that fasthttp, the edge's server, reads
// as a chunk extension without the ";" ("2X"): fasthttp's parser, not the
// drain (see issue 21's report).
func strictRequests(stream []byte) (paths []string, refused, lenient bool) {
	br := bufio.NewReader(bytes.NewReader(stream))
	for {
		req, err := http.ReadRequest(br)
		switch {
		case err == io.EOF:
			return paths, false, false
		case err != nil && framingError(err):
			return paths, true, false
		case err != nil:
			// A request line or header net/http refuses and fasthttp may
			// read (a target "0", a method "0"): framed alike, not judged.
			return paths, false, true
		}
		// fiber answers other methods itself (501), before any handler,
		// and no route of the edge's serves other targets: no path to
		// compare.
		if slices.Contains(fiber.DefaultMethods, req.Method) && strings.HasPrefix(req.RequestURI, "/") {
			paths = append(paths, req.RequestURI)
		}
		_, err = io.Copy(io.Discard, req.Body)
		if err != nil && slices.ContainsFunc([]string{"invalid byte in chunk length", "malformed MIME header", "trailer"}, func(e string) bool { return strings.Contains(err.Error(), e) }) { // see lenient
			return paths, false, true
		}
		// A request that asks to close ends nothing here: what a server
		// reads after it starts where net/http would read on.
		if err != nil {
			return paths, false, false
		}
	}
}

// framingError: net/http refused a head for the way it frames the body.
func framingError(err error) bool {
	for _, s := range []string{"Transfer-Encoding", "transfer encoding", "Content-Length", "chunked"} {
		if strings.Contains(err.Error(), s) {
			return true
		}
	}
	return false
}

// recorder is the edge-like server; it records the target (as in the
// request line) of every request a handler ran for, by the client's
// address.
type recorder struct {
	addr   string
	mu     sync.Mutex
	served map[string][]string
}

func newRecorder(t testing.TB) *recorder {
	r := &recorder{served: map[string][]string{}}
	a := fiber.New(fiber.Config{StreamRequestBody: true, DisableStartupMessage: true, DisablePreParseMultipartForm: true,
		ReadBufferSize: 16 << 10, CaseSensitive: true, StrictRouting: true})
	a.Use(httpguard.ConsumeBody, httpguard.Recover(slog.New(slog.DiscardHandler)), httpguard.Methods, func(c *fiber.Ctx) error {
		r.mu.Lock()
		r.served[c.Context().RemoteAddr().String()] = append(r.served[c.Context().RemoteAddr().String()], string(c.Request().Header.RequestURI()))
		r.mu.Unlock()
		return c.Next()
	})
	a.All("/peek", func(c *fiber.Ctx) error {
		if s := httpguard.Body(c); s != nil {
			_, _ = s.Read(make([]byte, 1))
		}
		return c.SendString("peeked")
	})
	a.All("/read", func(c *fiber.Ctx) error {
		if s := httpguard.Body(c); s != nil {
			_, _ = io.Copy(io.Discard, s)
		}
		return c.SendString("read")
	})
	a.All("/*", func(c *fiber.Ctx) error { return c.Redirect("/read", fiber.StatusSeeOther) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = a.Listener(ln) }()
	t.Cleanup(func() { _ = a.Shutdown() })
	r.addr = ln.Addr().String()
	return r
}

// serve writes stream on a fresh connection, ends the sending side, reads
// until the server closes, and returns the targets it served.
func (r *recorder) serve(t *testing.T, stream []byte) []string {
	c, err := net.Dial("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		_, _ = c.Write(stream)
		_ = c.(*net.TCPConn).CloseWrite()
	}()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, _ = io.Copy(io.Discard, c)
	// The handler ran before its answer was written, and the server has
	// closed the connection: what it served is all there.
	r.mu.Lock()
	defer r.mu.Unlock()
	served := r.served[c.LocalAddr().String()]
	delete(r.served, c.LocalAddr().String())
	return served
}

// A chunked body its handler read to the end (as the proxy streams one to
// DSH) leaves the connection to the next request, whether that was sent
// already (pipelined) or only after the answer: the drain does not read
// the stream again, which fasthttp's chunked reader would do past the
// body's end, into the next request's bytes or, with none sent yet,
// until the drain's deadline, and then close the connection.
func TestAChunkedBodyReadToItsEndKeepsItsConnection(t *testing.T) {
	s := newRecorder(t)
	const upload = "POST /read HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
	if got := s.serve(t, []byte(upload+"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")); !slices.Equal(got, []string{"/read", "/after"}) {
		t.Fatalf("pipelined: served %q, want [/read /after]", got)
	}
	c, err := net.Dial("tcp", s.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	for i := range 2 {
		if _, err := io.WriteString(c, upload); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("upload %d: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK || resp.Close {
			t.Fatalf("upload %d: %d, Connection: close %v", i, resp.StatusCode, resp.Close)
		}
	}
}
