package broker

import (
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// An event stream (a streamed completion) is answered on the client's
// connection itself, taken from net/http (detach): an agent's stream can
// sit for minutes between tokens, and net/http keeps, for each connection
// it serves, two goroutines and 10 KiB of buffers (read, write and
// chunking) that a waiting stream does not need. Detached, a stream holds
// its relay goroutine, a goroutine that notices the client leaving, and
// 1 KiB; the connection closes when the stream ends. Everything else — a
// whole answer, an error, a client on HTTP/2 — is answered through
// net/http as before.

// detach answers resp, an event stream, on r's connection from a
// goroutine of its own and reports true; false (nothing done) when the
// connection cannot be taken or the broker is shutting down. ctx and
// cancel are the call's; stop ends net/http's watch of the client, which
// the stream's own watch replaces.
func (s *Server) detach(w http.ResponseWriter, r *http.Request, c *admitted, resp *http.Response, ctx context.Context, cancel context.CancelFunc, stop func() bool, start time.Time) bool {
	if r.Method == http.MethodHead || r.ProtoMajor != 1 {
		return false
	}
	id, ok := s.streams.add(cancel)
	if !ok {
		return false
	}
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		s.streams.done(id)
		return false
	}
	// From here net/http neither reads the connection nor cancels r's
	// context until the handler returns, and that must not end the call.
	// Whatever the client sent after its request (a pipelined request) is
	// never read: the connection closes after the stream.
	stop()
	go s.stream(conn, r.ProtoAtLeast(1, 1), resp, c, ctx, cancel, start, id)
	return true
}

// stream relays resp to the client on conn, meters and records the call,
// and closes conn. On HTTP/1.1 the body is chunked (a stream that broke
// off ends without the last chunk, so the client sees it broken); on
// HTTP/1.0 it ends with the connection, as net/http would answer.
func (s *Server) stream(conn net.Conn, chunked bool, resp *http.Response, c *admitted, ctx context.Context, cancel context.CancelFunc, start time.Time, id int) {
	defer s.streams.done(id)
	defer cancel()
	defer conn.Close()
	defer resp.Body.Close()
	// The call ending (its timeout, the client leaving, a shutdown that
	// ran out of time) unblocks a write to a client that stopped reading.
	defer context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })()
	go watch(conn, cancel)
	m := newMeter(c.p.API, true)
	clientGone, err := true, error(nil)
	if _, werr := conn.Write(head(resp, chunked)); werr == nil {
		clientGone, err = s.relay(framed{conn: conn, chunked: chunked}, resp.Body, m, c.p.Name, start)
	}
	s.metered(c, m, resp.StatusCode)
	// Recorded before the client sees the end, as net/http's path does.
	s.end(c, start)
	if !clientGone && err == io.EOF && chunked {
		_, _ = io.WriteString(conn, "0\r\n\r\n")
	}
}

// watch reads the client's side of a detached stream until it ends: the
// client closing it (or anything else ending the read) ends the call.
// Bytes a client sends after its request are read and dropped.
func watch(conn net.Conn, gone context.CancelFunc) {
	var b [64]byte
	for {
		if _, err := conn.Read(b[:]); err != nil {
			gone()
			return
		}
	}
}

// head is the answer's status line and headers: the provider's status,
// the headers a client may see of its answer, and the framing.
func head(resp *http.Response, chunked bool) []byte {
	b := []byte("HTTP/1.0 ")
	if chunked {
		b = []byte("HTTP/1.1 ")
	}
	b = strconv.AppendInt(b, int64(resp.StatusCode), 10)
	b = append(b, ' ')
	b = append(b, http.StatusText(resp.StatusCode)...)
	b = append(b, "\r\n"...)
	h := http.Header{}
	relayHeaders(h, resp.Header)
	h.Set("Date", time.Now().UTC().Format(http.TimeFormat))
	h.Set("Connection", "close")
	if chunked {
		h.Set("Transfer-Encoding", "chunked")
	}
	buf := headerBuffer{b}
	// Header.Write drops a value's line breaks: a provider's header cannot
	// add one of its own.
	_ = h.Write(&buf)
	return append(buf.b, "\r\n"...)
}

type headerBuffer struct{ b []byte }

func (h *headerBuffer) Write(p []byte) (int, error) {
	h.b = append(h.b, p...)
	return len(p), nil
}

// framed writes a detached stream's body to its connection, each piece
// as one chunk in one system call, and needs no flush.
type framed struct {
	conn    net.Conn
	chunked bool
}

var crlf = []byte("\r\n")

func (f framed) Write(p []byte) (int, error) {
	if !f.chunked {
		return f.conn.Write(p)
	}
	size := strconv.AppendInt(make([]byte, 0, 18), int64(len(p)), 16)
	bufs := net.Buffers{append(size, crlf...), p, crlf}
	if _, err := bufs.WriteTo(f.conn); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (framed) Flush() error { return nil }

// streams are the detached streams in flight: Serve waits for them on
// shutdown as net/http waits for its own handlers, and ends those still
// running when its time is up.
type streams struct {
	mu       sync.Mutex
	live     map[int]context.CancelFunc
	next     int
	draining bool
	drained  chan struct{}
}

// add counts a stream about to be detached; false once draining.
func (t *streams) add(cancel context.CancelFunc) (int, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.draining {
		return 0, false
	}
	if t.live == nil {
		t.live = map[int]context.CancelFunc{}
	}
	t.next++
	t.live[t.next] = cancel
	return t.next, true
}

func (t *streams) done(id int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.live, id)
	if t.draining && len(t.live) == 0 && t.drained != nil {
		close(t.drained)
		t.drained = nil
	}
}

// drain stops new detaches and waits for the streams in flight; when ctx
// ends first, it ends them (their calls are recorded) and waits for that.
func (t *streams) drain(ctx context.Context) {
	t.mu.Lock()
	t.draining = true
	if len(t.live) == 0 {
		t.mu.Unlock()
		return
	}
	drained := make(chan struct{})
	t.drained = drained
	t.mu.Unlock()
	select {
	case <-drained:
		return
	case <-ctx.Done():
	}
	t.mu.Lock()
	for _, cancel := range t.live {
		cancel()
	}
	t.mu.Unlock()
	<-drained
}
