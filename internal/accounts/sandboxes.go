package accounts

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Named sandboxes (MAX_SANDBOXES_PER_USER above 1): an account's further
// sandboxes beside its first, each reached on its own origin (or path)
// by its key, ident.SandboxKey. Their names are on the account's record,
// which lifecycle keeps; every change is a lifecycle command whose answer
// the request waits for.

// sandboxView is one of the user's sandboxes as their page and GET
// /_/sandboxes show it; Name is "" for the account's first.
type sandboxView struct {
	Name    string `json:"name"`
	URL     string `json:"url"`
	Phase   string `json:"phase"`
	Profile string `json:"profile"`
}

// userSandboxes lists user's sandboxes, the first one first, then the
// named ones in the order they were made, as this edge's caches see them.
func (s *Service) userSandboxes(c *fiber.Ctx, user string) []sandboxView {
	ctx := httpguard.Context(c)
	names := []string{""}
	if u, ok := s.o.Users.Load(ctx, user); ok {
		names = append(names, u.Value.Sandboxes...)
	}
	out := make([]sandboxView, 0, len(names))
	for _, name := range names {
		key := ident.SandboxKey(user, name)
		box := s.state(ctx, key)
		out = append(out, sandboxView{Name: name, URL: s.sites.SandboxURL(c, key), Phase: string(box.Phase), Profile: s.o.Profiles.NameOf(box.Profile)})
	}
	return out
}

// namedOn refuses the named-sandbox endpoints when MAX_SANDBOXES_PER_USER
// is 1 (404: there are none to manage).
func (s *Service) namedOn(c *fiber.Ctx) error {
	if s.o.MaxSandboxes <= 1 {
		return s.refuse(c, web.Refuse(fiber.StatusNotFound, "named sandboxes are not enabled here (MAX_SANDBOXES_PER_USER is 1)"))
	}
	return nil
}

// listSandboxes serves GET /_/sandboxes: the caller's sandboxes.
func (s *Service) listSandboxes(c *fiber.Ctx) error {
	id, err := s.identity(c)
	if err != nil {
		return s.refuse(c, err)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(fiber.Map{"user": id.User, "max": max(s.o.MaxSandboxes, 1), "sandboxes": s.userSandboxes(c, id.User)})
}

// namedChange authenticates a change to one of the caller's named
// sandboxes (its :name) and returns its key: 404 when named sandboxes
// are off, 400 for what is no sandbox name, 404 for one the account does
// not have. ok=false means the refusal has been written.
func (s *Service) namedChange(c *fiber.Ctx) (id auth.Identity, key string, ok bool, err error) {
	return s.named(c, s.mutation)
}

// namedRead is namedChange for a request that reads: any of the caller's
// credentials will do, from anywhere.
func (s *Service) namedRead(c *fiber.Ctx) (id auth.Identity, key string, ok bool, err error) {
	return s.named(c, func(c *fiber.Ctx) (auth.Identity, bool, error) {
		id, err := s.identity(c)
		if err != nil {
			return id, false, s.refuse(c, err)
		}
		return id, true, nil
	})
}

func (s *Service) named(c *fiber.Ctx, authenticate func(*fiber.Ctx) (auth.Identity, bool, error)) (id auth.Identity, key string, ok bool, err error) {
	if err := s.namedOn(c); err != nil {
		return id, "", false, err
	}
	if id, ok, err = authenticate(c); !ok {
		return id, "", false, err
	}
	name := c.Params("name")
	if err := ident.ValidateSandboxName(name); err != nil {
		return id, "", false, s.refuse(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	if u, found := s.o.Users.Load(httpguard.Context(c), id.User); !found || !slices.Contains(u.Value.Sandboxes, name) {
		return id, "", false, s.refuse(c, web.Refuse(fiber.StatusNotFound, "you have no sandbox called "+name))
	}
	return id, ident.SandboxKey(id.User, name), true, nil
}

// createSandbox serves POST /_/sandboxes (name, and profile: "" for the
// default): a new named sandbox, made of a warm-pool spare when there is
// one. 400 for a bad name or unknown profile, 403 for a profile the user
// may not choose, 409 at MAX_SANDBOXES_PER_USER or for a name in use;
// none of them makes anything.
func (s *Service) createSandbox(c *fiber.Ctx) error {
	if err := s.namedOn(c); err != nil {
		return err
	}
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	f, err := web.ReadForm(c, "name", "profile")
	if err != nil {
		return s.refuse(c, err)
	}
	name := f["name"]
	if err := ident.ValidateSandboxName(name); err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	profile, err := s.chosenProfile(c, id, f["profile"])
	if err != nil {
		return s.refuse(c, err)
	}
	u, found := s.o.Users.Load(httpguard.Context(c), id.User)
	switch {
	case !found || u.Value.ClaimUID == "":
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, "your account is not ready yet; try again shortly"))
	case slices.Contains(u.Value.Sandboxes, name):
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "you have a sandbox called "+name+" already"))
	case 1+len(u.Value.Sandboxes) >= s.o.MaxSandboxes:
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "you have "+strconv.Itoa(s.o.MaxSandboxes)+" sandboxes, the most allowed; delete one first"))
	}
	key := ident.SandboxKey(id.User, name)
	// Of the account's record revision: a double click asks once.
	res, ok, err := s.sandboxAction(c, id.User, events.NewSandbox(key, fmt.Sprintf("sandbox-%s-%d-%s", key, u.Revision, profile), profile))
	if !ok {
		return err
	}
	if res.Outcome != state.OutcomeCreated {
		return s.refuse(c, failed(res, "the sandbox could not be made"))
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditClaim, User: id.User, Outcome: "requested", Detail: "sandbox " + name + ", by " + id.Method})
	if !web.WantsHTML(c) {
		return c.Status(fiber.StatusCreated).JSON(fiber.Map{"user": id.User, "name": name, "url": s.sites.SandboxURL(c, key), "profile": s.o.Profiles.NameOf(profile)})
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// deleteSandbox serves DELETE /_/sandboxes/:name (and POST …/delete from
// the page): the sandbox, its volume and its records go; the account and
// its other sandboxes stay.
func (s *Service) deleteSandbox(c *fiber.Ctx) error {
	id, key, ok, err := s.namedChange(c)
	if !ok {
		return err
	}
	if ok, err := s.namedAction(c, key, events.VerbDelete, "", state.OutcomeDeleted); !ok {
		return err
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditDelete, User: id.User, Outcome: "requested", Detail: "sandbox " + c.Params("name") + ", by " + id.Method})
	if !web.WantsHTML(c) || c.Method() == fiber.MethodDelete {
		return c.SendStatus(fiber.StatusNoContent)
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// recreateSandbox serves POST /_/sandboxes/:name/recreate (profile
// optional: "" keeps the sandbox's): a fresh sandbox and volume under the
// same name.
func (s *Service) recreateSandbox(c *fiber.Ctx) error {
	id, key, ok, err := s.namedChange(c)
	if !ok {
		return err
	}
	profile, err := s.recreateProfile(c, id)
	if err != nil {
		return s.refuse(c, err)
	}
	if ok, err := s.namedAction(c, key, events.VerbRecreate, profile, state.OutcomeRecreated); !ok {
		return err
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditRecreate, User: id.User, Outcome: "requested", Detail: "sandbox " + c.Params("name") + ", by " + id.Method})
	if !web.WantsHTML(c) {
		return c.Status(fiber.StatusAccepted).JSON(fiber.Map{"user": id.User, "name": c.Params("name"), "state": string(s.state(httpguard.Context(c), key).Phase)})
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// suspendSandbox serves POST /_/sandboxes/:name/suspend: the user puts
// that sandbox to sleep, as /_/suspend does their first.
func (s *Service) suspendSandbox(c *fiber.Ctx) error {
	id, key, ok, err := s.namedChange(c)
	if !ok {
		return err
	}
	return s.suspendKey(c, id, key)
}

// sandboxAction publishes cmd, a new sandbox of user's, and waits for its
// answer; the account's action limit (RECREATE_RATE_LIMIT) counts it, as
// each costs a pod and a volume (Act does the same for the rest).
// ok=false means a refusal has been written.
func (s *Service) sandboxAction(c *fiber.Ctx, user string, cmd events.Command) (state.Result, bool, error) {
	ctx := ident.WithRequestID(context.Background(), httpguard.RequestID(c))
	v, err := s.o.Actions.Allow(ctx, "account:"+user)
	switch {
	case err != nil:
		return state.Result{}, false, s.refuse(c, web.Unavailable(err))
	case !v.Allowed:
		return state.Result{}, false, s.refuse(c, &web.Error{Status: fiber.StatusTooManyRequests, Detail: "too many changes to your sandboxes; wait and try again", RetryAfter: v.RetryAfter})
	}
	res, err := s.command(ctx, cmd)
	if err != nil {
		return state.Result{}, false, s.refuse(c, err)
	}
	return res, true, nil
}

// namedAction runs a delete or recreate of the named sandbox of key (Act)
// and wants outcome; ok=false means a refusal has been written.
func (s *Service) namedAction(c *fiber.Ctx, key string, verb events.Verb, profile, outcome string) (bool, error) {
	res, ok, err := s.accountAction(c, key, verb, profile)
	switch {
	case !ok:
		return false, err
	case err != nil:
		return false, s.refuse(c, web.Unavailable(err))
	case res.Outcome != outcome:
		return false, s.refuse(c, failed(res, "the sandbox's "+string(verb)+" did not go through"))
	}
	return true, nil
}

// failed is the refusal of a command lifecycle answered otherwise than
// asked: 409 for a conflict (the cap, a name in use), else 503.
func failed(res state.Result, what string) *web.Error {
	status := fiber.StatusServiceUnavailable
	if res.Outcome == state.OutcomeConflict {
		status = fiber.StatusConflict
	}
	return &web.Error{Status: status, Detail: what + ": " + res.Error}
}

// routeSandboxes mounts the named sandboxes' endpoints.
func (s *Service) routeSandboxes(app *fiber.App) {
	app.Get("/_/sandboxes", s.listSandboxes)
	app.Post("/_/sandboxes", s.createSandbox)
	app.Delete("/_/sandboxes/:name", s.deleteSandbox)
	app.Post("/_/sandboxes/:name/delete", s.deleteSandbox)
	app.Post("/_/sandboxes/:name/recreate", s.recreateSandbox)
	app.Post("/_/sandboxes/:name/suspend", s.suspendSandbox)
	app.Post("/_/sandboxes/:name/keepawake", s.keepAwakeSandbox)
	app.Get("/_/sandboxes/:name/status", s.sandboxStatus)
	app.Get("/_/sandboxes/:name/status/stream", s.sandboxStatusStream)
}

// keepAwakeSandbox is POST /_/sandboxes/<name>/keepawake: /_/keepawake
// for a named sandbox; the user's others are not kept awake.
func (s *Service) keepAwakeSandbox(c *fiber.Ctx) error {
	id, key, ok, err := s.namedChange(c)
	if !ok {
		return err
	}
	return s.keepAwakeKey(c, id, key)
}

// sandboxStatus is GET /_/sandboxes/<name>/status: /_/status of a named
// sandbox.
func (s *Service) sandboxStatus(c *fiber.Ctx) error {
	_, key, ok, err := s.namedRead(c)
	if !ok {
		return err
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(s.statusOf(httpguard.Context(c), key, s.sites.SandboxURL(c, key)))
}

// sandboxStatusStream is GET /_/sandboxes/<name>/status/stream: the
// status stream of a named sandbox.
func (s *Service) sandboxStatusStream(c *fiber.Ctx) error {
	id, key, ok, err := s.namedRead(c)
	if !ok {
		return err
	}
	return s.streamStatus(c, id, key)
}
