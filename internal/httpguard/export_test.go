package httpguard

import (
	"time"

	"github.com/gofiber/fiber/v2"
)

// ConsumeBodyWithin is ConsumeBody with its bounds shrunk, so that a test
// can pass the byte bound without sending a gigabyte.
func ConsumeBodyWithin(maxBytes int64, d time.Duration) fiber.Handler {
	return func(c *fiber.Ctx) error { return consumeBody(c, limits{bytes: maxBytes, time: d}) }
}

// InFlight is how many requests p watches for departure.
func InFlight(p *Policy) int {
	p.departures.mu.Lock()
	defer p.departures.mu.Unlock()
	return len(p.departures.m)
}
