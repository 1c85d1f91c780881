package proxy

import (
	"context"
	"errors"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/aaas-project/aaas/internal/web"
	"github.com/gofiber/fiber/v2"
)

// Previews: the web apps agents start in their sandboxes (dev servers on
// 3000, 5173, 8000 …), each served on an origin of its own,
// <port>-<user>.<SANDBOX_DOMAIN>, so that an app can no more script the
// gateway or its user's DSH than DSH's pages can. A preview takes the DSH
// origin's path through the proxy (the same admission, limits, wake on
// connect, streaming, WebSockets and response hygiene) with three
// differences: it goes to the pod's address at the preview's port; it
// carries no DSH cookie and needs no handshake (the app is the tenant's,
// and has no business with DSH's credentials); and the app's answers are
// its own, a 401 included, never read as a refused cookie.

// servePreview serves a request on user's preview host for port: 404 for
// a port PREVIEW_PORTS does not list (nothing is proxied, no sign-in is
// asked for), otherwise the request with its whole path as it arrived.
func (p *Proxy) servePreview(c *fiber.Ctx, user, raw string, port int, ws bool) error {
	if _, ok := slices.BinarySearch(p.o.PreviewPorts, port); !ok {
		return p.refuse(c, ws, p.unlistedPort(port))
	}
	return p.serveUser(c, user, raw, port, ws)
}

// unlistedPort is the 404 for a preview of a port that is not listed.
func (p *Proxy) unlistedPort(port int) *web.Error {
	detail := "Previews are off on this gateway (PREVIEW_PORTS is empty)."
	if len(p.o.PreviewPorts) > 0 {
		ports := make([]string, len(p.o.PreviewPorts))
		for i, n := range p.o.PreviewPorts {
			ports[i] = strconv.Itoa(n)
		}
		detail = "Port " + strconv.Itoa(port) + " is not a preview port of this gateway; apps are previewed on port " + strings.Join(ports, ", ") + "."
	}
	return &web.Error{Status: http.StatusNotFound, Title: "No preview on port " + strconv.Itoa(port), Detail: detail}
}

// resolve is where r goes: DSH, with its cookie, or the preview's port on
// the sandbox's address, without one.
func (p *Proxy) resolve(r *request, wait bool) (Upstream, error) {
	if r.port == 0 {
		return p.resolver.Resolve(r.ctx, r.target(), wait)
	}
	return p.resolver.Preview(r.ctx, r.user, r.port, wait, background(r.c))
}

// Preview returns the upstream of user's preview on port: the sandbox's
// address (waking it as Resolve does) at that port, with no cookie.
func (r *Resolver) Preview(ctx context.Context, user string, port int, wait, background bool) (Upstream, error) {
	box, err := r.ready(ctx, user, wait, background)
	if err != nil {
		return Upstream{}, err
	}
	if err := r.fresh(); err != nil {
		return Upstream{}, err
	}
	host, _, err := net.SplitHostPort(box.Address)
	if err != nil {
		return Upstream{}, err
	}
	// Host localhost:<port>: dev servers refuse other names unless told
	// to (Vite's allowedHosts); the browser's is in X-Forwarded-Host.
	return Upstream{Address: net.JoinHostPort(host, strconv.Itoa(port)), PodUID: box.PodUID, Host: "localhost:" + strconv.Itoa(port)}, nil
}

// Exists reports whether user has a sandbox record: an account's is
// written at its signup, so a preview of a name without one would only
// wait for it.
func (r *Resolver) Exists(ctx context.Context, user string) bool {
	_, ok := r.Sandboxes.Load(ctx, user)
	return ok
}

// unreachable names a preview's transport failure for what it is to the
// user: nothing listening on the port (a refused or unanswered connect),
// or an app that did not answer properly. DSH's failures pass as they are.
func (r *request) unreachable(err error) error {
	var pe *web.Error
	if r.port == 0 || r.ctx.Err() != nil || errors.As(err, &pe) {
		return err
	}
	port := strconv.Itoa(r.port)
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Op == "dial" {
		return &web.Error{Status: http.StatusBadGateway, Title: "Nothing listening on port " + port,
			Detail: "Nothing is listening on port " + port + " in your sandbox. Start your app on port " + port +
				", listening on all addresses (0.0.0.0, e.g. vite --host), not only localhost, then reload.", Cause: err}
	}
	return &web.Error{Status: http.StatusBadGateway, Title: "Preview unreachable",
		Detail: "The app on port " + port + " in your sandbox did not answer properly. Try again in a moment.", Cause: err}
}
