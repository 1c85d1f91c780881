package session

import (
	"net/url"
	"strings"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/clientinfo"
)

// sameOrigin reports whether the request's Origin (or, without one, its
// Referer) is this gateway: same scheme and host as the request itself.
// A request with neither is not same-origin.
func sameOrigin(c *fiber.Ctx) bool {
	origin := c.Get(fiber.HeaderOrigin)
	if origin == "" || origin == "null" {
		origin = c.Get(fiber.HeaderReferer)
	}
	if origin == "" {
		return false
	}
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" {
		return false
	}
	return strings.EqualFold(u.Scheme, clientinfo.Scheme(c)) && strings.EqualFold(u.Host, clientinfo.Host(c))
}

// foreignOrigin reports a request that names an origin other than ours;
// a request naming none is not foreign (API clients send neither).
func foreignOrigin(c *fiber.Ctx) bool {
	if c.Get(fiber.HeaderOrigin) == "" && c.Get(fiber.HeaderReferer) == "" {
		return false
	}
	return !sameOrigin(c)
}
