package web

import (
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/url"
	"slices"

	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/gofiber/fiber/v2"
)

// formLimit bounds the body of every account endpoint; a user name, an
// invite code and a token fit many times over.
const formLimit = 8 << 10

// ReadForm reads a small urlencoded or JSON body into fields, refusing
// oversize bodies, other content types and unknown fields; a refusal is an *Error.
func ReadForm(c *fiber.Ctx, fields ...string) (map[string]string, error) {
	if n := c.Request().Header.ContentLength(); n > formLimit {
		return nil, Refuse(fiber.StatusRequestEntityTooLarge, "request body too large")
	}
	mt, _, _ := mime.ParseMediaType(c.Get(fiber.HeaderContentType))
	if mt != fiber.MIMEApplicationForm && mt != fiber.MIMEApplicationJSON {
		return nil, Refuse(fiber.StatusUnsupportedMediaType, "send application/x-www-form-urlencoded or application/json")
	}
	body, err := io.ReadAll(io.LimitReader(httpguard.Body(c), formLimit+1))
	if err != nil {
		return nil, Refuse(fiber.StatusBadRequest, "could not read the request body")
	}
	if len(body) > formLimit {
		return nil, Refuse(fiber.StatusRequestEntityTooLarge, "request body too large")
	}
	out := map[string]string{}
	if mt == fiber.MIMEApplicationJSON {
		raw := map[string]json.RawMessage{}
		if err := json.Unmarshal(body, &raw); err != nil {
			return nil, Refuse(fiber.StatusBadRequest, "malformed JSON")
		}
		for k, v := range raw {
			if !slices.Contains(fields, k) {
				return nil, Refuse(fiber.StatusBadRequest, fmt.Sprintf("unknown field %q", k))
			}
			var str string
			if err := json.Unmarshal(v, &str); err != nil {
				return nil, Refuse(fiber.StatusBadRequest, fmt.Sprintf("field %q must be a string", k))
			}
			out[k] = str
		}
		return out, nil
	}
	vals, err := url.ParseQuery(string(body))
	if err != nil {
		return nil, Refuse(fiber.StatusBadRequest, "malformed form")
	}
	for k, v := range vals {
		if !slices.Contains(fields, k) {
			return nil, Refuse(fiber.StatusBadRequest, fmt.Sprintf("unknown field %q", k))
		}
		if len(v) != 1 {
			return nil, Refuse(fiber.StatusBadRequest, fmt.Sprintf("field %q given %d times", k, len(v)))
		}
		out[k] = v[0]
	}
	return out, nil
}
