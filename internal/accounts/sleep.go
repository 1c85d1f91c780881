package accounts

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// statusBody is the user's sandbox as /_/status, the status stream and
// the user's page show it: its state and, while it is Ready, what the
// idle rule says (idle.Policy.Decide, the sweeper's own rule): when it was
// last active, whether work is in flight, and when and why it will be
// suspended if nothing changes. Times are whole seconds, so the stream
// speaks when something changed, not every time a beacon arrives.
type statusBody struct {
	User   string `json:"user"`
	Phase  string `json:"phase"`
	Reason string `json:"reason,omitempty"`
	URL    string `json:"url"`
	// Profile is the profile the sandbox is of (PROFILES).
	Profile string `json:"profile"`

	LastActive *time.Time `json:"last_active,omitempty"`
	Busy       bool       `json:"busy,omitempty"`
	// SuspendAt is absent while work is in flight and no ceiling applies.
	SuspendAt     *time.Time `json:"suspend_at,omitempty"`
	SuspendReason string     `json:"suspend_reason,omitempty"`
	// SuspendWhy is SuspendReason in words.
	SuspendWhy     string     `json:"suspend_why,omitempty"`
	KeepAwakeUntil *time.Time `json:"keep_awake_until,omitempty"`
	// LastSuspend is the gateway's last suspend of the sandbox; Slept
	// says it in words.
	LastSuspend *state.Suspension `json:"last_suspend,omitempty"`
	Slept       string            `json:"slept,omitempty"`
}

// statusOf is user's status; url is where their sandbox is reached
// (Sites.SandboxURL of the request asking).
func (s *Service) statusOf(ctx context.Context, user, url string) statusBody {
	st := s.state(ctx, user)
	b := statusBody{User: user, Phase: string(st.Phase), Reason: st.Reason, URL: url, Profile: s.o.Profiles.NameOf(st.Profile), LastSuspend: st.LastSuspend, Slept: web.Slept(st.LastSuspend)}
	if st.Phase != state.PhaseReady || s.o.Activity == nil {
		return b
	}
	now := time.Now()
	// Without the clock the rule cannot say when the sandbox sleeps: the
	// status says what it knows rather than a time made up of Ready alone.
	// Debug, not Warn: a status stream asks twice a second, and NATS out
	// of reach is reported by the process's own readiness and metrics.
	v, err := s.o.Activity.One(ctx, user, now)
	if err != nil {
		s.o.Log.Debug("idle clock not read", "user", user, "err", err)
		return b
	}
	sb := idle.Sandbox{ReadySince: st.ReadySince}
	if k, ok := s.o.KeepAwakes.Load(ctx, user); ok && k.Value.Holds(now) {
		sb.KeepAwakeUntil = k.Value.Until
		b.KeepAwakeUntil = second(k.Value.Until)
	}
	// The rule of the sandbox's profile, as the sweeper decides by it.
	rule := s.o.Profiles.PolicyOf(s.o.Idle, st.Profile)
	d := rule.Decide(v, sb, now)
	b.LastActive, b.Busy = second(d.Last), d.Busy
	if !d.SuspendAt.IsZero() {
		b.SuspendAt, b.SuspendReason, b.SuspendWhy = second(d.SuspendAt), string(d.Reason), d.Reason.Ahead(rule)
	}
	return b
}

// when is web.When of t, "" for none.
func when(t *time.Time) string {
	if t == nil {
		return ""
	}
	return web.When(*t)
}

func second(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC().Truncate(time.Second)
	return &t
}

// keepAwake is POST /_/keepawake (form or JSON field "for": a duration,
// at most MAX_KEEPAWAKE; "0" ends the keep-awake): the sandbox is neither
// suspended for idleness nor stopped at MAX_RUNTIME until then. It is
// audited; the same-origin rule of every cookie-authenticated mutation
// applies.
func (s *Service) keepAwake(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	return s.keepAwakeKey(c, id, id.User)
}

// keepAwakeKey keeps id's sandbox of key awake as the request's "for"
// says.
func (s *Service) keepAwakeKey(c *fiber.Ctx, id auth.Identity, key string) error {
	f, err := web.ReadForm(c, "for")
	if err != nil {
		return s.refuse(c, err)
	}
	d, err := time.ParseDuration(f["for"])
	if f["for"] == "0" {
		d, err = 0, nil
	}
	if err != nil || d < 0 || d > s.o.MaxKeepAwake || d > 0 && d < time.Second {
		return s.refuse(c, web.Refuse(fiber.StatusBadRequest, "for: give a duration from 1s to "+s.o.MaxKeepAwake.String()+" (e.g. 2h), or 0 to end the keep-awake"))
	}
	if st := s.state(httpguard.Context(c), key); d > 0 && st.Phase != state.PhaseReady {
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "your sandbox is "+string(st.Phase)+", not running: open it first, then keep it awake"))
	}
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	now := time.Now().UTC()
	detail := "ended"
	if d == 0 {
		if err := s.o.KeepAwake.Delete(ctx, key, 0); err != nil && !errors.Is(err, kv.ErrNotFound) {
			return s.refuse(c, web.Unavailable(fmt.Errorf("keep-awake not ended: %w", err)))
		}
	} else {
		until := now.Add(d)
		if _, err := s.o.KeepAwake.Put(ctx, key, state.KeepAwake{Until: until, At: now}); err != nil {
			return s.refuse(c, web.Unavailable(fmt.Errorf("keep-awake not stored: %w", err)))
		}
		detail = "until " + until.Format(time.RFC3339) + " (" + d.String() + ")"
		// This edge shows it at once; the others when their caches hear.
		_, _, _ = s.o.KeepAwakes.Wait(ctx, key, func(e kv.Entry[state.KeepAwake], ok bool) bool { return ok && e.Value.Until.Equal(until) })
	}
	if _, name, _ := ident.SplitSandboxKey(key); name != "" {
		detail = "sandbox " + name + ", " + detail
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditKeepAwake, User: id.User, Outcome: "ok", Detail: detail + ", by " + id.Method})
	return s.done(c, key)
}

// suspendNow is POST /_/suspend: the user puts their own sandbox to sleep
// (the reason "user", carried out whatever the activity).
func (s *Service) suspendNow(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	return s.suspendKey(c, id, id.User)
}

// suspendKey asks for the sandbox of key, one of id's, to sleep now.
func (s *Service) suspendKey(c *fiber.Ctx, id auth.Identity, key string) error {
	e, found := s.o.Sandboxes.Load(httpguard.Context(c), key)
	if !found || e.Value.Phase != state.PhaseReady {
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "your sandbox is not running"))
	}
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	if _, err := s.o.Publisher.Command(ctx, events.NewUserSuspend(key, e.Revision)); err != nil {
		return s.refuse(c, web.Unavailable(fmt.Errorf("suspend not published: %w", err)))
	}
	detail := "user: by " + id.Method
	if _, name, _ := ident.SplitSandboxKey(key); name != "" {
		detail = "user: sandbox " + name + ", by " + id.Method
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditSuspend, User: id.User, Outcome: "requested", Detail: detail})
	c.Status(fiber.StatusAccepted)
	return s.done(c, key)
}

// sleep is what the user's page shows of st: the page is rendered with
// it, and the status stream keeps it current.
func (s *Service) sleep(st statusBody) web.Sleep {
	w := web.Sleep{Slept: st.Slept, Busy: st.Busy, Running: st.Phase == string(state.PhaseReady), SuspendWhy: st.SuspendWhy, Dormancy: s.dormancy(st)}
	w.LastActive, w.SuspendAt, w.KeepAwakeUntil = when(st.LastActive), when(st.SuspendAt), when(st.KeepAwakeUntil)
	for _, d := range []time.Duration{time.Hour, 2 * time.Hour, 4 * time.Hour, 8 * time.Hour, 24 * time.Hour} {
		if d <= s.o.MaxKeepAwake {
			w.KeepAwakeFor = append(w.KeepAwakeFor, web.Choice{Value: d.String(), Label: idle.Words(d)})
		}
	}
	if n := len(w.KeepAwakeFor); n == 0 || w.KeepAwakeFor[n-1].Value != s.o.MaxKeepAwake.String() {
		w.KeepAwakeFor = append(w.KeepAwakeFor, web.Choice{Value: s.o.MaxKeepAwake.String(), Label: idle.Words(s.o.MaxKeepAwake)})
	}
	return w
}

// dormancy says what happens to the account if it stays unused, with the
// date when its sandbox sleeps.
func (s *Service) dormancy(st statusBody) string {
	p := s.o.Idle
	if p.DormantAfter <= 0 {
		return ""
	}
	msg := "An account whose sandbox sleeps for " + idle.Words(p.DormantAfter) + " is marked dormant"
	if p.DormantDeleteAfter > 0 {
		msg += " and deleted, files and all, " + idle.Words(p.DormantDeleteAfter) + " later"
	}
	if st.LastSuspend != nil && st.Phase == string(state.PhaseSuspended) {
		if _, at := p.Dormancy(st.LastSuspend.At, time.Now()); !at.IsZero() {
			return msg + ": yours on " + web.When(at) + " unless you open your sandbox before."
		}
	}
	return msg + "; opening your sandbox keeps it."
}

// done answers a page action: its status for API clients, the user's
// page again for a form.
func (s *Service) done(c *fiber.Ctx, user string) error {
	c.Set(fiber.HeaderCacheControl, "no-store")
	if !web.WantsHTML(c) {
		return c.JSON(s.statusOf(httpguard.Context(c), user, s.sites.SandboxURL(c, user)))
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// confirm is GET /_/confirm/recreate and /_/confirm/delete: the page of
// its own that asks before the destructive action, whose form posts to
// the action's endpoint.
func (s *Service) confirm(c *fiber.Ctx) error {
	id, err := s.identity(c)
	if err != nil {
		return s.refuse(c, err)
	}
	d := web.Confirm{User: id.User, Action: c.Params("action")}
	switch d.Action {
	case "recreate":
		d.Path = "/recreate"
		d.Profiles = s.profileChoices(c, id)
		d.Profile = s.o.Profiles.NameOf(s.state(httpguard.Context(c), id.User).Profile)
	case "delete":
		d.Path = "/users/" + id.User + "/delete"
	case "token":
		d.Path = "/_/token"
	default:
		return s.refuse(c, web.Refuse(fiber.StatusNotFound, "no such action"))
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	c.Type("html")
	return web.RenderConfirm(c, d)
}
