package proxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
)

var errBodyTooLarge = errors.New("request body exceeds MAX_BODY_MB")

// bodyReader streams the browser's body to DSH: it enforces MAX_BODY_MB on
// the bytes themselves (chunked bodies carry no length), gives each read a
// fresh deadline so a long upload is fine but a stalled one is not, and
// remembers whether anything was read (a refused request can be retried
// only then) and whether the browser failed mid-body.
//
// It also says where the body ends without another read of the stream: a
// body of known length ends with its last byte. Go's transport reads once
// more after Content-Length bytes, and that read can come after the
// handler has returned (DSH answered as soon as it had the bytes); a
// failing read there makes the transport close the upstream connection
// and cut the response it is streaming.
type bodyReader struct {
	mu       sync.Mutex // serialises reads with detach
	detached bool
	r        io.Reader
	conn     net.Conn
	read     time.Duration
	max      int64
	size     int64 // Content-Length, -1 when chunked
	n        int64
	eof      bool
	tooLarge bool
	failure  error
	// What the handler may read while the upstream client's writer is
	// still reading the body (DSH answered early): bytes read so far, and
	// whether the body ended in error.
	seen   atomic.Int64
	failed atomic.Bool
}

// requestBody is the request's body, or nil when it has none.
func (p *Proxy) requestBody(c *fiber.Ctx) *bodyReader {
	if !httpguard.HasBody(c) {
		return nil
	}
	return &bodyReader{r: httpguard.Body(c), conn: c.Context().Conn(), read: p.o.ReadTimeout, max: p.o.MaxBody,
		size: int64(c.Request().Header.ContentLength())}
}

func (b *bodyReader) Read(buf []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.complete() {
		return 0, io.EOF
	}
	if b.detached {
		return 0, errDetached
	}
	if b.size >= 0 && int64(len(buf)) > b.size-b.n {
		buf = buf[:b.size-b.n]
	}
	_ = b.conn.SetReadDeadline(time.Now().Add(b.read))
	n, err := b.r.Read(buf)
	b.n += int64(n)
	b.seen.Store(b.n)
	if b.n > b.max {
		b.tooLarge = true
		b.failed.Store(true)
		return n, errBodyTooLarge
	}
	switch {
	case errors.Is(err, io.EOF):
		b.eof = true
	case err != nil:
		b.failure = err
		b.failed.Store(true)
	case b.complete():
		err = io.EOF
	}
	return n, err
}

// complete: the whole body has been read.
func (b *bodyReader) complete() bool { return b.eof || b.size >= 0 && b.n >= b.size }

func (b *bodyReader) Close() error { return nil }

var errDetached = errors.New("request finished: its body can no longer be read")

// chunkedEndGrace is how long detach waits for the end of a chunked body
// whose data has all been read: its last chunk may still be on the wire.
const chunkedEndGrace = 50 * time.Millisecond

// detach ends reading: a read blocked on the browser is released (its
// deadline moved to now), and every later read fails unless the body is
// complete. After it, nothing but the edge's own drain touches the body
// stream. A chunked body whose end has not been seen yet gets one short
// read for it, so an answer that came with the last data byte is not
// mistaken for an early one.
func (b *bodyReader) detach() {
	if b == nil {
		return
	}
	_ = b.conn.SetReadDeadline(time.Now())
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.detached {
		return
	}
	b.detached = true
	if b.complete() || b.size >= 0 || b.n == 0 || b.failure != nil {
		return
	}
	_ = b.conn.SetReadDeadline(time.Now().Add(chunkedEndGrace))
	var probe [1]byte
	n, err := b.r.Read(probe[:])
	b.eof = n == 0 && errors.Is(err, io.EOF)
}

// untouched: nothing of the body has been read, and no read failed (a
// refused request can be retried).
func (b *bodyReader) untouched() bool { return b.seen.Load() == 0 && !b.failed.Load() }

// outcome is why the body ended early, for the handler: errBodyTooLarge,
// errClientGone (the browser failed mid-body), or nil. Only the reader
// writes what it reads, under mu.
func (b *bodyReader) outcome() error {
	if !b.failed.Load() {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tooLarge {
		return errBodyTooLarge
	}
	return errClientGone
}

// responseBody streams DSH's answer to the browser: it counts the bytes
// sent and runs done exactly once, when the body is finished or abandoned
// (fasthttp closes it either way). Each chunk read gets a fresh write
// deadline for the browser: a browser that stops reading is dropped after
// HTTP_WRITE_TIMEOUT, a stream that keeps flowing is never cut.
type responseBody struct {
	a     *answer
	conn  net.Conn
	write time.Duration
	n     int64
	once  sync.Once
	done  func(int64)
}

func (b *responseBody) Read(p []byte) (int, error) {
	n, err := b.a.Body.Read(p)
	b.n += int64(n)
	if n > 0 {
		_ = b.conn.SetWriteDeadline(time.Now().Add(b.write))
	}
	return n, err
}

// WriteTo sends a body of known length (fasthttp uses it for those;
// chunked ones, such as server-sent events, go chunk by chunk through
// Read): from socket to socket inside the kernel (splice) when both ends
// are plain TCP, else in writes as large as what has arrived, up to 128
// KiB.
func (b *responseBody) WriteTo(w io.Writer) (int64, error) {
	if lb, ok := b.a.Body.(*lengthBody); ok {
		dst, dok := b.conn.(*net.TCPConn)
		src, sok := b.a.conn.Conn.(*net.TCPConn)
		if dok && sok {
			return b.splice(w, lb, dst, src)
		}
	}
	buf := bigBuffers.Get().(*[]byte)
	defer bigBuffers.Put(buf)
	for {
		n, err := b.a.Body.Read(*buf)
		if n > 0 {
			_ = b.conn.SetWriteDeadline(time.Now().Add(b.write))
			m, werr := w.Write((*buf)[:n])
			b.n += int64(m)
			if werr != nil {
				return b.n, werr
			}
		}
		switch {
		case errors.Is(err, io.EOF):
			return b.n, nil
		case err != nil:
			return b.n, err
		}
	}
}

// spliceChunk is how much one splice may move before the browser's write
// deadline is renewed.
const spliceChunk = 1 << 20

func (b *responseBody) splice(w io.Writer, lb *lengthBody, dst, src *net.TCPConn) (int64, error) {
	// What the upstream reader has buffered goes first, through w, and w
	// (holding the response header) is flushed before the kernel takes
	// over the connection.
	br := b.a.conn.br
	if n := min(int64(br.Buffered()), lb.left); n > 0 {
		head, _ := br.Peek(int(n))
		m, err := w.Write(head)
		_, _ = br.Discard(m)
		lb.left -= int64(m)
		b.n += int64(m)
		if err != nil {
			return b.n, err
		}
	}
	if f, ok := w.(interface{ Flush() error }); ok {
		_ = b.conn.SetWriteDeadline(time.Now().Add(b.write))
		if err := f.Flush(); err != nil {
			return b.n, err
		}
	}
	for lb.left > 0 {
		_ = dst.SetWriteDeadline(time.Now().Add(b.write))
		n, err := dst.ReadFrom(&io.LimitedReader{R: src, N: min(lb.left, spliceChunk)})
		lb.left -= n
		b.n += n
		switch {
		case err != nil:
			return b.n, err
		case n == 0:
			return b.n, io.ErrUnexpectedEOF
		}
	}
	lb.a.complete.Store(true)
	return b.n, nil
}

var bigBuffers = sync.Pool{New: func() any { b := make([]byte, 128<<10); return &b }}

func (b *responseBody) Close() error {
	err := b.a.Close()
	b.once.Do(func() { b.done(b.n) })
	return err
}
