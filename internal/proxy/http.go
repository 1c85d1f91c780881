package proxy

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
)

// smallBody is the largest answer read whole before it is sent: one write
// to the browser and the upstream connection back in the pool at once.
// Larger and unknown-length answers stream.
const smallBody = 64 << 10

// serveHTTP proxies one request that holds a slot. The order is the
// seed's: the sandbox (waking it), the handshake, and only then the body,
// streamed to DSH. The slot and the request's context are released once,
// here, unless a streamed response body took them over.
func (p *Proxy) serveHTTP(r *request) error {
	p.tracker.begin(r.user)
	p.m.inFlight.Inc()
	status, owned, err := p.forward(r)
	if err != nil {
		status, r.failed = p.fail(r.c, err), true
	} else {
		// DSH's answer: the edge's own page headers are not for it.
		httpguard.TenantAnswer(r.c)
	}
	p.m.observe(status, sourceOf(status, r.failed), time.Since(r.start))
	if !owned {
		p.finish(r, status)
		r.release()
	}
	return nil
}

// finish ends a request that held a slot: when its response was written
// (or failed), or, for a streamed response, when the stream ended.
func (p *Proxy) finish(r *request, status int) {
	r.cancel()
	p.o.Slots.Release(r.user)
	if r.stream != nil {
		r.stream.close()
	} else {
		p.tracker.end(r.user)
	}
	p.m.inFlight.Dec()
	p.m.count(status, sourceOf(status, r.failed))
}

// forward asks DSH and sets up the response. owned means a streamed body
// now holds the request's slot and context.
func (p *Proxy) forward(r *request) (status int, owned bool, err error) {
	c := r.c
	if n := c.Request().Header.ContentLength(); int64(n) > p.o.MaxBody {
		return 0, false, tooLarge(p.o.MaxBody)
	}
	navigation := r.method == fiber.MethodGet && strings.Contains(c.Get(fiber.HeaderAccept), "text/html")
	up, err := p.resolve(r, !navigation)
	if err != nil {
		return 0, false, err
	}
	body := p.requestBody(c)
	// The upstream client may still be reading the body when DSH has
	// answered early; fasthttp recycles the body stream once the handler
	// returns, so the client must be cut off from it first. What DSH left
	// unread, httpguard.ConsumeBody drains or the connection closes.
	defer body.detach()
	a, err := p.send(r, up, body)
	// A preview's 401 is its app's own answer: it carries no cookie of ours.
	if err == nil && r.port == 0 && a.Header.StatusCode() == http.StatusUnauthorized && (body == nil || body.untouched()) {
		// DSH's cookie expired or its token rotated: one fresh handshake,
		// one retry. Expect: 100-continue kept the body unread for it.
		_ = a.Close()
		if up, err = p.resolver.Refresh(r.ctx, r.target(), up); err != nil {
			return 0, false, err
		}
		a, err = p.send(r, up, body)
	}
	var cause error
	if err != nil && body != nil {
		cause = body.outcome()
	}
	switch {
	case errors.Is(cause, errBodyTooLarge):
		return 0, false, tooLarge(p.o.MaxBody)
	case cause != nil:
		return 0, false, errClientGone
	case err != nil:
		if r.ctx.Err() == nil {
			p.m.upstreamErrors.WithLabelValues("request").Inc()
		}
		return 0, false, r.unreachable(err)
	case r.port == 0 && a.Header.StatusCode() == http.StatusUnauthorized:
		_ = a.Close()
		return 0, false, errRefusedTwice
	}
	if body != nil {
		p.m.bytesUp.Add(float64(body.seen.Load()))
	}
	return p.respond(r, up, a)
}

// outgoing is the request DSH gets: the browser's headers that may pass
// and the ones that are ours to set.
func (p *Proxy) outgoing(r *request, up Upstream, body *bodyReader) *outgoing {
	hdr := &r.c.Request().Header
	o := outgoings.Get().(*outgoing)
	b := o.header[:0]
	b = appendHeader(b, "Host", up.Host)
	extra := connectionTokens(hdr.PeekAll(fiber.HeaderConnection))
	for k, v := range hdr.All() {
		name := string(k)
		if isHopByHop(name, extra) || !p.headers.pass(name) {
			continue
		}
		b = append(b, k...)
		b = append(b, ": "...)
		b = append(b, v...)
		b = append(b, "\r\n"...)
	}
	if up.Cookie != "" { // a preview gets none
		b = appendHeader(b, "Cookie", up.Cookie)
	}
	b = append(b, "X-Forwarded-For: "...)
	b = httpguard.Get(r.c).IP.AppendTo(b)
	b = append(b, "\r\n"...)
	b = appendHeader(b, "X-Forwarded-Proto", r.scheme)
	b = appendHeader(b, "X-Forwarded-Host", r.host)
	if !r.origin {
		b = appendHeader(b, "X-Forwarded-Prefix", "/u/", r.user)
	}
	*o = outgoing{method: r.method, uri: r.appendURI(o.uri[:0]), header: b, body: body, head: r.method == fiber.MethodHead}
	return o
}

// outgoings are reused for their header buffers; RoundTrip is done with
// one when it returns.
var outgoings = sync.Pool{New: func() any { return &outgoing{header: make([]byte, 0, 1024), uri: make([]byte, 0, 256)} }}

// send is one round trip with a pooled outgoing.
func (p *Proxy) send(r *request, up Upstream, body *bodyReader) (*answer, error) {
	o := p.outgoing(r, up, body)
	a, err := p.transport.RoundTrip(r.ctx, up.Address, o)
	o.body = nil
	outgoings.Put(o)
	return a, err
}

// appendHeader appends the field name: value (the parts of value
// joined), without making the value first.
func appendHeader(b []byte, name string, value ...string) []byte {
	b = append(b, name...)
	b = append(b, ": "...)
	for _, v := range value {
		b = append(b, v...)
	}
	return append(b, "\r\n"...)
}

// respond passes DSH's answer to the browser: small ones whole, the rest
// streamed chunk by chunk (fasthttp flushes each, so server-sent events
// reach the browser one by one). An answer DSH should not give (a redirect
// out of the gateway) is an error, and nothing of it is sent.
func (p *Proxy) respond(r *request, up Upstream, a *answer) (int, bool, error) {
	c := r.c
	out := &c.Response().Header
	loc := location{user: r.user, host: r.host, upstream: up.Address, scheme: r.scheme, base: r.rest, local: r.origin}
	if err := p.headers.response(a.Header.All(), loc, out); err != nil {
		_ = a.Close()
		p.m.upstreamErrors.WithLabelValues("response").Inc()
		return 0, false, responseRefused(err)
	}
	status := a.Header.StatusCode()
	c.Status(status)
	switch {
	case a.Body == nil:
		if cl := a.Header.ContentLength(); cl > 0 && r.method == fiber.MethodHead {
			out.SetContentLength(cl)
		}
		_ = a.Close()
		return status, false, nil
	case a.Size >= 0 && a.Size <= smallBody:
		buf := copyBuffers.Get().(*[]byte)
		n, err := io.CopyBuffer(c.Response().BodyWriter(), a.Body, *buf)
		copyBuffers.Put(buf)
		_ = a.Close()
		if err != nil {
			c.Response().ResetBody()
			p.m.upstreamErrors.WithLabelValues("response").Inc()
			return 0, false, err
		}
		p.m.bytesDown.Add(float64(n))
		p.tracker.touch(r.user)
		return status, false, nil
	}
	// A streamed answer is a stream: it counts as activity while the
	// browser's input is recent (IDLE_CONNECTED_TIMEOUT from the request).
	r.stream = p.tracker.promote(r.user)
	x := &exchange{id: r.id, pod: up.PodUID, cancel: r.cancel}
	p.live.add(x)
	// Its access line waits for its end, with the bytes sent.
	httpguard.DeferAccess(c)
	rid := httpguard.RequestID(c)
	c.Response().SetBodyStream(&responseBody{a: a, conn: c.Context().Conn(), write: p.o.WriteTimeout, done: func(n int64) {
		p.live.remove(x)
		p.m.bytesDown.Add(float64(n))
		p.finish(r, status)
		(&httpguard.Line{Method: r.method, Route: httpguard.RouteSandbox, Status: status, Bytes: n, Took: time.Since(r.start),
			User: r.id.User, RequestID: rid}).Log(p.o.Log)
	}}, int(a.Size))
	return status, true, nil
}

// safeMethod: methods that change nothing, by HTTP's rules.
func safeMethod(m string) bool {
	return m == fiber.MethodGet || m == fiber.MethodHead || m == fiber.MethodOptions
}
