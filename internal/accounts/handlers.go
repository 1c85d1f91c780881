package accounts

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/valyala/fasthttp"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// landing is the home page: the user's own page when signed in, else the
// sign-up and sign-in forms. Not being signed in (401) is the forms; a
// refusal (an SSO user AUTH_PROXY_ALLOW does not admit, 403) or a bus
// that cannot answer (503) is said above them, with its status, or the
// refused would be asked to sign in again with no reason given.
func (s *Service) landing(c *fiber.Ctx) error {
	d := web.Landing{Invite: s.o.InviteCode != "", SSO: s.o.SSO, MaxUserLen: ident.MaxUserLen}
	id, err := s.identity(c)
	d.Profiles = s.profileChoices(c, id)
	switch {
	case err == nil:
		d.User, d.Sandbox = id.User, s.sites.SandboxURL(c, id.User)
		st := s.statusOf(httpguard.Context(c), id.User, d.Sandbox)
		d.Phase, d.Reason, d.Sleep, d.Profile = st.Phase, st.Reason, s.sleep(st), st.Profile
		d.Models = s.landingModels(httpguard.Context(c), id.User)
		if s.o.MaxSandboxes > 1 {
			for _, v := range s.userSandboxes(c, id.User) {
				d.Sandboxes = append(d.Sandboxes, web.Sandbox(v))
			}
			d.MaxSandboxes, d.MaxSandboxNameLen, d.MoreSandboxes = s.o.MaxSandboxes, ident.MaxSandboxNameLen, len(d.Sandboxes) < s.o.MaxSandboxes
		}
		if s.o.APITokens != nil && id.TokenName == "" {
			// Shown only when listed: an empty list read from a bus that
			// did not answer would say the user has none.
			tokens, err := s.userTokens(httpguard.Context(c), id.User)
			if err != nil {
				s.o.Log.Warn("API tokens not listed for the user's page", "user", id.User, "err", err)
			}
			d.TokensOn = err == nil
			for _, t := range tokens {
				v := web.APIToken{Name: t.Name, Created: t.Created.Format(time.DateOnly), Expires: "never"}
				if !t.Expires.IsZero() {
					v.Expires = t.Expires.Format(time.DateOnly)
				}
				d.APITokens = append(d.APITokens, v)
			}
		}
	case web.AsError(err).Status != fiber.StatusUnauthorized:
		// Signed in elsewhere but refused here (SSO not allowed, the bus
		// away): the page says why, with the status and Retry-After an
		// error page would have.
		e := web.AsError(err)
		d.Error, d.SignOut = e.Detail, s.o.SignOutURL
		c.Status(e.Status)
		web.SetRetryAfter(c, e)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	c.Type("html")
	return web.RenderLanding(c, d)
}

// state is the user's sandbox record as they should see it (Queued while
// their wake waits for a place), or Claiming before the first one.
func (s *Service) state(ctx context.Context, user string) state.Sandbox {
	e, ok := s.o.Sandboxes.Load(ctx, user)
	if !ok {
		return state.Sandbox{User: user, Phase: state.PhaseClaiming}
	}
	return s.o.Queue.Describe(e.Value)
}

// signup: rate limit, origin, size, type, invite and name checks come
// before anything is created; then the claim command, its answer, a
// session, and up to WAKE_TIMEOUT for the sandbox to be Ready.
func (s *Service) signup(c *fiber.Ctx) error {
	if s.o.SSO {
		return s.refuse(c, web.Refuse(fiber.StatusForbidden, "accounts are created by signing in through SSO"))
	}
	if ok, err := s.limit(c, "signup"); !ok {
		return err
	}
	if httpguard.ForeignOrigin(c) {
		return s.refuse(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
	}
	f, err := web.ReadForm(c, "user", "invite", "profile")
	if err != nil {
		return s.refuse(c, err)
	}
	if s.o.InviteCode != "" {
		invite := f["invite"]
		if invite == "" {
			invite = c.Get("X-Signup-Invite")
		}
		if !auth.SecretEqual(invite, s.o.InviteCode) {
			s.o.Auth.Counter().WithLabelValues("signup", "invite_rejected").Inc()
			s.o.Auth.Refused(c, events.AuditEvent{Kind: events.AuditInviteRejected})
			return s.refuse(c, web.Refuse(fiber.StatusForbidden, "a valid invite code is required to sign up"))
		}
	}
	user := f["user"]
	if err := ident.ValidateUser(user); err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	profile, err := s.chosenProfile(c, auth.Identity{}, f["profile"])
	if err != nil {
		return s.refuse(c, err)
	}
	if _, ok := s.o.Users.Load(httpguard.Context(c), user); ok {
		s.o.Auth.Counter().WithLabelValues("signup", "conflict").Inc()
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "that user name is taken; sign in with your token instead"))
	}
	if full, err := s.full(httpguard.Context(c)); err != nil {
		return s.refuse(c, web.Unavailable(err))
	} else if full {
		s.o.Auth.Counter().WithLabelValues("signup", "full").Inc()
		return s.refuse(c, web.Refuse(fiber.StatusForbidden, errFull(s.o.MaxUsers)))
	}

	start := time.Now()
	token := ident.NewToken(user)
	req := ident.NewAnswerID()
	res, err := s.command(httpguard.Context(c), events.NewClaim(user, req, ident.HashHex(token), profile))
	switch {
	case errors.Is(err, auth.ErrTimeout) && !web.WantsHTML(c):
		// The claim may still succeed: hand out the token now, as it will
		// never be shown again.
		s.o.Auth.Counter().WithLabelValues("signup", "accepted").Inc()
		return c.Status(fiber.StatusAccepted).JSON(fiber.Map{"user": user, "token": token, "url": s.sites.SandboxURL(c, user), "state": "Claiming"})
	case err != nil:
		s.o.Auth.Counter().WithLabelValues("signup", "unavailable").Inc()
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, err.Error()))
	case res.Outcome == state.OutcomeConflict:
		s.o.Auth.Counter().WithLabelValues("signup", "conflict").Inc()
		return s.refuse(c, web.Refuse(fiber.StatusConflict, "that user name is taken; sign in with your token instead"))
	case res.Outcome != state.OutcomeCreated:
		s.o.Auth.Counter().WithLabelValues("signup", "failed").Inc()
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, "your sandbox could not be created: "+res.Error))
	}
	sid, err := s.o.Auth.Store().Create(httpguard.Context(c), user, "signup")
	s.audit(c, events.AuditEvent{Kind: events.AuditSignup, User: user, Outcome: state.OutcomeCreated})
	s.o.Auth.Counter().WithLabelValues("signup", "created").Inc()
	if err != nil {
		// The account exists, and its token is never shown again: it goes
		// to the user with the reason they are not signed in (a full
		// sessions bucket, the bus away), so they can sign in later.
		e := web.Unavailable(fmt.Errorf("signup: session not created: %w", err))
		s.o.Log.Warn("signed up but not signed in", "user", user, "err", e.Cause)
		c.Status(e.Status)
		note := "Your account was created, but you are not signed in: " + e.Detail + ". Sign in with this token later."
		c.Set(fiber.HeaderCacheControl, "no-store")
		if web.WantsHTML(c) {
			c.Type("html")
			return web.RenderToken(c, web.Token{User: user, Token: token, Back: "/", Note: note})
		}
		return c.JSON(fiber.Map{"user": user, "token": token, "url": s.sites.SandboxURL(c, user), "signed_in": false, "error": note})
	}
	s.setCookie(c, sid, user)

	if web.WantsHTML(c) {
		return c.Redirect(s.sites.SandboxURL(c, user), fiber.StatusSeeOther)
	}
	wctx, cancel := context.WithTimeout(httpguard.Context(c), s.o.WakeTimeout-time.Since(start))
	defer cancel()
	e, _, _ := s.o.Sandboxes.Wait(wctx, user, func(e kv.Entry[state.Sandbox], ok bool) bool {
		return ok && (e.Value.Phase == state.PhaseReady || e.Value.Phase == state.PhaseFailed)
	})
	code, phase := fiber.StatusAccepted, string(e.Value.Phase)
	if e.Value.Phase == state.PhaseReady {
		code = fiber.StatusCreated
	}
	if phase == "" {
		phase = string(state.PhaseClaiming)
	}
	return c.Status(code).JSON(fiber.Map{"user": user, "token": token, "url": s.sites.SandboxURL(c, user), "state": phase})
}

func (s *Service) login(c *fiber.Ctx) error {
	if ok, err := s.limit(c, "login"); !ok {
		return err
	}
	if httpguard.ForeignOrigin(c) {
		return s.refuse(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
	}
	var token string
	if h := c.Get(fiber.HeaderAuthorization); h != "" {
		token, _ = cutBearer(h)
	} else {
		f, err := web.ReadForm(c, "token")
		if err != nil {
			return s.refuse(c, err)
		}
		token = f["token"]
	}
	u, ok := s.o.Auth.CheckToken(httpguard.Context(c), token)
	if !ok {
		s.o.Auth.Counter().WithLabelValues("login", "rejected").Inc()
		s.o.Auth.Refused(c, events.AuditEvent{Kind: events.AuditLogin, Outcome: "rejected"})
		return s.refuse(c, web.Refuse(fiber.StatusUnauthorized, "that token is not valid"))
	}
	user := u.Name
	sid, err := s.o.Auth.Store().Create(httpguard.Context(c), user, "login")
	if err != nil {
		return s.refuse(c, web.Unavailable(fmt.Errorf("login: session not created: %w", err)))
	}
	// Signing in again replaces the browser's session: the old id, which
	// the new cookie overwrites, must not stay usable elsewhere.
	if old := c.Request().Header.Cookie(s.cookie); len(old) > 0 {
		_ = s.o.Auth.Store().RevokeID(httpguard.Context(c), old)
	}
	s.setCookie(c, sid, user)
	s.o.Auth.Counter().WithLabelValues("login", "ok").Inc()
	s.audit(c, events.AuditEvent{Kind: events.AuditLogin, User: user, Outcome: "ok"})
	if !web.WantsHTML(c) {
		return c.JSON(fiber.Map{"user": user, "url": s.sites.SandboxURL(c, user)})
	}
	// A browser goes to its sandbox; an administrator signing in on an
	// admin host, to the admin view, where the new session works (a
	// cookie is per host: the sandbox's host has not got it).
	if s.sites.AdminHost(c) && s.o.Auth.Administers(u) {
		return c.Redirect(adminPath, fiber.StatusSeeOther)
	}
	return c.Redirect(s.sites.SandboxURL(c, user), fiber.StatusSeeOther)
}

// adminPath is the admin view's page.
const adminPath = "/_/admin"

func cutBearer(h string) (string, bool) {
	const p = "Bearer "
	if len(h) > len(p) && h[:len(p)] == p {
		return h[len(p):], true
	}
	return "", false
}

// mutation authenticates a state-changing request; cookie and SSO
// identities also need a same-origin Origin or Referer (CSRF). ok=false
// means the refusal has been written (and err is the write's error).
func (s *Service) mutation(c *fiber.Ctx) (id auth.Identity, ok bool, err error) {
	id, aerr := s.identity(c)
	if aerr != nil {
		return id, false, s.refuse(c, aerr)
	}
	if id.Method != auth.MethodBearer && !httpguard.SameOrigin(c) {
		return id, false, s.refuse(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
	}
	return id, true, nil
}

// logout ends the session signed in with. An SSO user has no session
// here (the SSO proxy's headers sign every request in), only the sandbox
// origins' sessions made from it: those all end, and the browser goes on
// to the SSO proxy's sign-out (SignOutURL), without which the home page
// would sign them straight back in.
func (s *Service) logout(c *fiber.Ctx) error {
	id, err := s.identity(c)
	next := "/"
	if err == nil && (id.Method == auth.MethodCookie || id.Method == auth.MethodSSO) {
		if !httpguard.SameOrigin(c) {
			return s.refuse(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
		}
		outcome := "ok"
		if id.Method == auth.MethodSSO {
			_, err = s.o.Auth.Store().RevokeAll(httpguard.Context(c), id.User)
			outcome = "sso"
			if s.o.SignOutURL != "" {
				next = s.o.SignOutURL
			}
		} else {
			err = s.o.Auth.Revoke(httpguard.Context(c), id)
		}
		if err != nil {
			return s.refuse(c, web.Unavailable(fmt.Errorf("logout: session not revoked: %w", err)))
		}
		s.audit(c, events.AuditEvent{Kind: events.AuditLogout, User: id.User, Outcome: outcome})
	}
	s.clearCookie(c)
	if !web.WantsHTML(c) {
		return c.SendStatus(fiber.StatusNoContent)
	}
	return c.Redirect(next, fiber.StatusSeeOther)
}

func (s *Service) deleteAccount(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	if c.Params("user") != id.User {
		return s.refuse(c, web.Refuse(fiber.StatusForbidden, "you can only delete your own account"))
	}
	res, ok, err := s.accountAction(c, id.User, events.VerbDelete, "")
	if !ok {
		return err
	}
	if err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, err.Error()))
	}
	if res.Outcome != state.OutcomeDeleted {
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, "the account could not be deleted: "+res.Error))
	}
	s.clearCookie(c)
	s.audit(c, events.AuditEvent{Kind: events.AuditDelete, User: id.User, Outcome: "requested", Detail: "by " + id.Method})
	if c.Method() == fiber.MethodPost && web.WantsHTML(c) {
		return c.Redirect("/", fiber.StatusSeeOther) // the confirm page's form
	}
	return c.SendStatus(fiber.StatusNoContent)
}

// recreate wipes the sandbox and every session; the browser that asked
// gets a fresh session so it is not signed out by its own request.
func (s *Service) recreate(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	profile, err := s.recreateProfile(c, id)
	if err != nil {
		return s.refuse(c, err)
	}
	res, ok, err := s.accountAction(c, id.User, events.VerbRecreate, profile)
	if !ok {
		return err
	}
	if err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, err.Error()))
	}
	if res.Outcome != state.OutcomeRecreated {
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, "the sandbox could not be recreated: "+res.Error))
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditRecreate, User: id.User, Outcome: "requested", Detail: "by " + id.Method})
	if id.Method == auth.MethodCookie {
		if sid, err := s.o.Auth.Store().Create(httpguard.Context(c), id.User, "recreate"); err == nil {
			s.setCookie(c, sid, id.User)
		}
	}
	if !web.WantsHTML(c) || c.Method() != fiber.MethodPost {
		return c.Status(fiber.StatusAccepted).JSON(fiber.Map{"user": id.User, "state": string(s.state(httpguard.Context(c), id.User).Phase)})
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// recreateProfile is the profile a recreate asks for, checked as the
// user's to choose. A body is optional: without one (or without a
// profile in it) the new sandbox is of the old one's profile ("").
func (s *Service) recreateProfile(c *fiber.Ctx, id auth.Identity) (string, error) {
	var named string
	if c.Request().Header.ContentLength() != 0 { // a length, or chunked (-1)
		f, err := web.ReadForm(c, "profile")
		if err != nil {
			return "", err
		}
		named = f["profile"]
	}
	return s.chosenProfile(c, id, named)
}

// accountAction runs a recreate or deletion of user's account (Act) and
// returns its answer. ok=false means a refusal has been written;
// otherwise err is the command's failure, if any.
func (s *Service) accountAction(c *fiber.Ctx, user string, verb events.Verb, profile string) (state.Result, bool, error) {
	res, err := s.Act(httpguard.Context(c), user, verb, profile)
	var r *web.Error
	if errors.As(err, &r) {
		return state.Result{}, false, s.refuse(c, r)
	}
	return res, true, err
}

// Act runs a recreate or deletion of user's account and returns its
// answer, or a *web.Error. At most one runs per user: requests made while a
// recreate is under way are refused (429), and requests made at the same
// moment are the same command (its id and its answer's key derive from
// the account record's revision), so they all wait for the one answer; on
// one edge they also share one rate-limit entry and one publish. Actions
// are limited per user (RECREATE_RATE_LIMIT in AUTH_RATE_WINDOW): each
// costs a pod and a volume. A recreate's new sandbox is of profile (""
// keeps the old one's), which the caller has checked the user may choose.
// Any other error is the command's failure.
func (s *Service) Act(ctx context.Context, user string, verb events.Verb, profile string) (state.Result, error) {
	// user may be a named sandbox's key: the action is that sandbox's,
	// limited as its owner's, and of its record's revision.
	owner, name, _ := ident.SplitSandboxKey(user)
	acct, found := s.o.Users.Load(ctx, owner)
	switch {
	case !found:
		return state.Result{}, &web.Error{Status: fiber.StatusNotFound, Detail: "no such account"}
	case name != "" && !slices.Contains(acct.Value.Sandboxes, name):
		return state.Result{}, &web.Error{Status: fiber.StatusNotFound, Detail: "no such sandbox"}
	case name == "" && !acct.Value.RecreatingSince.IsZero():
		return state.Result{}, &web.Error{Status: fiber.StatusTooManyRequests, Detail: "the sandbox is being recreated; try again when it is ready", RetryAfter: 9 * time.Second}
	}
	rev := acct.Revision
	if name != "" {
		box, _ := s.o.Sandboxes.Load(ctx, user)
		rev = box.Revision
	}
	requestID := fmt.Sprintf("%s-%s-%d", verb, user, rev)
	if profile != "" {
		// A recreate into another profile is another command than one
		// asked for at the same moment into the old one.
		requestID += "-" + profile
	}
	cmd := events.NewRecreate(user, requestID, profile)
	if verb == events.VerbDelete {
		cmd = events.NewDelete(user, requestID)
	}
	type outcome struct {
		res     state.Result
		limited bool
		retry   time.Duration
	}
	// Detached from the first requester (its request id is the command's
	// trace): the others wait for the same.
	ctx = ident.WithRequestID(context.Background(), ident.RequestIDOf(ctx))
	v, err, _ := s.actions.Do(requestID, func() (any, error) {
		v, err := s.o.Actions.Allow(ctx, "account:"+owner)
		if err != nil {
			return nil, web.Unavailable(err)
		}
		if !v.Allowed {
			return outcome{limited: true, retry: v.RetryAfter}, nil
		}
		res, err := s.command(ctx, cmd)
		return outcome{res: res}, err
	})
	o, _ := v.(outcome)
	switch {
	case v == nil:
		return state.Result{}, err
	case o.limited:
		return state.Result{}, &web.Error{Status: fiber.StatusTooManyRequests, Detail: "too many recreates or deletions of this account; wait and try again", RetryAfter: o.retry}
	}
	return o.res, err
}

func (s *Service) status(c *fiber.Ctx) error {
	id, err := s.identity(c)
	if err != nil {
		return s.refuse(c, err)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(s.statusOf(httpguard.Context(c), id.User, s.sites.SandboxURL(c, id.User)))
}

// statusStream sends the user's sandbox state as server-sent events, once
// now and again on every change, for the landing and starting pages. It
// holds one of the user's in-flight slots, and ends when its credentials
// are revoked (the browser's EventSource then reconnects and is refused).
func (s *Service) statusStream(c *fiber.Ctx) error {
	id, err := s.identity(c)
	if err != nil {
		return s.refuse(c, err)
	}
	return s.streamStatus(c, id, id.User)
}

// streamStatus streams the state of id's sandbox of key, in one of the
// account's in-flight slots.
func (s *Service) streamStatus(c *fiber.Ctx, id auth.Identity, key string) error {
	if !s.o.InFlight.Acquire(id.User) {
		c.Set(fiber.HeaderRetryAfter, "1")
		return s.refuse(c, web.Refuse(fiber.StatusServiceUnavailable, "too many requests to your sandbox are in flight; retry shortly"))
	}
	c.Set(fiber.HeaderContentType, "text/event-stream")
	c.Set(fiber.HeaderCacheControl, "no-store")
	c.Set("X-Accel-Buffering", "no")
	user, url := id.User, s.sites.SandboxURL(c, key)
	conn := c.Context().Conn()
	// The stream outlives the handler: it ends the request's context.
	ctx, end := httpguard.Detach(c)
	c.Context().SetBodyStreamWriter(fasthttp.StreamWriter(func(w *bufio.Writer) {
		defer end()
		defer s.o.InFlight.Release(user)
		// Each write gets its own deadline: a browser that stops reading
		// is dropped, one that keeps reading is never cut off.
		send := func(text string) bool {
			_ = conn.SetWriteDeadline(time.Now().Add(s.o.WriteTimeout))
			_, err := w.WriteString(text)
			return err == nil && w.Flush() == nil
		}
		var last uint64
		var said string
		quiet := time.Now()
		// Until the credentials are revoked or the browser leaves (its
		// slot must not wait for the next write to find out). What is
		// said changes with the sandbox's record or the user's place in
		// the queue.
		for s.o.Auth.Valid(id) && !httpguard.Gone(conn) {
			e, _ := s.o.Sandboxes.Load(ctx, key)
			last = e.Revision
			if b, _ := json.Marshal(s.statusOf(ctx, key, url)); string(b) != said {
				if !send("event: state\ndata: " + string(b) + "\n\n") {
					return
				}
				said, quiet = string(b), time.Now()
			}
			wctx, cancel := context.WithTimeout(ctx, s.o.Revalidate)
			_, _, _ = s.o.Sandboxes.Wait(wctx, key, func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Revision != last })
			cancel()
			if time.Since(quiet) >= keepAlive {
				// Quiet for a while: a comment keeps proxies from closing the
				// stream and tells us whether the browser is still there.
				if !send(": keep-alive\n\n") {
					return
				}
				quiet = time.Now()
			}
		}
	}))
	return nil
}

// keepAlive is how long a status stream stays silent at most.
const keepAlive = 15 * time.Second
