package accounts

import (
	"context"
	"errors"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// ErrSSOHasNoToken refuses a token change where accounts sign in
// through SSO: there the record's hash binds the account to its SSO
// identity, and no token exists to replace.
var ErrSSOHasNoToken = &web.Error{Status: fiber.StatusConflict, Detail: "accounts sign in through single sign-on here; they have no access token to replace"}

// ReplaceToken mints a new bearer token for user and has lifecycle put
// its hash in place of the old one's (on the claim and the record); the
// old token stops working. by says who asked ("user", "admin:<name>").
// The token is returned once, to be shown once; it is never logged or
// stored. Replacements are limited per user as recreations are
// (RECREATE_RATE_LIMIT in AUTH_RATE_WINDOW). Errors are a *web.Error or
// the command's failure.
func (s *Service) ReplaceToken(ctx context.Context, user, by string) (string, error) {
	if s.o.SSO {
		return "", ErrSSOHasNoToken
	}
	acct, found := s.o.Users.Load(ctx, user)
	if !found || !acct.Value.DeletingSince.IsZero() {
		return "", &web.Error{Status: fiber.StatusNotFound, Detail: "no such account"}
	}
	v, err := s.o.Actions.Allow(ctx, "token:"+user)
	switch {
	case err != nil:
		return "", web.Unavailable(err)
	case !v.Allowed:
		return "", &web.Error{Status: fiber.StatusTooManyRequests, Detail: "too many token changes; try again later", RetryAfter: v.RetryAfter}
	}
	token := ident.NewToken(user)
	res, err := s.command(ctx, events.NewToken(user, ident.NewAnswerID(), ident.HashHex(token), by))
	switch {
	case errors.Is(err, auth.ErrTimeout):
		// Not known to have taken: the old token may still be the one.
		return "", &web.Error{Status: fiber.StatusServiceUnavailable, Detail: "the token change did not complete in time; sign in with your current token and try again", RetryAfter: 2 * time.Second}
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
		return s.refuse(c, web.Refuse(fiber.StatusForbidden, "an API token cannot replace the account's token; sign in or use the account's token"))
	}
	token, err := s.ReplaceToken(httpguard.Context(c), id.User, "user")
	var r *web.Error
	switch {
	case errors.As(err, &r):
		return s.refuse(c, r)
	case err != nil:
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, err.Error()))
	}
	return web.ShowToken(c, id.User, token, "/")
}
