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
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/gofiber/fiber/v2"
)

// Bounds of draining what a handler left of a request body: as much as
// arrives within drainTime, up to drainMax.
const (
	drainMax  = 1 << 30
	drainTime = 3 * time.Second
)

// limits bound one drain (tests shrink them).
type limits struct {
	bytes int64
	time  time.Duration
}

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
//
// A request naming a Transfer-Encoding other than chunked is refused (501)
// and its connection closed: fasthttp refuses most, but ignores
// "identity" and frames the body by its Content-Length or as none, so the
// bytes a front that reads the coding otherwise sends as body would be
// parsed as the next request. A request that declares both Content-Length
// and chunked encoding is read as chunked (fasthttp, as RFC 9112 §6.3
// says) and its connection is closed after the answer, as the RFC requires
// of a server: a front that framed it by Content-Length may have sent more
// in the same body, which must never be read as a request.
func ConsumeBody(c *fiber.Ctx) error { return consumeBody(c, limits{bytes: drainMax, time: drainTime}) }

func consumeBody(c *fiber.Ctx, l limits) error {
	if _, unknown := framing(c.Request().Header.RawHeaders()); unknown {
		c.Context().SetConnectionClose()
		return fiber.NewError(fiber.StatusNotImplemented, "transfer codings other than chunked are not implemented")
	}
	err := c.Next()
	drain(c, l)
	return err
}

func drain(c *fiber.Ctx, l limits) {
	n := c.Request().Header.ContentLength()
	if n == 0 || n == -2 { // no body (-2: identity, and nothing to read on a request)
		return
	}
	if length, _ := framing(c.Request().Header.RawHeaders()); n == -1 && length {
		c.Context().SetConnectionClose()
	}
	if int64(n) > l.bytes {
		// More than a drain would read: close now rather than read the
		// bound first.
		c.Context().SetConnectionClose()
		return
	}
	stream := Body(c)
	if stream == nil {
		return
	}
	_ = c.Context().Conn().SetReadDeadline(time.Now().Add(l.time))
	read, err := io.Copy(io.Discard, io.LimitReader(stream, l.bytes+1))
	if err != nil || read > l.bytes {
		c.Context().SetConnectionClose()
	}
}

var (
	contentLength    = []byte("content-length")
	transferEncoding = []byte("transfer-encoding")
	chunked          = []byte("chunked")
)

// framing reads raw request headers (as they arrived, "Name: value"
// lines) for what fasthttp's parse hides: whether they declare a
// Content-Length (dropped from a chunked request) and whether a
// Transfer-Encoding names a coding other than chunked.
func framing(raw []byte) (length, unknownCoding bool) {
	for len(raw) > 0 {
		var line []byte
		line, raw, _ = bytes.Cut(raw, []byte("\n"))
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		switch name = bytes.TrimSpace(name); {
		case bytes.EqualFold(name, contentLength):
			length = true
		case bytes.EqualFold(name, transferEncoding) && !bytes.EqualFold(bytes.TrimSpace(value), chunked):
			unknownCoding = true
		}
	}
	return length, unknownCoding
}

// Body is the request's body stream, for a handler that reads the body
// itself; read it here, not from fasthttp's RequestBodyStream. fasthttp's
// reader of a chunked body does not remember that it ended: a read after
// its end (the drain's) parses the next request's bytes as a chunk size,
// or with none sent yet waits for them until drainTime, and the
// connection is closed. This one answers io.EOF again instead.
func Body(c *fiber.Ctx) io.Reader {
	if b, ok := c.Locals(bodyKey).(*body); ok {
		return b
	}
	stream := c.Context().RequestBodyStream()
	if stream == nil {
		return nil
	}
	b := &body{r: stream}
	c.Locals(bodyKey, b)
	return b
}

const bodyKey = "aaas.body"

// body is a body stream that ends for good at its first io.EOF.
type body struct {
	r    io.Reader
	done bool
}

func (b *body) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	n, err := b.r.Read(p)
	b.done = errors.Is(err, io.EOF)
	return n, err
}

// Recover turns a handler panic into a 500 for that request alone, logged
// with its method, path and stack; the process and every other request
// carry on.
func Recover(log *slog.Logger) fiber.Handler {
	return func(c *fiber.Ctx) (err error) {
		defer func() {
			if r := recover(); r != nil {
				log.Error("handler panic", "method", c.Method(), "path", c.Path(), "request_id", RequestID(c),
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
// beyond the origin, no framing by anyone. A sandbox's own answers carry
// DSH's headers instead (TenantAnswer).
var PageHeaders = []struct{ Name, Value string }{
	{fiber.HeaderXContentTypeOptions, "nosniff"},
	{fiber.HeaderReferrerPolicy, "strict-origin-when-cross-origin"},
	{fiber.HeaderContentSecurityPolicy, "frame-ancestors 'none'"},
}

// pageHeaders are PageHeaders as fasthttp sets them without normalizing.
var pageHeaders = func() (kv [][2][]byte) {
	for _, h := range PageHeaders {
		kv = append(kv, [2][]byte{[]byte(h.Name), []byte(h.Value)})
	}
	return kv
}()

// Pages sets PageHeaders on the answer once the handler has returned
// (error pages, which Access writes after, keep them), unless the answer
// is a sandbox's own: set after, not before and taken off again, so a
// proxied answer costs nothing here.
func Pages(c *fiber.Ctx) error {
	err := c.Next()
	if s := scopeOf(c); s == nil || !s.tenant {
		for _, h := range pageHeaders {
			c.Response().Header.SetCanonical(h[0], h[1])
		}
	}
	return err
}

// TenantAnswer says the answer is a sandbox's own (the proxy's): Pages
// leaves it alone.
func TenantAnswer(c *fiber.Ctx) { scopeFor(c).tenant = true }

// HSTS sets Strict-Transport-Security (max-age maxAge) on every answer
// to a request that reached the gateway over HTTPS, the edge's pages and
// proxied answers alike (a sandbox's own HSTS never passes), so it runs
// after Policy.Middleware, whose TRUSTED_PROXIES rules say which requests
// did. Never over plain HTTP: browsers ignore it there, and the edge
// would be pinning a host it was not reached securely by. maxAge 0 sets
// none.
func HSTS(maxAge time.Duration) fiber.Handler {
	value := "max-age=" + strconv.FormatInt(int64(maxAge/time.Second), 10)
	return func(c *fiber.Ctx) error {
		if maxAge > 0 && Scheme(c) == "https" {
			c.Set(fiber.HeaderStrictTransportSecurity, value)
		}
		return c.Next()
	}
}
