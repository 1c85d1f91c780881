package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http/httputil"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
)

// upstream is the proxy's HTTP/1.1 client for DSH pods. It is ours rather
// than net/http's Transport because the hot path wants what a Transport
// cannot give: the request is written and its answer read on the calling
// goroutine (no hand-offs to per-connection reader and writer goroutines,
// which cost more than the proxying itself), and one context per request
// aborts any of it (the connection's deadline moves to the past). It keeps
// what matters from net/http: Expect: 100-continue for bodies, so a
// refused request can be retried with a fresh cookie before any of its
// body is read; bodies sent while the answer is read, so DSH may answer
// early; one retry of a request that found a pooled connection closed;
// and connections reused only after a complete exchange.
type upstream struct {
	dialer      net.Dialer
	maxIdle     int           // per address
	idleTimeout time.Duration // a pooled connection older than this is closed
	continueFor time.Duration // how long to wait for 100 Continue

	mu   sync.Mutex
	idle map[string][]*upConn
}

func newUpstream() *upstream {
	return &upstream{
		dialer:      net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second},
		maxIdle:     256,
		idleTimeout: 60 * time.Second,
		continueFor: time.Second,
		idle:        map[string][]*upConn{},
	}
}

// upConn is one connection to a DSH pod.
type upConn struct {
	net.Conn
	addr string
	br   *bufio.Reader
	bw   *bufio.Writer
	used time.Time

	mu      sync.Mutex // orders abort with deadline changes
	aborted bool
}

var longAgo = time.Unix(1, 0)

// abort ends every read and write on the connection, now and later.
func (c *upConn) abort() {
	c.mu.Lock()
	c.aborted = true
	_ = c.SetDeadline(longAgo)
	c.mu.Unlock()
}

// readDeadline sets the read deadline unless the connection was aborted.
func (c *upConn) readDeadline(t time.Time) {
	c.mu.Lock()
	if !c.aborted {
		_ = c.SetReadDeadline(t)
	}
	c.mu.Unlock()
}

const bufSize = 16 << 10

func (u *upstream) get(ctx context.Context, addr string) (*upConn, bool, error) {
	u.mu.Lock()
	for conns := u.idle[addr]; len(conns) > 0; conns = u.idle[addr] {
		c := conns[len(conns)-1]
		conns[len(conns)-1] = nil
		u.idle[addr] = conns[:len(conns)-1]
		if time.Since(c.used) < u.idleTimeout {
			u.mu.Unlock()
			return c, true, nil
		}
		_ = c.Close()
	}
	u.mu.Unlock()
	conn, err := u.dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, false, err
	}
	return &upConn{Conn: conn, addr: addr, br: bufio.NewReaderSize(conn, bufSize), bw: bufio.NewWriterSize(conn, bufSize)}, false, nil
}

func (u *upstream) put(c *upConn) {
	c.used = time.Now()
	u.mu.Lock()
	if conns := u.idle[c.addr]; len(conns) < u.maxIdle {
		u.idle[c.addr] = append(conns, c)
		u.mu.Unlock()
		return
	}
	u.mu.Unlock()
	_ = c.Close()
}

// closeIdle closes every pooled connection.
func (u *upstream) closeIdle() {
	u.mu.Lock()
	defer u.mu.Unlock()
	for addr, conns := range u.idle {
		for _, c := range conns {
			_ = c.Close()
		}
		delete(u.idle, addr)
	}
}

// outgoing is one request to DSH: the request line's method and URI, the
// header block (each line "Name: value\r\n", Host included), and the body.
type outgoing struct {
	method string
	uri    string
	header []byte
	body   *bodyReader // nil: no body
	head   bool        // a HEAD: the answer has no body whatever it says
}

// answer is DSH's response. Its body is read from the connection; Close
// gives the connection back to the pool when the exchange was complete.
type answer struct {
	Header fasthttp.ResponseHeader
	// Body is nil when the response has none.
	Body io.Reader
	// Size is the body's length, -1 when unknown (chunked or until close).
	Size int64

	u        *upstream
	conn     *upConn
	stop     func() bool // releases the context's abort
	reusable bool
	complete atomic.Bool // the body was read to its end
	sending  chan error  // the body writer's result; nil: no body sent
	length   lengthBody
}

// answers are reused: an answer's parsed header keeps its buffers.
var answers = sync.Pool{New: func() any { return new(answer) }}

var errSwitched = errors.New("DSH switched protocols on a plain request")

// roundTrip sends o to addr and returns the answer's header, with its
// body ready to read. ctx aborts the exchange, body included, until the
// answer is closed.
func (u *upstream) roundTrip(ctx context.Context, addr string, o *outgoing) (*answer, error) {
	for attempt := 0; ; attempt++ {
		conn, reused, err := u.get(ctx, addr)
		if err != nil {
			return nil, err
		}
		a, err := u.exchange(ctx, conn, o)
		if err == nil {
			return a, nil
		}
		_ = conn.Close()
		// A pooled connection the pod had closed fails before any byte of
		// the answer: once, try a fresh one, if no byte of the body left.
		var stale *staleError
		if !errors.As(err, &stale) || !reused || attempt > 0 || ctx.Err() != nil || (o.body != nil && !o.body.untouched()) {
			if errors.As(err, &stale) {
				err = stale.err
			}
			return nil, err
		}
	}
}

// staleError is a failure before the first byte of an answer.
type staleError struct{ err error }

func (e *staleError) Error() string { return e.err.Error() }

func (u *upstream) exchange(ctx context.Context, conn *upConn, o *outgoing) (*answer, error) {
	a := answers.Get().(*answer)
	a.u, a.conn, a.reusable = u, conn, true
	a.stop = context.AfterFunc(ctx, conn.abort)
	fail := func(err error) (*answer, error) {
		a.stop()
		a.release()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	bw := conn.bw
	bw.WriteString(o.method)
	bw.WriteByte(' ')
	bw.WriteString(o.uri)
	bw.WriteString(" HTTP/1.1\r\n")
	bw.Write(o.header)
	if o.body != nil {
		if o.body.size >= 0 {
			bw.WriteString("Content-Length: ")
			bw.WriteString(strconv.FormatInt(o.body.size, 10))
			bw.WriteString("\r\n")
		} else {
			bw.WriteString("Transfer-Encoding: chunked\r\n")
		}
		bw.WriteString("Expect: 100-continue\r\n")
	} else if o.method == "POST" || o.method == "PUT" || o.method == "PATCH" {
		bw.WriteString("Content-Length: 0\r\n")
	}
	bw.WriteString("\r\n")
	if err := bw.Flush(); err != nil {
		return fail(&staleError{err})
	}

	got := false // a final header has been read
	if o.body != nil {
		// DSH says 100 Continue when it wants the body, or answers at once
		// (a refusal: the body stays unread, for a retry); a server that
		// says nothing gets the body after continueFor, as with net/http.
		send := true
		conn.readDeadline(time.Now().Add(u.continueFor))
		_, err := conn.br.Peek(1)
		conn.readDeadline(time.Time{})
		var ne net.Error
		switch {
		case err == nil:
			if err := a.Header.Read(conn.br); err != nil {
				return fail(&staleError{err})
			}
			if a.Header.StatusCode() == fasthttp.StatusContinue {
				a.Header.Reset()
			} else {
				got, send = true, false
				// The body was announced and not sent: the connection's
				// framing is lost.
				a.reusable = false
			}
		case errors.As(err, &ne) && ne.Timeout() && ctx.Err() == nil:
		default:
			return fail(&staleError{err})
		}
		if send {
			a.sending = make(chan error, 1)
			go sendBody(conn, o.body, a.sending)
		}
	}
	for !got {
		if err := a.Header.Read(conn.br); err != nil {
			if a.sending == nil {
				return fail(&staleError{err})
			}
			// The writer must end before the request does; a body that
			// failed (too large, the browser gone) is the cause, not the
			// aborted read it led to.
			conn.abort()
			o.body.detach()
			if serr := <-a.sending; serr != nil && !errors.Is(serr, errDetached) && ctx.Err() == nil {
				err = serr
			}
			a.sending = nil
			return fail(err)
		}
		// Interim answers (100 after the body went, 102, 103) are not
		// passed on: fasthttp writes one response per request.
		switch code := a.Header.StatusCode(); {
		case code == fasthttp.StatusSwitchingProtocols:
			return fail(errSwitched)
		case code >= 200:
			got = true
		default:
			a.Header.Reset()
		}
	}
	if a.Header.ConnectionClose() {
		a.reusable = false
	}
	a.frame(o.head)
	return a, nil
}

// sendBody writes the body while the answer is read. When the browser's
// side of the body fails (too large, the browser gone), it cuts the
// exchange, or DSH would wait for the rest forever; when DSH stops taking
// it (it answered early and closed), the answer is read as usual. It may
// outlive the answer, so it touches only its arguments.
func sendBody(conn *upConn, body *bodyReader, done chan<- error) {
	err := writeBody(conn.bw, body)
	if err != nil && body.failed.Load() {
		conn.abort()
	}
	done <- err
}

// writeBody copies the body to w, chunked when its length is unknown.
func writeBody(w *bufio.Writer, body *bodyReader) error {
	buf := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(buf)
	for {
		n, err := body.Read(*buf)
		if n > 0 {
			if body.size < 0 {
				w.WriteString(strconv.FormatInt(int64(n), 16))
				w.WriteString("\r\n")
			}
			w.Write((*buf)[:n])
			if body.size < 0 {
				w.WriteString("\r\n")
			}
			if werr := w.Flush(); werr != nil {
				return werr
			}
		}
		switch {
		case errors.Is(err, io.EOF):
			if body.size < 0 {
				w.WriteString("0\r\n\r\n")
			}
			return w.Flush()
		case err != nil:
			return err
		}
	}
}

var copyBuffers = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// frame sets up the body reader the header describes.
func (a *answer) frame(head bool) {
	br := a.conn.br
	code := a.Header.StatusCode()
	switch cl := a.Header.ContentLength(); {
	case head || code == fasthttp.StatusNoContent || code == fasthttp.StatusNotModified:
		a.Size = 0
		a.complete.Store(true)
	case cl >= 0:
		a.Size = int64(cl)
		if cl == 0 {
			a.complete.Store(true)
		} else {
			a.length = lengthBody{a: a, r: br, left: int64(cl)}
			a.Body = &a.length
		}
	case cl == -1:
		a.Size = -1
		a.Body = &chunkedBody{a: a, br: br, r: httputil.NewChunkedReader(br)}
	default: // identity: the body ends when the connection does
		a.Size = -1
		a.reusable = false
		a.Body = br
	}
}

// Close ends the exchange: the connection goes back to the pool if the
// body was read to its end, the request's body was sent whole and nobody
// said close; otherwise it is closed.
func (a *answer) Close() error {
	a.stop()
	ok := a.reusable && a.complete.Load() && a.conn.br.Buffered() == 0
	if a.sending != nil {
		select {
		case err := <-a.sending:
			ok = ok && err == nil
		default:
			ok = false // still sending: DSH answered early
		}
	}
	conn := a.conn
	conn.mu.Lock()
	ok = ok && !conn.aborted
	conn.mu.Unlock()
	u := a.u
	a.release()
	if ok {
		u.put(conn)
		return nil
	}
	return conn.Close()
}

// release returns a to the pool; nothing of it may be used after.
func (a *answer) release() {
	a.Header.Reset()
	a.Body, a.Size, a.u, a.conn, a.stop, a.sending = nil, 0, nil, nil, nil, nil
	a.complete.Store(false)
	a.length = lengthBody{}
	answers.Put(a)
}

// lengthBody is a body of known length.
type lengthBody struct {
	a    *answer
	r    io.Reader
	left int64
}

func (b *lengthBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	if b.left == 0 {
		b.a.complete.Store(true)
		return n, io.EOF
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

// chunkedBody is a chunked body; at its end the trailer section is read
// (and dropped: trailers are not passed on).
type chunkedBody struct {
	a  *answer
	br *bufio.Reader
	r  io.Reader
}

func (b *chunkedBody) Read(p []byte) (int, error) {
	if b.a.complete.Load() {
		return 0, io.EOF // asked again after the end (fasthttp does)
	}
	n, err := b.r.Read(p)
	if err == io.EOF {
		for {
			line, lerr := b.br.ReadSlice('\n')
			if lerr != nil {
				return n, lerr
			}
			if len(line) <= 2 { // "\r\n": the end of the message
				break
			}
		}
		b.a.complete.Store(true)
	}
	return n, err
}
