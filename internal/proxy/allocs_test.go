package proxy

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"testing"

	"github.com/aaas-project/aaas/internal/state"
)

// cannedBody is what the canned upstream answers, 1 KiB as in `make bench`.
var cannedBody = bytes.Repeat([]byte("x"), 1<<10)

// serveCanned is an upstream that allocates nothing per request: it reads
// each request's head into a fixed buffer and writes one fixed answer, so
// that the allocations counted around the edge are the edge's own. It
// answers only GETs without bodies, which is all the benchmark sends.
func serveCanned(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close() })
	answer := append([]byte("HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "+strconv.Itoa(len(cannedBody))+"\r\n\r\n"), cannedBody...)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				buf := make([]byte, 16<<10)
				for {
					if _, _, err := readMessageHead(conn, buf); err != nil {
						return
					}
					if _, err := conn.Write(answer); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// readMessageHead reads from conn into buf until a blank line ends a
// message's head and returns the bytes read and where the head ends (its
// blank line included); what follows is the body's start, as neither side
// here pipelines.
func readMessageHead(conn net.Conn, buf []byte) (n, end int, err error) {
	for {
		if n == len(buf) {
			return 0, 0, fmt.Errorf("head over %d bytes", len(buf))
		}
		k, err := conn.Read(buf[n:])
		if err != nil {
			return 0, 0, err
		}
		n += k
		if i := bytes.Index(buf[:n], []byte("\r\n\r\n")); i >= 0 {
			return n, i + 4, nil
		}
	}
}

// rawClient sends one fixed request over one kept-alive connection and
// reads the answer into fixed buffers: it allocates nothing per request.
type rawClient struct {
	conn net.Conn
	req  []byte
	buf  []byte
}

func newRawClient(tb testing.TB, addr, path string) *rawClient {
	tb.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	return &rawClient{conn: conn, buf: make([]byte, 64<<10),
		req: []byte("GET " + path + " HTTP/1.1\r\nHost: " + addr + "\r\nAuthorization: " + fixtureToken + "\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n")}
}

var (
	status200     = []byte("HTTP/1.1 200 ")
	contentLength = []byte("\r\nContent-Length: ")
)

// do sends the request and reads the answer, which must be a 200 with a
// Content-Length of the canned body's length.
func (c *rawClient) do() error {
	if _, err := c.conn.Write(c.req); err != nil {
		return err
	}
	n, end, err := readMessageHead(c.conn, c.buf)
	if err != nil {
		return err
	}
	head := c.buf[:end-4]
	if !bytes.HasPrefix(head, status200) {
		return fmt.Errorf("answered %.200q", head)
	}
	i := bytes.Index(head, contentLength)
	if i < 0 {
		return fmt.Errorf("no Content-Length in %q", head)
	}
	size := 0
	for _, b := range head[i+len(contentLength):] {
		if b < '0' || b > '9' {
			break
		}
		size = size*10 + int(b-'0')
	}
	if size != len(cannedBody) {
		return fmt.Errorf("Content-Length %d", size)
	}
	have := n - end
	if have < size {
		if _, err := io.ReadFull(c.conn, c.buf[n:n+size-have]); err != nil {
			return err
		}
	}
	return nil
}

// cachedPath is the fixture serving the cached path (Ready sandbox,
// handshake cached) from the canned upstream, and a raw client on it; the
// edge logs as production does (JSON) at level, so the access log is on
// at info and off at warn.
func cachedPath(tb testing.TB, level slog.Level) *rawClient {
	f := newFixture(tb, payload, func(o *Options) {
		o.Log = slog.New(slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: level}))
	})
	f.putBox(state.Sandbox{User: fixtureUser, Phase: state.PhaseReady, PodUID: fixturePod, Address: serveCanned(tb)})
	c := newRawClient(tb, f.url[len("http://"):], "/u/bob/bytes")
	for range 100 { // connections opened, pools filled
		if err := c.do(); err != nil {
			tb.Fatal(err)
		}
	}
	return c
}

// accessLog are the two ways the edge runs: the access log on (info, the
// default) and off (warn, as `make bench` runs it). With it on, the line's
// request id is a string of its own: the one allocation allowed.
var accessLog = []struct {
	name      string
	level     slog.Level
	maxAllocs float64
}{{"access-log", slog.LevelInfo, 1}, {"no-access-log", slog.LevelWarn, 0}}

// BenchmarkCachedPath is one request at a time on the cached path, with
// a client and an upstream that allocate nothing: allocs/op is the edge's
// (the fasthttp server, the middleware every route shares, the proxy and
// its HTTP/1.1 client), plus the idle NATS server's background work.
func BenchmarkCachedPath(b *testing.B) {
	for _, l := range accessLog {
		b.Run(l.name, func(b *testing.B) {
			c := cachedPath(b, l.level)
			b.ReportAllocs()
			b.SetBytes(int64(len(cannedBody)))
			for b.Loop() {
				if err := c.do(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestCachedPathAllocations asserts the cached path's allocation count
// per request: none, or the access line's request id. testing.AllocsPerRun
// counts the whole process and rounds down, so the NATS server's
// occasional background allocation (under one per request) does not
// count, and one allocation per request does.
func TestCachedPathAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector changes what allocates: make test runs this without it")
	}
	for _, l := range accessLog {
		t.Run(l.name, func(t *testing.T) {
			c := cachedPath(t, l.level)
			var failed error
			per := testing.AllocsPerRun(2000, func() {
				if err := c.do(); err != nil && failed == nil {
					failed = err
				}
			})
			if failed != nil {
				t.Fatal(failed)
			}
			t.Logf("%v allocations per request", per)
			if per > l.maxAllocs {
				t.Errorf("the cached path allocates %v times per request, want at most %v", per, l.maxAllocs)
			}
		})
	}
}
