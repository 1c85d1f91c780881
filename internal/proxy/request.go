package proxy

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
)

// request is one proxied request or WebSocket: what the route said, who
// asked, and its context. fasthttp's own context is never cancelled, so
// ctx is ours: cancelled when the client goes away (the departures
// watcher) or when the request ends, and passed to every wait, command
// publish and upstream call of the request.
type request struct {
	// c is fasthttp's, valid until the handler returns: what outlives
	// it (a streamed response) uses the copies below.
	c      *fiber.Ctx
	ctx    context.Context
	cancel context.CancelFunc
	rid    string
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

// departures cancels the requests whose clients have gone. One goroutine
// checks every request in flight every poll, with a non-consuming peek at
// its connection; waits and upstream calls just watch their context.
type departures struct {
	mu sync.Mutex
	m  map[*request]net.Conn
}

// poll is how often departures checks that clients are still there.
const poll = 250 * time.Millisecond

func (d *departures) add(r *request, conn net.Conn) {
	d.mu.Lock()
	d.m[r] = conn
	d.mu.Unlock()
}

func (d *departures) remove(r *request) {
	d.mu.Lock()
	delete(d.m, r)
	d.mu.Unlock()
}

func (d *departures) run(ctx context.Context) {
	t := time.NewTicker(poll)
	defer t.Stop()
	var check []*request
	var conns []net.Conn
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// A request younger than poll is not worth a syscall yet.
		old := time.Now().Add(-poll)
		check, conns = check[:0], conns[:0]
		d.mu.Lock()
		for r, conn := range d.m {
			if r.start.Before(old) {
				check, conns = append(check, r), append(conns, conn)
			}
		}
		d.mu.Unlock()
		for i, r := range check {
			if httpguard.Gone(conns[i]) {
				r.cancel()
			}
		}
	}
}

// begin makes the request's context and registers it with departures.
// The handler ends the departures watch when it returns; the context ends
// with the request (finish), which for a streamed response is when the
// stream ends: from the handler's return on, a client that leaves is
// noticed by the failing write.
func (p *Proxy) begin(c *fiber.Ctx, rid, user, rest string, id auth.Identity) *request {
	// Commands published for the request (a wake, a handshake) carry its id.
	ctx, cancel := context.WithCancel(events.WithTrace(context.Background(), rid))
	info := httpguard.Get(c)
	r := &request{c: c, ctx: ctx, cancel: cancel, rid: rid, method: c.Method(), user: user, rest: rest, id: id,
		host: info.Host, scheme: info.Scheme, origin: info.OnSandboxDomain, start: time.Now()}
	p.departures.add(r, c.Context().Conn())
	return r
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

// uri is the path and query DSH gets.
func (r *request) uri() string {
	q := r.c.Request().URI().QueryString()
	if len(q) == 0 {
		return r.rest
	}
	return r.rest + "?" + string(q)
}
