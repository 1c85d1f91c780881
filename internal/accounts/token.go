package accounts

import (
	"context"
	"errors"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// ErrSSOHasNoToken refuses a token change where accounts sign in
// through SSO: there the record's hash binds the account to its SSO
// identity, and no token exists to replace.
var ErrSSOHasNoToken = &Refusal{Status: fiber.StatusConflict, Message: "accounts sign in through single sign-on here; they have no access token to replace"}

// ReplaceToken mints a new bearer token for user and has lifecycle put
// its hash in place of the old one's (on the claim and the record); the
// old token stops working. by says who asked ("user", "admin:<name>").
// The token is returned once, to be shown once; it is never logged or
// stored. Replacements are limited per user as recreations are
// (RECREATE_RATE_LIMIT in AUTH_RATE_WINDOW). Errors are a *Refusal or
// the command's failure.
func (s *Service) ReplaceToken(ctx context.Context, user, by string) (string, error) {
	if s.o.SSO {
		return "", ErrSSOHasNoToken
	}
	acct, found := s.o.Users.Get(user)
	if !found || !acct.Value.DeletingSince.IsZero() {
		return "", &Refusal{Status: fiber.StatusNotFound, Message: "no such account"}
	}
	v, err := s.o.Actions.Allow(ctx, "token:"+user)
	switch {
	case err != nil:
		return "", &Refusal{Status: fiber.StatusServiceUnavailable, Message: auth.ErrUnavailable.Error(), RetryAfter: 2 * time.Second}
	case !v.Allowed:
		return "", &Refusal{Status: fiber.StatusTooManyRequests, Message: "too many token changes; try again later", RetryAfter: v.RetryAfter}
	}
	token := auth.NewToken(user)
	res, err := s.command(ctx, events.NewToken(user, auth.NewRequestID(), auth.HashHex(token), by))
	switch {
	case errors.Is(err, auth.ErrTimeout):
		// Not known to have taken: the old token may still be the one.
		return "", &Refusal{Status: fiber.StatusServiceUnavailable, Message: "the token change did not complete in time; sign in with your current token and try again", RetryAfter: 2 * time.Second}
	case err != nil:
		return "", err
	case res.Outcome != state.OutcomeReplaced:
		return "", errors.New("the token could not be replaced: " + res.Error)
	}
	return token, nil
}

// replaceToken serves POST /_/token: the signed-in user's own new token,
// shown once (JSON, or a page).
func (s *Service) replaceToken(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	if id.TokenName != "" {
		return s.fail(c, fiber.StatusForbidden, "an API token cannot replace the account's token; sign in or use the account's token")
	}
	token, err := s.ReplaceToken(traced(c), id.User, "user")
	var r *Refusal
	switch {
	case errors.As(err, &r):
		return s.refuse(c, r)
	case err != nil:
		return s.fail(c, fiber.StatusServiceUnavailable, err.Error())
	}
	return ShowToken(c, id.User, token, "/")
}

// ShowToken answers with a token shown once: JSON for API clients, a page
// for browsers (back links where to go next). Never cached.
func ShowToken(c *fiber.Ctx, user, token, back string) error {
	c.Set(fiber.HeaderCacheControl, "no-store")
	if wantsJSON(c) {
		return c.JSON(fiber.Map{"user": user, "token": token})
	}
	c.Type("html")
	return web.RenderToken(c, web.Token{User: user, Token: token, Back: back})
}
