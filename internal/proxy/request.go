package proxy

import (
	"context"
	"sync"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/httpguard"
)

// request is one proxied request or WebSocket: what the route said, who
// asked, and its context (the request scope's, httpguard.Context): ended
// when the client goes away or when the request ends, and passed to every
// wait, command publish and upstream call of the request.
type request struct {
	// c is fasthttp's, valid until the handler returns: what outlives
	// it (a streamed response) uses the copies below.
	c      *fiber.Ctx
	ctx    context.Context
	cancel context.CancelFunc
	method string
	user   string
	// rest is the path DSH gets, as it arrived: after /u/<user> in path
	// mode, the whole path on a sandbox origin.
	rest string
	// port is the preview's port, 0 for a request to DSH.
	port int
	id   auth.Identity
	// host and scheme are the browser's, as httpguard resolved them;
	// origin says host is the user's sandbox origin (subdomain mode), not
	// the gateway's with the sandbox under /u/<user>.
	host, scheme string
	origin       bool
	start        time.Time
	// stream is the request's answer once it became a stream (tracker).
	stream *stream
	// failed: the edge answered itself (fail), not DSH.
	failed bool
}

// begin takes the request's context (httpguard.Detach: it carries the
// request id, which commands published for it quote, and ends when the
// client leaves while the handler runs) and its end: the request ends
// with finish, which for a streamed response is when the stream ends.
// Requests are pooled: one answered within its handler goes back with
// release.
func (p *Proxy) begin(c *fiber.Ctx, user, rest string, id auth.Identity) *request {
	ctx, end := httpguard.Detach(c)
	info := httpguard.Get(c)
	r := requests.Get().(*request)
	*r = request{c: c, ctx: ctx, cancel: end, method: c.Method(), user: user, rest: rest, id: id,
		host: info.Host, scheme: info.Scheme, origin: info.OnSandboxDomain, start: time.Now()}
	return r
}

var requests = sync.Pool{New: func() any { return new(request) }}

// release returns r to the pool: its answer has ended, within the
// handler, and nothing holds it.
func (r *request) release() {
	*r = request{}
	requests.Put(r)
}

// target is what the resolver needs to know of the request.
func (r *request) target() Target {
	return Target{User: r.user, Host: r.host, Scheme: r.scheme, Origin: r.origin, Background: background(r.c)}
}

// background reports a page's own request: one a browser marks with a
// Sec-Fetch-Mode other than navigate (fetch, XHR, EventSource, WebSocket).
// Clients that send no Sec-Fetch-Mode (API clients, curl) are not pages.
func background(c *fiber.Ctx) bool {
	m := c.Get("Sec-Fetch-Mode")
	return m != "" && m != "navigate"
}

// appendURI appends the path and query DSH gets.
func (r *request) appendURI(b []byte) []byte {
	b = append(b, r.rest...)
	if q := r.c.Request().URI().QueryString(); len(q) > 0 {
		b = append(b, '?')
		b = append(b, q...)
	}
	return b
}
