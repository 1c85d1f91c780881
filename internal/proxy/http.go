package proxy

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/clientinfo"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/web"
)

// statusClientClosed is nginx's 499: the client left before the response.
const statusClientClosed = 499

// serveHTTP proxies one request. The order matters and is the seed's:
// authentication, the in-flight slot, the sandbox (waking it), the
// handshake, and only then the body, streamed to DSH.
func (p *Proxy) serveHTTP(c *fiber.Ctx, user, rest string) error {
	rid := requestID(c)
	id, status, err := p.authenticate(c)
	switch {
	case status == fiber.StatusUnauthorized:
		return p.reject(c, status, "Please sign in", err.Error())
	case err != nil:
		return p.reject(c, status, "Not allowed", err.Error())
	}
	if id.User != user {
		return p.reject(c, fiber.StatusForbidden, "Not your sandbox", "This sandbox belongs to another user.")
	}
	// Credentials the browser attaches by itself (the session cookie, the
	// SSO proxy's header) must not let another site drive the agent: a
	// state-changing request needs our own origin. Bearer tokens are sent
	// on purpose and need none.
	if id.Ambient && !safeMethod(c.Method()) && !clientinfo.SameOrigin(c) {
		return p.reject(c, fiber.StatusForbidden, "Cross-site request refused", "Requests that change something must come from this gateway's own pages.")
	}
	if !p.o.Slots.Acquire(user) {
		c.Set(fiber.HeaderRetryAfter, "1")
		return p.reject(c, fiber.StatusServiceUnavailable, "Too many requests", "Too many requests to your sandbox are in flight; retry shortly.")
	}
	start := time.Now()
	p.tracker.begin(user)
	p.m.inFlight.Inc()
	var once sync.Once
	finish := func(status int) {
		once.Do(func() {
			p.o.Slots.Release(user)
			p.tracker.end(user)
			p.m.inFlight.Dec()
			p.m.requests.WithLabelValues(class(status)).Inc()
		})
	}

	status, err = p.forward(c, id, rest, finish)
	if err != nil {
		finish(status)
		if status == statusClientClosed {
			p.o.Log.Info("client closed request", "request_id", rid, "user", user, "method", c.Method(), "status", statusClientClosed, "took", time.Since(start).String())
			c.Status(statusClientClosed)
			return nil
		}
		var we *waitError
		if errors.As(err, &we) {
			return p.problem(c, we.status, we.title, we.detail)
		}
		p.o.Log.Warn("proxy error", "request_id", rid, "user", user, "status", status, "err", err)
		// The cause (addresses, transport errors) is for the log, not the
		// browser; the request id ties the two together.
		return p.problem(c, status, "Sandbox unreachable", "Your sandbox did not answer (request "+rid+"). Try again in a moment.")
	}
	took := time.Since(start)
	p.m.duration.WithLabelValues(class(status)).Observe(took.Seconds())
	if p.o.Log.Enabled(context.Background(), slog.LevelDebug) {
		p.o.Log.Debug("proxied", "request_id", rid, "user", user, "method", c.Method(), "status", status, "took", took.String())
	}
	return nil
}

// forward does everything after the slot; on success the response is set
// up to stream and finish runs when the body is done.
func (p *Proxy) forward(c *fiber.Ctx, id Identity, rest string, finish func(int)) (int, error) {
	user := id.User
	req := &c.Request().Header
	if n := req.ContentLength(); int64(n) > p.o.MaxBody {
		return p.tooLarge()
	}
	navigation := c.Method() == fiber.MethodGet && strings.Contains(c.Get(fiber.HeaderAccept), "text/html")
	box, starting, err := p.ready(c, user, navigation)
	if err != nil {
		return refused(err)
	}
	if starting {
		finish(fiber.StatusServiceUnavailable)
		c.Status(fiber.StatusServiceUnavailable)
		c.Set(fiber.HeaderRetryAfter, "2")
		c.Set(fiber.HeaderCacheControl, "no-store")
		c.Type("html")
		return fiber.StatusServiceUnavailable, web.RenderStarting(c, web.Starting{User: user, Phase: string(box.Phase), Reason: box.Reason})
	}
	cookie, rev, err := p.handshakeCookie(c, user, box, 0)
	if err != nil {
		return refused(err)
	}

	body := p.requestBody(c)
	// The upstream transport may still be reading the body when DSH has
	// answered early; fasthttp recycles the body stream once the handler
	// returns, so the transport must be cut off from it first.
	defer body.detach()
	resp, err := p.roundTrip(c, user, rest, box, cookie, body)
	if err == nil && resp.StatusCode == http.StatusUnauthorized && body.untouched() {
		// DSH's cookie expired or its token rotated: one fresh handshake,
		// one retry. Expect: 100-continue kept the body unread for it.
		resp.Body.Close()
		if cookie, _, err = p.handshakeCookie(c, user, box, rev); err != nil {
			return refused(err)
		}
		resp, err = p.roundTrip(c, user, rest, box, cookie, body)
	}
	if err != nil {
		switch {
		case body.tooLarge:
			return p.tooLarge()
		case body.failure != nil || errors.Is(err, errClientGone):
			return statusClientClosed, errClientGone
		}
		p.m.upstreamErrors.WithLabelValues("request").Inc()
		return fiber.StatusBadGateway, err
	}
	if resp.StatusCode == http.StatusUnauthorized {
		resp.Body.Close()
		return fiber.StatusServiceUnavailable, handshakeFailed("DSH kept refusing its auth cookie")
	}
	p.m.bytesUp.Add(float64(body.n))
	// What DSH left unread of the body, httpguard.ConsumeBody drains or
	// the connection closes.
	if err := p.respond(c, id, box, resp, finish); err != nil {
		resp.Body.Close()
		p.m.upstreamErrors.WithLabelValues("response").Inc()
		return fiber.StatusBadGateway, &waitError{fiber.StatusBadGateway, "Response refused", "Your sandbox's answer was not passed on: " + err.Error() + "."}
	}
	return resp.StatusCode, nil
}

// safeMethod: methods that change nothing, by HTTP's rules.
func safeMethod(m string) bool {
	return m == fiber.MethodGet || m == fiber.MethodHead || m == fiber.MethodOptions
}

// refused is the answer to a failure before DSH was asked: 499 for a
// client that left, 503 for everything else (the wait and handshake errors
// carry their own readable text).
func refused(err error) (int, error) {
	if errors.Is(err, errClientGone) {
		return statusClientClosed, err
	}
	return fiber.StatusServiceUnavailable, err
}

func (p *Proxy) tooLarge() (int, error) {
	return fiber.StatusRequestEntityTooLarge, &waitError{fiber.StatusRequestEntityTooLarge, "Upload too large", "Request bodies are limited to " + strconv.FormatInt(p.o.MaxBody>>20, 10) + " MiB."}
}

// roundTrip sends the request to DSH with the headers we allow and set,
// cancelling it if the browser leaves before DSH answers.
func (p *Proxy) roundTrip(c *fiber.Ctx, user, rest string, box kv.Sandbox, cookie string, body *bodyReader) (*http.Response, error) {
	uri := "http://" + box.Address + rest
	if q := c.Request().URI().QueryString(); len(q) > 0 {
		uri += "?" + string(q)
	}
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, c.Method(), uri, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	p.upstreamHeaders(c, user, cookie, req.Header)
	req.Host = clientinfo.Host(c)
	if cl := c.Request().Header.ContentLength(); cl != 0 && cl != -2 {
		req.Body, req.ContentLength = body, int64(cl)
		req.Header.Set("Expect", "100-continue")
		if cl < 0 {
			req.ContentLength = -1
		}
	}

	// Most answers come quickly; only a slow one gets a watcher that
	// cancels it when the browser leaves.
	done := make(chan struct{})
	watch := time.AfterFunc(poll, func() {
		t := time.NewTicker(poll)
		defer t.Stop()
		for {
			if clientinfo.Gone(c.Context().Conn()) {
				cancel()
				return
			}
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	})
	resp, err := p.transport.RoundTrip(req)
	watch.Stop()
	close(done)
	if err != nil {
		cancel()
		if ctx.Err() != nil {
			return nil, errClientGone
		}
		return nil, err
	}
	resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
	return resp, nil
}

// upstreamHeaders copies the browser's headers that may pass and sets the
// ones that are ours to set.
func (p *Proxy) upstreamHeaders(c *fiber.Ctx, user, cookie string, h http.Header) {
	hdr := &c.Request().Header
	var conn []string
	for _, v := range hdr.PeekAll(fiber.HeaderConnection) {
		conn = append(conn, string(v))
	}
	extra := connectionTokens(conn)
	hdr.VisitAll(func(k, v []byte) {
		name := http.CanonicalHeaderKey(string(k))
		if isHopByHop(name, extra) || !p.headers.pass(name) {
			return
		}
		h.Add(name, string(v))
	})
	h.Set("Cookie", cookie)
	h.Set("X-Forwarded-For", clientinfo.IP(c))
	h.Set("X-Forwarded-Proto", clientinfo.Scheme(c))
	h.Set("X-Forwarded-Host", clientinfo.Host(c))
	h.Set("X-Forwarded-Prefix", "/u/"+user)
}

// respond streams DSH's answer to the browser. fasthttp writes a body of
// unknown length chunk by chunk, flushing each, so server-sent events
// reach the browser one by one. A response DSH should not give (a redirect
// out of the gateway) is an error, and nothing of it is sent.
func (p *Proxy) respond(c *fiber.Ctx, id Identity, box kv.Sandbox, resp *http.Response, finish func(int)) error {
	out := &c.Response().Header
	// The edge's own page headers are not DSH's.
	for name := range httpguard.PageHeaders {
		out.Del(name)
	}
	loc := location{prefix: "/u/" + id.User, host: clientinfo.Host(c), upstream: box.Address}
	if err := p.headers.response(resp.Header, loc, out.Add); err != nil {
		return err
	}
	c.Status(resp.StatusCode)
	status := resp.StatusCode
	x := &exchange{valid: id.Valid, cancel: resp.Body.(*cancelOnClose).cancel}
	user := id.User
	body := &responseBody{r: resp.Body, conn: c.Context().Conn(), write: p.o.WriteTimeout, done: func(n int64) {
		p.live.remove(x)
		p.m.bytesDown.Add(float64(n))
		p.tracker.touch(user)
		finish(status)
	}}
	if resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified || c.Method() == fiber.MethodHead {
		if resp.ContentLength > 0 && c.Method() == fiber.MethodHead {
			out.SetContentLength(int(resp.ContentLength))
		}
		body.Close()
		return nil
	}
	p.live.add(x)
	c.Response().SetBodyStream(body, int(resp.ContentLength))
	return nil
}

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
}

func (p *Proxy) requestBody(c *fiber.Ctx) *bodyReader {
	return &bodyReader{r: c.Context().RequestBodyStream(), conn: c.Context().Conn(), read: p.o.ReadTimeout, max: p.o.MaxBody,
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
	if b.n > b.max {
		b.tooLarge = true
		return n, errBodyTooLarge
	}
	switch {
	case errors.Is(err, io.EOF):
		b.eof = true
	case err != nil:
		b.failure = err
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
	_ = b.conn.SetReadDeadline(time.Now())
	b.mu.Lock()
	defer b.mu.Unlock()
	b.detached = true
	if b.complete() || b.size >= 0 || b.n == 0 || b.failure != nil {
		return
	}
	_ = b.conn.SetReadDeadline(time.Now().Add(chunkedEndGrace))
	var probe [1]byte
	n, err := b.r.Read(probe[:])
	b.eof = n == 0 && errors.Is(err, io.EOF)
}

func (b *bodyReader) untouched() bool { return b.n == 0 && b.failure == nil }

// responseBody counts the bytes sent and runs done exactly once, when the
// body is finished or abandoned (fasthttp closes it either way). Each
// chunk read gets a fresh write deadline for the browser: a browser that
// stops reading is dropped after HTTP_WRITE_TIMEOUT, a stream that keeps
// flowing is never cut.
type responseBody struct {
	r     io.ReadCloser
	conn  net.Conn
	write time.Duration
	n     int64
	once  sync.Once
	done  func(int64)
}

func (b *responseBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.n += int64(n)
	if n > 0 {
		_ = b.conn.SetWriteDeadline(time.Now().Add(b.write))
	}
	return n, err
}

func (b *responseBody) Close() error {
	err := b.r.Close()
	b.once.Do(func() { b.done(b.n) })
	return err
}

// cancelOnClose releases the upstream request's context with its body.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}
