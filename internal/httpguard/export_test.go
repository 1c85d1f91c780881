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
