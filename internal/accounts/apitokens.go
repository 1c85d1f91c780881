package accounts

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// APITokens are users' named API tokens: the bucket, written and listed
// by user (a user's page, a new token's count), the cache the
// authentication reads, and how many one user may hold.
type APITokens struct {
	Bucket  *kv.Bucket[state.APIToken]
	Cache   *kv.Cache[state.APIToken]
	MaxEach int
}

// maxTokenDays bounds an API token's life when one is given.
const maxTokenDays = 3650

// tokenView is an API token as its user sees it: never the token.
type tokenView struct {
	Name    string    `json:"name"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires,omitzero"`
}

// userTokens lists user's API tokens that hold now, by name: read from
// the bucket (their keys, "<user>.*"), where any edge may have made or
// deleted one a moment ago, and the edge holds only the tokens it has
// authenticated.
func (s *Service) userTokens(ctx context.Context, user string) ([]tokenView, error) {
	es, err := s.o.APITokens.Bucket.List(ctx, state.APITokenKey(user, "*"))
	if err != nil {
		return nil, web.Unavailable(fmt.Errorf("API tokens not listed: %w", err))
	}
	out := []tokenView{}
	u, _ := s.o.Users.Load(ctx, user)
	now := time.Now()
	for _, e := range es {
		if t := e.Value; t.User == user && e.Key == state.APITokenKey(user, t.Name) && t.Holds(u.Value, now) {
			out = append(out, tokenView{Name: t.Name, Created: t.Created, Expires: t.Expires})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// tokenManager is the identity of a request that may manage its
// account's API tokens: signed in with a session, SSO or the account's
// own token, never with an API token (a leaked one must not mint more).
func (s *Service) tokenManager(c *fiber.Ctx) (auth.Identity, bool, error) {
	if s.o.APITokens == nil {
		return auth.Identity{}, false, s.refuse(c, web.Refuse(fiber.StatusNotFound, "API tokens are not enabled here"))
	}
	id, ok, err := s.mutation(c)
	if !ok {
		return id, false, err
	}
	if id.TokenName != "" {
		return id, false, s.refuse(c, web.Refuse(fiber.StatusForbidden, "an API token cannot manage tokens; sign in or use the account's token"))
	}
	return id, true, nil
}

// listTokens serves GET /_/tokens: the caller's API tokens.
func (s *Service) listTokens(c *fiber.Ctx) error {
	if s.o.APITokens == nil {
		return s.refuse(c, web.Refuse(fiber.StatusNotFound, "API tokens are not enabled here"))
	}
	id, err := s.identity(c)
	if err != nil {
		return s.refuse(c, err)
	}
	tokens, err := s.userTokens(httpguard.Context(c), id.User)
	if err != nil {
		return s.refuse(c, err)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(fiber.Map{"user": id.User, "tokens": tokens})
}

// createToken serves POST /_/tokens (name, and expires_days: none for a
// token that does not expire): a new API token, shown once.
func (s *Service) createToken(c *fiber.Ctx) error {
	id, ok, err := s.tokenManager(c)
	if !ok {
		return err
	}
	f, err := web.ReadForm(c, "name", "expires_days")
	if err != nil {
		return s.refuse(c, err)
	}
	name := f["name"]
	if err := ident.ValidateTokenName(name); err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	now := time.Now().UTC()
	var ttl time.Duration
	if d := f["expires_days"]; d != "" {
		n, err := strconv.Atoi(d)
		if err != nil || n < 1 || n > maxTokenDays {
			return s.refuse(c, web.Refuse(fiber.StatusBadRequest, "expires_days is 1 to "+strconv.Itoa(maxTokenDays)+", or empty for a token that does not expire"))
		}
		ttl = time.Duration(n) * 24 * time.Hour
	}
	u, found := s.o.Users.Load(httpguard.Context(c), id.User)
	if !found || u.Value.ClaimUID == "" {
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, "your account is not ready yet; try again shortly"))
	}
	held, err := s.userTokens(httpguard.Context(c), id.User)
	if err != nil {
		return s.refuse(c, err)
	}
	if len(held) >= s.o.APITokens.MaxEach {
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "you hold "+strconv.Itoa(s.o.APITokens.MaxEach)+" API tokens, the most allowed; delete one first"))
	}
	token := ident.NewAPIToken(id.User, name)
	rec := state.APIToken{User: id.User, Name: name, Hash: ident.HashHex(token), ClaimUID: u.Value.ClaimUID, Created: now}
	var opts []kv.WriteOption
	if ttl > 0 {
		rec.Expires = now.Add(ttl)
		opts = append(opts, kv.WithTTL(ttl))
	}
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	// Create, not Put: a name in use (or one that lapsed but whose marker
	// stays) is refused rather than silently replaced.
	rev, err := s.o.APITokens.Bucket.Create(ctx, state.APITokenKey(id.User, name), rec, opts...)
	switch {
	case errors.Is(err, kv.ErrExists):
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "you have a token called "+name+" already; delete it first or choose another name"))
	case err != nil:
		return s.refuse(c, web.Unavailable(fmt.Errorf("API token not stored: %w", err)))
	}
	s.o.APITokens.Cache.Note(state.APITokenKey(id.User, name), rec, rev)
	detail := "name " + name + ", by " + id.Method
	if ttl > 0 {
		detail += ", expires " + rec.Expires.Format(time.RFC3339)
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditToken, User: id.User, Outcome: "created", Detail: detail})
	c.Set(fiber.HeaderCacheControl, "no-store")
	if !web.WantsHTML(c) {
		return c.Status(fiber.StatusCreated).JSON(fiber.Map{"user": id.User, "name": name, "token": token, "expires": rec.Expires})
	}
	return web.ShowToken(c, id.User, token, "/")
}

// deleteToken serves DELETE /_/tokens/:name (and POST …/delete from a
// form): the token stops working on every edge.
func (s *Service) deleteToken(c *fiber.Ctx) error {
	id, ok, err := s.tokenManager(c)
	if !ok {
		return err
	}
	name := c.Params("name")
	if err := ident.ValidateTokenName(name); err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	key := state.APITokenKey(id.User, name)
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	switch _, err := s.o.APITokens.Bucket.Get(ctx, key); {
	case errors.Is(err, kv.ErrNotFound):
		return s.refuse(c, web.Refuse(fiber.StatusNotFound, "you have no token called "+name))
	case err != nil:
		return s.refuse(c, web.Unavailable(fmt.Errorf("API token not read: %w", err)))
	}
	if err := s.o.APITokens.Bucket.Purge(ctx, key); err != nil {
		return s.refuse(c, web.Unavailable(fmt.Errorf("API token not deleted: %w", err)))
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditToken, User: id.User, Outcome: "deleted", Detail: "name " + name + ", by " + id.Method})
	if !web.WantsHTML(c) || c.Method() == fiber.MethodDelete {
		return c.SendStatus(fiber.StatusNoContent)
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// routeTokens mounts the API token endpoints.
func (s *Service) routeTokens(app *fiber.App) {
	app.Get("/_/tokens", s.listTokens)
	app.Post("/_/tokens", s.createToken)
	app.Delete("/_/tokens/:name", s.deleteToken)
	app.Post("/_/tokens/:name/delete", s.deleteToken)
}
