// Package httpguard holds the rules every request to the edge passes
// through, whichever route answers it: no byte of a request body is ever
// left on the connection to be parsed as the next request (request
// smuggling behind a pooling proxy), no handler panic ends the process,
// TRACE and CONNECT are refused, and the edge's own pages carry the
// headers that keep them from being sniffed, framed or leaking referrers.
//
// It also says who is on the other end of a request, by the rules of the
// deployment's trust boundary: which peers are our own proxies
// (TRUSTED_PROXIES, whose X-Forwarded-For and X-Forwarded-Proto are
// believed) and which host names browsers use to reach us (PUBLIC_HOSTS;
// any other Host is refused with 421). The Policy middleware resolves this
// once per request; IP, Key, Scheme, Host and the origin checks read the
// result.
package httpguard

import (
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/gofiber/fiber/v2"
)

// Bounds of draining what a handler left of a request body: as much as
// arrives within drainTime, up to drainMax.
const (
	drainMax  = 1 << 30
	drainTime = 3 * time.Second
)

// ConsumeBody runs the handler, then reads and drops whatever it left of
// the request body before the response goes out; a body that does not end
// within drainTime (or passes drainMax) closes the connection instead.
// fasthttp streams request bodies and does not skip unread bytes, so
// without this rule the rest of a body that a handler answered without
// reading (a redirect, a logout, an error, a sandbox's early answer) would
// be parsed as the next request on the connection — behind a pooling front,
// a request injected into another client's connection. Draining rather
// than closing keeps the front's pooled connection, and closing a socket
// with unread data makes the kernel reset it, which a front such as nginx,
// still sending the body, reports as a 502 instead of the answer.
func ConsumeBody(c *fiber.Ctx) error {
	err := c.Next()
	drain(c)
	return err
}

func drain(c *fiber.Ctx) {
	n := c.Request().Header.ContentLength()
	if n == 0 || n == -2 { // no body (-2: identity, and nothing to read on a request)
		return
	}
	stream := c.Context().RequestBodyStream()
	if stream == nil {
		return
	}
	_ = c.Context().Conn().SetReadDeadline(time.Now().Add(drainTime))
	read, err := io.Copy(io.Discard, io.LimitReader(stream, drainMax+1))
	if err != nil || read > drainMax {
		c.Context().SetConnectionClose()
	}
}

// Recover turns a handler panic into a 500 for that request alone, logged
// with its method, path and stack; the process and every other request
// carry on.
func Recover(log *slog.Logger) fiber.Handler {
	return func(c *fiber.Ctx) (err error) {
		defer func() {
			if r := recover(); r != nil {
				log.Error("handler panic", "method", c.Method(), "path", c.Path(), "request_id", string(c.Response().Header.Peek("X-Request-Id")),
					"panic", fmt.Sprint(r), "stack", string(debug.Stack()))
				c.Context().SetConnectionClose()
				err = fiber.NewError(fiber.StatusInternalServerError, "internal error")
			}
		}()
		return c.Next()
	}
}

// Methods refuses TRACE and CONNECT everywhere (405): the edge has no use
// for them and must not pass them to a sandbox.
func Methods(c *fiber.Ctx) error {
	switch c.Method() {
	case fiber.MethodTrace, fiber.MethodConnect:
		c.Set(fiber.HeaderAllow, "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
		return fiber.NewError(fiber.StatusMethodNotAllowed, "method not allowed")
	}
	return c.Next()
}

// PageHeaders are the headers of every answer the edge writes itself
// (landing, starting and error pages, JSON): no MIME sniffing, no referrer
// beyond the origin, no framing by anyone. The proxy drops them from a
// sandbox's own answers, which carry DSH's headers instead.
var PageHeaders = map[string]string{
	fiber.HeaderXContentTypeOptions:   "nosniff",
	fiber.HeaderReferrerPolicy:        "strict-origin-when-cross-origin",
	fiber.HeaderContentSecurityPolicy: "frame-ancestors 'none'",
}

// Pages sets PageHeaders on the response before the handler runs.
func Pages(c *fiber.Ctx) error {
	for k, v := range PageHeaders {
		c.Set(k, v)
	}
	return c.Next()
}
