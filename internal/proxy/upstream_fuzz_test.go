package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// FuzzUpstreamFraming drives the upstream client (exchange, frame, the
// body readers, Close) against bytes a hostile DSH serves on a net.Pipe,
// and holds it to net/http's response reader read the way net/http's
// Transport does (1xx answers skipped, 101 refused), as the strict
// oracle:
//   - what net/http refuses, the client refuses too (the exchange or the
//     body read fails): no response a strict parser rejects reaches the
//     browser;
//   - what net/http accepts, the client reads the same (or refuses as
//     malformed what RFC 9112 does not allow and net/http lets pass): status, body bytes,
//     and the same end of the message on the connection, never a byte of
//     what follows (the next response on a pooled connection), never short
//     of it;
//   - a connection goes back to the pool only after such an exchange, and
//     never when the body ran until the connection closed.
//
// mode picks the request: bit 0 HEAD (else GET), bit 1 a request body
// (POST with Expect: 100-continue), bit 2 that body chunked.
func FuzzUpstreamFraming(f *testing.F) {
	for _, s := range upstreamSeeds {
		for _, mode := range []byte{0, 1, 2, 6} {
			f.Add(mode, []byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, mode byte, script []byte) {
		o := fuzzRequest(mode)
		want := strictRead(script, o)
		got := clientRead(t, script, o)
		switch {
		case want.err != nil && got.err == nil:
			t.Fatalf("accepted what net/http refuses (%v): status %d, body %q, ended at %d of %d", want.err, got.status, got.body, got.end, len(script))
		case want.err != nil:
			if got.pooled {
				t.Fatalf("pooled the connection after a refused exchange (%v)", got.err)
			}
		case got.err != nil && !stricter(got.err):
			t.Fatalf("refused what net/http reads (status %d, body %q): %v", want.status, want.body, got.err)
		case got.err != nil:
			// Refused as malformed (checkHead): stricter than net/http.
		case got.status != want.status:
			t.Fatalf("status %d, net/http reads %d", got.status, want.status)
		case !bytes.Equal(got.body, want.body):
			t.Fatalf("body %q, net/http reads %q", got.body, want.body)
		case got.end != want.end:
			t.Fatalf("the message ended at byte %d, net/http ends it at %d (of %d)", got.end, want.end, len(script))
		case got.pooled && want.untilClose:
			t.Fatal("pooled a connection whose body ran until it closed")
		case got.pooled && want.close:
			t.Fatal("pooled a connection DSH said it would close")
		}
	})
}

// stricter: the client refused the answer as malformed.
func stricter(err error) bool {
	var stale *staleError
	if errors.As(err, &stale) {
		err = stale.err
	}
	var malformed *malformedError
	return errors.As(err, &malformed)
}

// upstreamSeeds are answers of every framing, well-formed and not.
var upstreamSeeds = []string{
	"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext",
	"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello",
	"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
	"HTTP/1.1 200 OK\r\n\r\nuntil the connection closes",
	"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1;q=\"a b\"\r\nhello\r\n0;last\r\nTrailer-A: 1\r\nTrailer-B: 2\r\n\r\nHTTP/1.1 200 OK\r\n",
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\nx\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n1\r\na\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc",
	"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc",
	"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nabc",
	"HTTP/1.1 200 OK\r\n Content-Length: 3\r\n\r\nabc",
	"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc",
	"HTTP/1.1 200 OK\r\nContent-Length: 3\r\r\n\r\nabc",
	"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
	"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
	"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
	"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: CHUNKED\r\n\r\n1\r\na\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
	"HTTP/1.1 999 Whatever\r\nContent-Length: 1\r\n\r\nx",
	"HTTP/1.1 200\r\nContent-Length: 1\r\n\r\nx",
	"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
	"",
	"HTTP/1.1 200 OK\r\n",
}

// fuzzRequest is the request mode describes (see FuzzUpstreamFraming).
func fuzzRequest(mode byte) *outgoing {
	o := &outgoing{method: "GET", uri: []byte("/"), header: []byte("Host: dsh\r\n")}
	switch {
	case mode&2 != 0:
		o.method = "POST"
		size := int64(4)
		if mode&4 != 0 {
			size = -1
		}
		o.body = &bodyReader{r: bytes.NewReader([]byte("body")), conn: deadlineConn{}, read: time.Second, max: 1 << 20, size: size}
	case mode&1 != 0:
		o.method, o.head = "HEAD", true
	}
	return o
}

// deadlineConn is the browser's side of a request body that is already
// all there: only its deadlines are asked for.
type deadlineConn struct{ net.Conn }

func (deadlineConn) SetReadDeadline(time.Time) error { return nil }

// framedRead is one reading of a scripted answer: the final status, the
// body, and the offset in the script where the message ended.
type framedRead struct {
	err        error
	status     int
	body       []byte
	end        int
	untilClose bool // the body ran until the connection closed
	close      bool // DSH said it closes the connection after this answer
	pooled     bool // the client kept the connection for another request
}

// strictRead reads the script with net/http, as its Transport does:
// interim answers skipped, 101 refused on a request that asked no upgrade.
func strictRead(script []byte, o *outgoing) framedRead {
	r := bytes.NewReader(script)
	br := bufio.NewReader(r)
	req := &http.Request{Method: o.method}
	for {
		resp, err := http.ReadResponse(br, req)
		if err != nil {
			return framedRead{err: err}
		}
		switch {
		case resp.StatusCode == http.StatusSwitchingProtocols:
			return framedRead{err: errSwitched}
		case resp.StatusCode >= 100 && resp.StatusCode < 200:
			continue
		}
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return framedRead{err: err}
		}
		// A HEAD, 204 or 304 answer has no body, whatever its header says.
		bodiless := o.head || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified
		untilClose := !bodiless && resp.ContentLength < 0 && len(resp.TransferEncoding) == 0
		return framedRead{status: resp.StatusCode, body: body, end: len(script) - r.Len() - br.Buffered(), untilClose: untilClose, close: resp.Close}
	}
}

// countingConn counts the bytes read from the connection.
type countingConn struct {
	net.Conn
	n atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// clientRead has the upstream client send o to a DSH that answers with
// the script and then closes, and reads the answer as the proxy does.
func clientRead(t *testing.T, script []byte, o *outgoing) framedRead {
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	go func() { _, _ = io.Copy(io.Discard, server) }() // the request
	go func() {
		if _, err := server.Write(script); err == nil {
			_ = server.Close()
		}
	}()
	counted := &countingConn{Conn: client}
	conn := newUpConn(counted, "dsh")
	u := newUpstream()
	defer u.CloseIdle()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, err := u.exchange(ctx, conn, o)
	if err != nil {
		return framedRead{err: err}
	}
	got := framedRead{status: a.Header.StatusCode(), untilClose: a.Size < 0 && a.Body == io.Reader(conn.br)}
	if a.Body != nil {
		got.body, got.err = io.ReadAll(a.Body)
	}
	got.end = int(counted.n.Load()) - conn.br.Buffered()
	if err := a.Close(); err != nil && got.err == nil && !errors.Is(err, net.ErrClosed) {
		got.err = fmt.Errorf("close: %w", err)
	}
	u.mu.Lock()
	got.pooled = len(u.idle["dsh"]) > 0
	u.mu.Unlock()
	if ctx.Err() != nil {
		t.Fatalf("the exchange hung (script %q)", script)
	}
	return got
}
