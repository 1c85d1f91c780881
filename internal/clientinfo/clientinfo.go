// Package clientinfo says who is on the other end of an edge request, by
// the rules the deployment's trust boundary sets: the ingress in front of
// the edge appends the client address to X-Forwarded-For and states the
// scheme in X-Forwarded-Proto.
package clientinfo

import (
	"net/url"
	"strings"

	"github.com/gofiber/fiber/v2"
)

// IP is the rightmost X-Forwarded-For entry (the one our own ingress
// appended, which a client cannot forge) when present, else the peer
// address.
func IP(c *fiber.Ctx) string {
	if xff := c.Get(fiber.HeaderXForwardedFor); xff != "" {
		parts := strings.Split(xff, ",")
		for i := len(parts) - 1; i >= 0; i-- {
			if p := strings.TrimSpace(parts[i]); p != "" {
				return p
			}
		}
	}
	return c.Context().RemoteIP().String()
}

// Scheme is how the browser reached us: the last X-Forwarded-Proto value
// (set by the TLS-terminating proxy), else plain http.
func Scheme(c *fiber.Ctx) string {
	if p := c.Get(fiber.HeaderXForwardedProto); p != "" {
		parts := strings.Split(p, ",")
		return strings.ToLower(strings.TrimSpace(parts[len(parts)-1]))
	}
	return "http"
}

// Host is the Host header as the browser sent it (with any port).
func Host(c *fiber.Ctx) string { return string(c.Request().Host()) }

// HasBody reports whether the request carries a body (a length or chunks).
func HasBody(c *fiber.Ctx) bool {
	n := c.Request().Header.ContentLength()
	return n > 0 || n == -1
}

// SameOrigin reports whether a request comes from this gateway's own
// pages: its Origin (or, without one, its Referer) has the request's scheme
// and host, or, naming neither, the browser says Sec-Fetch-Site:
// same-origin. A request with none of them is not same-origin.
func SameOrigin(c *fiber.Ctx) bool {
	origin := c.Get(fiber.HeaderOrigin)
	if origin == "" || origin == "null" {
		if c.Get("Sec-Fetch-Site") == "same-origin" {
			return true
		}
		origin = c.Get(fiber.HeaderReferer)
	}
	if origin == "" {
		return false
	}
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" {
		return false
	}
	return strings.EqualFold(u.Scheme, Scheme(c)) && strings.EqualFold(u.Host, Host(c))
}

// ForeignOrigin reports a request that names an origin other than ours;
// one that names none is not foreign (API clients send neither).
func ForeignOrigin(c *fiber.Ctx) bool {
	if c.Get(fiber.HeaderOrigin) == "" && c.Get(fiber.HeaderReferer) == "" && c.Get("Sec-Fetch-Site") == "" {
		return false
	}
	return !SameOrigin(c)
}
