package proxy

import (
	"bufio"
	"bytes"
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

// transport is the seam between the proxy and its HTTP/1.1 client: one
// request out and its answer back, net/http's RoundTripper with the
// address and the context explicit. The answer's body is read, then the
// answer closed, which gives its connection back when the exchange was
// complete. upstream is the transport the edge runs; the conformance
// suite (conformance_test.go) holds any transport to net/http's server.
type transport interface {
	RoundTrip(ctx context.Context, addr string, o *outgoing) (*answer, error)
	// CloseIdle closes every pooled connection.
	CloseIdle()
}

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
	// aborter is abort as a func, bound once per connection rather than
	// per exchange.
	aborter func()
}

func newUpConn(conn net.Conn, addr string) *upConn {
	c := &upConn{Conn: conn, addr: addr, br: bufio.NewReaderSize(conn, bufSize), bw: bufio.NewWriterSize(conn, bufSize)}
	c.aborter = c.abort
	return c
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
	return newUpConn(conn, addr), false, nil
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

// CloseIdle closes every pooled connection.
func (u *upstream) CloseIdle() {
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
	uri    []byte
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

// RoundTrip sends o to addr and returns the answer's header, with its
// body ready to read. ctx aborts the exchange, body included, until the
// answer is closed.
func (u *upstream) RoundTrip(ctx context.Context, addr string, o *outgoing) (*answer, error) {
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

// afterFunc is context.AfterFunc, through ctx's own AfterFunc where it
// has one: the edge's request scope (httpguard) watches one function per
// request without allocating, where context.AfterFunc allocates its
// watch every time.
func afterFunc(ctx context.Context, f func()) (stop func() bool) {
	if w, ok := ctx.(interface{ AfterFunc(func()) func() bool }); ok {
		return w.AfterFunc(f)
	}
	return context.AfterFunc(ctx, f)
}

// staleError is a failure before the first byte of an answer.
type staleError struct{ err error }

func (e *staleError) Error() string { return e.err.Error() }

func (u *upstream) exchange(ctx context.Context, conn *upConn, o *outgoing) (*answer, error) {
	a := answers.Get().(*answer)
	a.u, a.conn, a.reusable = u, conn, true
	a.stop = afterFunc(ctx, conn.aborter)
	err := writeHead(conn.bw, o)
	got := false // a final header has been read
	if err == nil && o.body != nil {
		got, err = u.awaitContinue(ctx, a, o)
	}
	if err == nil && !got {
		err = a.readFinal(ctx, o)
	}
	if err != nil {
		a.stop()
		a.release()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	a.frame(o.head)
	return a, nil
}

// writeHead writes o's request line and header, with the framing of its
// body, and flushes them.
func writeHead(bw *bufio.Writer, o *outgoing) error {
	bw.WriteString(o.method)
	bw.WriteByte(' ')
	bw.Write(o.uri)
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
		return &staleError{err}
	}
	return nil
}

// awaitContinue waits for DSH's word on a request with a body: 100
// Continue when it wants the body, or an answer at once (a refusal: the
// body stays unread, for a retry; got is true); a server that says
// nothing gets the body after continueFor, as with net/http. Other interim
// answers (102, 103) are no answer: the wait goes on. Unless DSH answered,
// the body is then sent beside the read of the answer.
func (u *upstream) awaitContinue(ctx context.Context, a *answer, o *outgoing) (got bool, err error) {
	conn := a.conn
	deadline := time.Now().Add(u.continueFor)
	for {
		conn.readDeadline(deadline)
		_, err := conn.br.Peek(1)
		conn.readDeadline(time.Time{})
		var ne net.Error
		switch {
		case err == nil:
			if _, err := readHead(&a.Header, conn.br); err != nil {
				return false, &staleError{err}
			}
			switch code := a.Header.StatusCode(); {
			case code == fasthttp.StatusContinue:
				a.Header.Reset()
			case code == fasthttp.StatusSwitchingProtocols:
				return false, errSwitched
			case code < 200:
				a.Header.Reset()
				continue
			default:
				// The body was announced and not sent: the connection's
				// framing is lost.
				a.reusable = false
				return true, nil
			}
		case errors.As(err, &ne) && ne.Timeout() && ctx.Err() == nil:
		default:
			return false, &staleError{err}
		}
		a.sending = make(chan error, 1)
		go sendBody(conn, o.body, a.sending)
		return false, nil
	}
}

// readFinal reads the answer's final header, passing over interim ones
// (100 after the body went, 102, 103: fasthttp writes one response per
// request).
func (a *answer) readFinal(ctx context.Context, o *outgoing) error {
	for {
		closes, err := readHead(&a.Header, a.conn.br)
		if err != nil {
			if a.sending == nil {
				return &staleError{err}
			}
			// The writer must end before the request does; a body that
			// failed (too large, the browser gone) is the cause, not the
			// aborted read it led to.
			a.conn.abort()
			o.body.detach()
			if serr := <-a.sending; serr != nil && !errors.Is(serr, errDetached) && ctx.Err() == nil {
				err = serr
			}
			a.sending = nil
			return err
		}
		switch code := a.Header.StatusCode(); {
		case code == fasthttp.StatusSwitchingProtocols:
			return errSwitched
		case code >= 200:
			if closes || a.Header.ConnectionClose() {
				a.reusable = false // DSH said it closes the connection after the answer
			}
			return nil
		default:
			a.Header.Reset()
		}
	}
}

// malformedError: DSH's answer is not framed as RFC 9112 says.
type malformedError struct{ what string }

func (e *malformedError) Error() string { return "DSH sent a malformed answer: " + e.what }

// readHead reads one response head into h, once its raw bytes passed
// checkHead. fasthttp's reader alone is lenient where leniency moves the
// end of a message or changes its bytes: it reads a Transfer-Encoding of
// any value but "identity" as chunked, lets the last of differing
// Content-Lengths win, takes any word for the protocol and any number for
// the status, and unfolds an obs-fold line inside its read buffer,
// overwriting the body's first byte. It reads "Connection: close" only
// when that is the field's whole value and the last Connection field, so
// closes reports whether any Connection field names close.
func readHead(h *fasthttp.ResponseHeader, br *bufio.Reader) (closes bool, err error) {
	var n int
	for {
		b, _ := br.Peek(br.Buffered())
		if n, closes, err = checkHead(b); err != nil {
			return false, err
		}
		if n >= 0 {
			break
		}
		if _, err := br.Peek(len(b) + 1); err != nil {
			if errors.Is(err, bufio.ErrBufferFull) {
				return false, &malformedError{"its header exceeds " + strconv.Itoa(bufSize) + " bytes"}
			}
			return false, err
		}
	}
	before := br.Buffered()
	if err := h.Read(br); err != nil {
		return false, err
	}
	if before-br.Buffered() != n {
		return false, &malformedError{"its header ends where fasthttp does not see it end"}
	}
	return closes, nil
}

// checkHead checks the response head at the start of b and returns its
// length, or -1 when it has not all arrived, and whether a Connection
// field names close. It wants a status line "HTTP/1.x NNN reason", field
// lines of a token, a colon and a value of visible characters, spaces and
// tabs (no obs-fold), lines ending in CRLF, and framing fields a strict
// reader frames alike: one Content-Length of digits only, Transfer-Encoding
// "chunked" only, once, and not in HTTP/1.0. Bare LF line ends and a
// repeated Content-Length, which RFC 9112 lets a recipient accept, are
// refused as fasthttp's reader refuses them: one rule for both readers.
func checkHead(b []byte) (n int, closes bool, err error) {
	var length []byte
	encodings := 0
	http10 := false
	for off, first := 0, true; ; first = false {
		i := bytes.IndexByte(b[off:], '\n')
		if i < 0 {
			return -1, false, nil
		}
		line, crlf := bytes.CutSuffix(b[off:off+i], []byte("\r"))
		off += i + 1
		if !crlf {
			return 0, false, &malformedError{"a line of its head does not end in CRLF"}
		}
		if first {
			if !statusLine(line) {
				return 0, false, &malformedError{"its status line is not HTTP/1.0 or HTTP/1.1 with a status code"}
			}
			http10 = line[7] == '0'
			continue
		}
		if len(line) == 0 {
			if encodings > 0 && http10 {
				return 0, false, &malformedError{"an HTTP/1.0 answer has a Transfer-Encoding"}
			}
			return off, closes, nil
		}
		name, value, ok := field(line)
		if !ok {
			return 0, false, &malformedError{"a header line is not a field name, a colon and a value"}
		}
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			if !digits(value) || length != nil {
				return 0, false, &malformedError{"its Content-Length is not one number"}
			}
			length = value
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			if encodings++; encodings > 1 || !bytes.EqualFold(value, []byte("chunked")) {
				return 0, false, &malformedError{"its Transfer-Encoding is not chunked alone"}
			}
		case bytes.EqualFold(name, []byte("Connection")):
			for t := range bytes.SplitSeq(value, []byte(",")) {
				closes = closes || bytes.EqualFold(bytes.Trim(t, " \t"), []byte("close"))
			}
		}
	}
}

// statusLine: "HTTP/1.0" or "HTTP/1.1", a space, a status from 100 to
// 599, and nothing or a space and a reason.
func statusLine(l []byte) bool {
	if len(l) < 12 || !bytes.HasPrefix(l, []byte("HTTP/1.")) || l[7] != '0' && l[7] != '1' || l[8] != ' ' ||
		l[9] < '1' || l[9] > '5' || !digits(l[10:12]) || len(l) > 12 && l[12] != ' ' {
		return false
	}
	return validValue(l[12:])
}

// field splits a field line into its name and its value without the
// spaces around it; ok is false for anything else.
func field(line []byte) (name, value []byte, ok bool) {
	name, value, ok = bytes.Cut(line, []byte(":"))
	if !ok || len(name) == 0 || !validValue(value) {
		return nil, nil, false
	}
	for _, c := range name {
		if !tchar(c) {
			return nil, nil, false
		}
	}
	return name, bytes.Trim(value, " \t"), true
}

// tchar: a character of a token (RFC 9110 §5.6.2).
func tchar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0
}

// validValue: visible characters, obs-text, spaces and tabs only.
func validValue(v []byte) bool {
	for _, c := range v {
		if c < ' ' && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// digits: one to 18 decimal digits (a length that fits an int64).
func digits(v []byte) bool {
	if len(v) == 0 || len(v) > 18 {
		return false
	}
	for _, c := range v {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
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
// (and dropped: trailers are not passed on) as net/http reads it: field
// lines ending in CRLF up to an empty one, 4 KiB at most.
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
		if terr := b.trailer(); terr != nil {
			return n, terr
		}
		b.a.complete.Store(true)
	}
	return n, err
}

// maxTrailer bounds the trailer section as net/http's reader does (it
// must end within its 4 KiB buffer).
const maxTrailer = 4 << 10

// trailer reads the trailer section; the message ends with its empty line.
func (b *chunkedBody) trailer() error {
	for size := 0; ; {
		line, err := b.br.ReadSlice('\n')
		if errors.Is(err, io.EOF) {
			return io.ErrUnexpectedEOF // io.EOF would read as the body's end
		}
		if err != nil {
			return err
		}
		size += len(line)
		switch {
		case size > maxTrailer:
			return &malformedError{"its trailer section exceeds 4 KiB"}
		case !bytes.HasSuffix(line, []byte("\r\n")):
			return &malformedError{"a trailer line does not end in CRLF"}
		case len(line) == 2: // the end of the message
			return nil
		}
		if _, _, ok := field(line[:len(line)-2]); !ok {
			return &malformedError{"a trailer line is not a field name, a colon and a value"}
		}
	}
}
