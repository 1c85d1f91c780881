// Package admin serves the operators' view at the edge: /_/admin, a page
// listing every user (sandbox phase and pod, account age, sessions, last
// activity and work in flight per edge, managed or not, model spend this
// month and budget; by name or by spend) with the actions suspend, wake,
// delete, recreate and revoke sessions, and budget overrides per user and
// per SSO group, each confirmed and audited; the same as a JSON API for
// bearer tokens, the month's usage as CSV or JSON, and the audit trail
// filtered by user, kind and time (page, CSV, JSON). Administrators
// are the accounts ADMIN_USERS binds by identity and the members of
// ADMIN_GROUPS (auth.Identity.Admin); to everyone else, signed in or not,
// these paths do not exist (404). The list is read from the edge's
// caches, a page at a time.
//
// In path mode the view and API are served only on ADMIN_HOSTS, hosts
// that serve no sandbox (NoSandboxes), so no page a tenant serves shares
// their origin.
package admin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Page sizes of the list: the default, and the most one request may ask.
const (
	DefaultLimit = 100
	MaxLimit     = 500
)

// Accounts is what the admin view needs of the account service
// (accounts.Service): the actions it shares with the users themselves.
type Accounts interface {
	// Act recreates or deletes user's account (a recreate into profile;
	// "" keeps the sandbox's); its errors are *web.Error.
	Act(ctx context.Context, user string, verb events.Verb, profile string) (state.Result, error)
	// ReplaceToken gives user a new bearer token, by whom, and returns it.
	ReplaceToken(ctx context.Context, user, by string) (string, error)
}

// Options wires a Service.
type Options struct {
	Auth *auth.Authenticator
	// Accounts carries out what an administrator asks of an account.
	Accounts  Accounts
	Users     *kv.Cache[state.User]
	Sandboxes *kv.Cache[state.Sandbox]
	// Profiles are PROFILES: the list shows each sandbox's and filters by
	// them.
	Profiles config.Profiles
	// Rollouts are each profile's rollout as lifecycle last counted it
	// (state.Rollout), for the view's summary and GET /_/admin/rollouts.
	Rollouts *kv.Cache[state.Rollout]
	// Names are every account's and sandbox's name, for the list.
	Names    *kv.Names
	Activity *idle.Views
	// Idle is the idle rule's settings: the view marks dormant accounts
	// (DORMANT_AFTER) and when they will be deleted.
	Idle      idle.Policy
	Publisher *events.Publisher
	Log       *slog.Logger
	// Hosts are ADMIN_HOSTS, canonical: when set, the only hosts the view
	// and API are served on, and hosts that serve no sandbox.
	Hosts []string
	// SandboxDomain is SANDBOX_DOMAIN, canonical; empty in path mode. The
	// view links each user to their sandbox's origin under it.
	SandboxDomain string
	// PublicHosts are PUBLIC_HOSTS, canonical: the first serves
	// /u/<user>/ in path mode, for the links from an admin host, which
	// serves none ("*" names no host to link to).
	PublicHosts []string
	// Spend is each user's model spend and budget, for the list, the
	// budget API and the usage export; Budgets is where overrides are
	// written. Without Spend none of them is served.
	Spend   *spend.Book
	Budgets *kv.Bucket[state.Budget]
	// JS reads the usage stream for the per-call export and the audit
	// stream for the audit view; without it neither is served.
	JS jetstream.JetStream
}

// Service serves the admin view and API.
type Service struct {
	o Options
	// sites says where the view links each user's sandbox.
	sites web.Sites
}

// New returns a Service.
func New(o Options) *Service {
	return &Service{o: o, sites: web.NewSites(o.SandboxDomain, o.Hosts, o.PublicHosts)}
}

// Register mounts the admin routes.
func (s *Service) Register(app *fiber.App) {
	app.Get("/_/admin", s.page)
	app.Get("/_/admin/users", s.list)
	app.Post("/_/admin/users/:user/:action", s.act)
	app.Get("/_/admin/rollouts", s.rollouts)
	if s.o.Spend != nil {
		s.budgetRoutes(app)
	}
	if s.o.JS != nil {
		app.Get("/_/admin/audit", s.audit)
	}
}

// Row is one user as the admin view shows it.
type Row struct {
	// User is the row's sandbox key (ident.SandboxKey): an account's
	// name, with its first sandbox, or <owner>--<name> for a named
	// sandbox, which is listed right after its owner's row (the keys
	// sort so) and says whose it is (Owner, Sandbox).
	User  string `json:"user"`
	Owner string `json:"owner,omitempty"`
	// Sandbox is a named sandbox's name.
	Sandbox string `json:"sandbox,omitempty"`
	Phase   string `json:"phase"`
	// Profile is the profile (PROFILES) the sandbox is of; Revision its
	// pod template's (sandbox.Revision), which a rollout moves.
	Profile  string `json:"profile"`
	Revision string `json:"revision,omitempty"`
	// Halted is the revision a rollout was rolled back from here.
	Halted  string `json:"halted_revision,omitempty"`
	Reason  string `json:"reason,omitempty"`
	Managed bool   `json:"managed"`
	Pod     string `json:"pod,omitempty"`
	// Created is when the account was made (zero for a sandbox without
	// an account, such as a claim applied by hand).
	Created    time.Time `json:"created,omitzero"`
	ReadySince time.Time `json:"ready_since,omitzero"`
	LastActive time.Time `json:"last_active,omitzero"`
	Sessions   int       `json:"sessions"`
	// InFlight is the work (requests and WebSockets) open on each edge
	// that has reported it within its beacon's TTL.
	InFlight []idle.Load `json:"in_flight,omitempty"`
	// URL is where the user's sandbox is reached (see sandboxURL).
	URL string `json:"url,omitempty"`
	// SpentMicros is the user's model spend this month (what the
	// organisation pays); Budget the budget that applies to them.
	SpentMicros int64          `json:"spent_micros"`
	Budget      *state.Applied `json:"budget,omitempty"`
	// Dormant: its sandbox has slept DORMANT_AFTER; DeleteAt is when
	// DORMANT_DELETE_AFTER deletes it (absent: never).
	Dormant  bool       `json:"dormant,omitempty"`
	DeleteAt *time.Time `json:"delete_at,omitempty"`
}

// dormantFilter is the phase filter that lists dormant accounts.
const dormantFilter = "Dormant"

// Query selects a page of the list: users after After, whose name
// starts with Prefix, whose phase is Phase, whose sandbox is of Profile
// and whose pod template is of Revision, or was rolled back from it (each
// optional), by name or, with Sort "spend", by this month's model spend,
// most first.
type Query struct {
	After, Prefix, Phase, Profile, Revision, Sort string
	Limit                                         int
}

// values are q's filters and order as a link's query, with more.
func (q Query) values(more url.Values) string {
	v := url.Values{"q": {q.Prefix}, "phase": {q.Phase}, "profile": {q.Profile}, "revision": {q.Revision}}
	for k, x := range more {
		v[k] = x
	}
	return "/_/admin?" + v.Encode()
}

// Page is a page of the list; Next is the After of the next page ("" on
// the last).
type Page struct {
	Users []Row  `json:"users"`
	Next  string `json:"next,omitempty"`
	Total int    `json:"total"`
}

// parseQuery reads a Query from the request, refusing what it cannot use.
func (s *Service) parseQuery(c *fiber.Ctx) (Query, error) {
	q := Query{After: c.Query("after"), Prefix: c.Query("q"), Phase: c.Query("phase"), Profile: c.Query("profile"), Revision: c.Query("revision"), Sort: c.Query("sort"), Limit: DefaultLimit}
	if q.Sort != "" && (q.Sort != "spend" || s.o.Spend == nil) {
		return q, errors.New(`sort is "spend" (most first) or absent (by name)`)
	}
	if v := c.Query("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxLimit {
			return q, fmt.Errorf("limit must be a number from 1 to %d", MaxLimit)
		}
		q.Limit = n
	}
	if q.Phase != "" && q.Phase != dormantFilter && !slices.Contains(state.Phases, state.Phase(q.Phase)) {
		return q, fmt.Errorf("phase must be one of %v or %s", state.Phases, dormantFilter)
	}
	if _, ok := s.o.Profiles.Find(q.Profile); !ok {
		return q, fmt.Errorf("profile must be one of %s", s.o.Profiles.Names())
	}
	if q.Revision != "" && !state.ValidRevision(q.Revision) {
		return q, errors.New("revision is 8 hex digits, as the Revision column shows")
	}
	if len(q.After) > ident.MaxUserLen || len(q.Prefix) > ident.MaxUserLen {
		return q, errors.New("after and q are user names or their beginnings")
	}
	return q, nil
}

// maxScanned bounds the rows one page looks at per row it may show: a
// filter that matches few users ends its page early, with Next where it
// stopped, rather than reading every account to fill it.
const maxScanned = 20

// Page is the page of the list q selects, from the caches and, for the
// rows shown, their sessions (the sessions bucket) and idle clocks (the
// activity stream), each read at once for the page.
func (s *Service) Page(ctx context.Context, q Query, now time.Time) (Page, error) {
	// Every user there is, by name: accounts, and sandboxes without one,
	// from the buckets' key set (kv.Names, loaded on the first page this
	// edge serves), read from where the page starts: a page costs the
	// same right after a write as before it, at any count.
	if err := s.o.Names.Load(ctx); err != nil {
		return Page{}, err
	}
	scan := maxScanned * q.Limit
	var (
		names []string
		err   error
	)
	if q.Sort == "spend" {
		if names, err = s.spendOrder(ctx, state.Month(now), q.After, scan+1); err != nil {
			return Page{}, err
		}
	} else {
		from := q.Prefix
		if q.After != "" && q.After+"\x00" > from {
			from = q.After + "\x00" // the first name after it
		}
		names = s.o.Names.Range(from, scan+1)
	}
	page := Page{Users: []Row{}}
	for scanned, name := range names {
		if scanned == scan {
			page.Next = names[scanned-1]
			break
		}
		if !strings.HasPrefix(name, q.Prefix) {
			if q.Sort == "spend" {
				continue
			}
			break
		}
		r, err := s.row(ctx, name, now)
		if err != nil {
			return Page{}, err
		}
		if q.Phase == dormantFilter && !r.Dormant || q.Phase != "" && q.Phase != dormantFilter && r.Phase != q.Phase ||
			q.Profile != "" && r.Profile != q.Profile || q.Revision != "" && r.Revision != q.Revision && r.Halted != q.Revision {
			continue
		}
		if len(page.Users) == q.Limit {
			page.Next = page.Users[len(page.Users)-1].User
			break
		}
		page.Users = append(page.Users, r)
	}
	page.Total = s.o.Names.Len()
	shown := make([]string, len(page.Users))
	for i, r := range page.Users {
		shown[i] = r.User
	}
	sessions, err := s.o.Auth.Store().Count(ctx, shown...)
	if err != nil {
		return Page{}, err
	}
	views, err := s.o.Activity.Of(ctx, shown, now)
	if err != nil {
		return Page{}, err
	}
	for i := range page.Users {
		u := &page.Users[i]
		u.Sessions, u.LastActive, u.InFlight = sessions[u.User], views[u.User].Last, views[u.User].Load
	}
	return page, nil
}

// row is name's row but for its sessions (Page counts a page's at once).
func (s *Service) row(ctx context.Context, name string, now time.Time) (Row, error) {
	r := Row{User: name, Phase: "Unknown", Profile: s.o.Profiles.NameOf("")}
	if owner, sb, _ := ident.SplitSandboxKey(name); sb != "" {
		r.Owner, r.Sandbox = owner, sb
	}
	if u, ok := s.o.Users.Load(ctx, name); ok {
		r.Managed, r.Created = u.Value.Managed, u.Value.Created
	}
	if b, ok := s.o.Sandboxes.Load(ctx, name); ok {
		r.Phase, r.Reason, r.Pod, r.ReadySince = string(b.Value.Phase), b.Value.Reason, b.Value.PodName, b.Value.ReadySince
		r.Managed, r.Profile, r.Revision, r.Halted = r.Managed || b.Value.Managed, s.o.Profiles.NameOf(b.Value.Profile), b.Value.Revision, b.Value.Halted
		if ls := b.Value.LastSuspend; ls != nil && b.Value.Phase == state.PhaseSuspended && b.Value.Managed {
			var at time.Time
			if r.Dormant, at = s.o.Idle.Dormancy(ls.At, now); r.Dormant && !at.IsZero() {
				r.DeleteAt = &at
			}
		}
	}
	// Spend is the account's: a named sandbox's is its owner's row's.
	if s.o.Spend != nil && r.Sandbox == "" {
		b := s.o.Spend.Budget(ctx, name)
		r.SpentMicros, r.Budget = s.o.Spend.Spent(ctx, name, state.Month(now)).CostMicros, &b
	}
	return r, nil
}

// servedHere reports whether the view and API are served on the
// request's host: with ADMIN_HOSTS set, only on them.
func (s *Service) servedHere(c *fiber.Ctx) bool {
	return len(s.o.Hosts) == 0 || s.sites.AdminHost(c)
}

// NoSandboxes refuses /u/… on ADMIN_HOSTS with 404 and passes every other
// request on: mounted before the proxy's route, it keeps every tenant
// byte off the admin hosts' origins.
func (s *Service) NoSandboxes(c *fiber.Ctx) error {
	if !s.sites.AdminHost(c) {
		return c.Next()
	}
	detail := "This host serves the administration, not sandboxes."
	if gw := s.sites.Gateway(); gw != "" {
		detail += " Sandboxes are at " + httpguard.Scheme(c) + "://" + gw + "/u/<user>/."
	}
	return web.WriteProblem(c, web.Problem{Status: fiber.StatusNotFound, Title: "Not available", Detail: detail})
}

// sandboxURL is where user's sandbox is reached from this admin view
// (web.Sites.SandboxURL); "" for a name no account can have (a sandbox
// record's key is not necessarily one), which gets no link.
func (s *Service) sandboxURL(c *fiber.Ctx, user string) string {
	if ident.ValidateUser(user) != nil {
		return ""
	}
	return s.sites.SandboxURL(c, user)
}

// admin authenticates the request as an administrator; false means the
// 404 has been written. Off ADMIN_HOSTS (when set) nobody is one.
func (s *Service) admin(c *fiber.Ctx) (auth.Identity, bool, error) {
	if !s.servedHere(c) {
		return auth.Identity{}, false, notFound(c)
	}
	id, err := s.o.Auth.Authenticate(c)
	if err != nil || !id.Admin {
		return id, false, notFound(c)
	}
	// Reads too: with ambient credentials, the view and the list answer
	// only the gateway's own pages (and typed addresses), so a sibling
	// sandbox origin's page gets nothing, not even an answer CORS hides.
	if id.Ambient() && httpguard.CrossSite(c) {
		return id, false, web.Fail(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
	}
	return id, true, nil
}

// notFound answers as for a path the edge does not serve.
func notFound(c *fiber.Ctx) error {
	return web.WriteProblem(c, web.Problem{Status: fiber.StatusNotFound, Title: "Not available", Detail: "Cannot " + c.Method() + " " + c.Path()})
}

func (s *Service) list(c *fiber.Ctx) error {
	if _, ok, err := s.admin(c); !ok {
		return err
	}
	q, err := s.parseQuery(c)
	if err != nil {
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	p, err := s.Page(httpguard.Context(c), q, time.Now())
	if err != nil {
		return web.Fail(c, web.Unavailable(err))
	}
	for i := range p.Users {
		p.Users[i].URL = s.sandboxURL(c, p.Users[i].User)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(p)
}

func (s *Service) page(c *fiber.Ctx) error {
	id, ok, err := s.admin(c)
	if !ok {
		return err
	}
	q, err := s.parseQuery(c)
	if err != nil {
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	p, err := s.Page(httpguard.Context(c), q, time.Now())
	if err != nil {
		return web.Fail(c, web.Unavailable(err))
	}
	d := web.Admin{Admin: id.User, Query: q.Prefix, Phase: q.Phase, Phases: phaseNames(), Total: p.Total, Actions: actions,
		Spend: s.o.Spend != nil, Sort: q.Sort, Month: state.Month(time.Now()), Profile: q.Profile, Revision: q.Revision}
	if len(s.o.Profiles) > 1 {
		for _, p := range s.o.Profiles {
			d.Profiles = append(d.Profiles, p.Name)
		}
	}
	for _, ro := range s.Rollouts() {
		d.Rollouts = append(d.Rollouts, rolloutRows(ro))
	}
	if d.Spend {
		d.SortLink = q.values(url.Values{"sort": {"spend"}})
		d.NameLink = q.values(nil)
	}
	// The notice is rebuilt from what is valid, so a crafted link cannot
	// put words on this page.
	if did := c.Query("did"); slices.Contains(actions, did) && ident.ValidateUser(q.Prefix) == nil {
		d.Notice = did + " of " + q.Prefix + " carried out or requested"
	}
	if scope, name, ok := strings.Cut(c.Query("budget"), " "); ok && (scope == state.BudgetUser && ident.ValidateUser(name) == nil || scope == state.BudgetGroup && state.GroupName(name) == name && name != "") {
		d.Notice = "budget of " + scope + " " + name + " changed"
	}
	for _, r := range p.Users {
		row := web.AdminRow{
			User: r.User, Phase: r.Phase, Profile: r.Profile, Reason: r.Reason, Managed: r.Managed, Pod: r.Pod,
			Age: since(r.Created, time.Now()), LastActive: since(r.LastActive, time.Now()), Sessions: r.Sessions, Owner: r.Owner, Sandbox: r.Sandbox, Revision: r.Revision, Halted: r.Halted,
			InFlight: inFlightText(r.InFlight), URL: s.sandboxURL(c, r.User), Dormant: r.Dormant,
		}
		if r.DeleteAt != nil {
			row.DeleteAt = web.When(*r.DeleteAt)
		}
		if r.Budget != nil {
			row.Spent, row.Budget = spend.USD(r.SpentMicros), spend.Describe(*r.Budget)
		}
		d.Rows = append(d.Rows, row)
	}
	if p.Next != "" {
		d.Next = q.values(url.Values{"after": {p.Next}, "sort": {q.Sort}})
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	c.Type("html")
	return web.RenderAdmin(c, d)
}

func phaseNames() []string {
	out := make([]string, len(state.Phases), len(state.Phases)+1)
	for i, p := range state.Phases {
		out[i] = string(p)
	}
	return append(out, dormantFilter)
}

// since is a coarse age ("3m", "2h", "5d"), "—" for a zero time.
func since(t, now time.Time) string {
	if t.IsZero() {
		return "—"
	}
	d := max(now.Sub(t), 0)
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d.Minutes())) + "m"
	case d < 48*time.Hour:
		return strconv.Itoa(int(d.Hours())) + "h"
	}
	return strconv.Itoa(int(d.Hours()/24)) + "d"
}

func inFlightText(load []idle.Load) string {
	parts := make([]string, len(load))
	for i, l := range load {
		parts[i] = fmt.Sprintf("%s: %d", l.Edge, l.InFlight)
	}
	return strings.Join(parts, ", ")
}

// Actions an administrator can take on a user.
var actions = []string{"suspend", "wake", "delete", "recreate", "revoke", "token"}

// act runs an action on a user. It must be confirmed: the form or JSON
// body names the user again in "confirm" (the page asks on a page of its
// own first). A cookie-authenticated request must come from our own
// origin.
func (s *Service) act(c *fiber.Ctx) error {
	id, ok, err := s.admin(c)
	if !ok {
		return err
	}
	user, action := c.Params("user"), c.Params("action")
	if !slices.Contains(actions, action) {
		return web.Fail(c, web.Refuse(fiber.StatusNotFound, fmt.Sprintf("no action %q; actions are %s", action, strings.Join(actions, ", "))))
	}
	owner, named, ok := ident.SplitSandboxKey(user)
	switch {
	case !ok:
		return web.Fail(c, web.Refuse(fiber.StatusNotFound, "no such user"))
	case named != "" && (action == "revoke" || action == "token"):
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, fmt.Sprintf("%s is the account's: act on %s", action, owner)))
	}
	if id.Ambient() && !httpguard.SameOrigin(c) {
		return web.Fail(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
	}
	f, err := web.ReadForm(c, "confirm")
	if err != nil && c.Request().Header.ContentLength() != 0 {
		return web.Fail(c, err)
	}
	if f["confirm"] != user {
		if web.WantsHTML(c) {
			c.Set(fiber.HeaderCacheControl, "no-store")
			c.Type("html")
			return web.RenderAdminConfirm(c, web.AdminConfirm{User: user, Action: action})
		}
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, fmt.Sprintf(`confirm the %s by sending {"confirm": %q}`, action, user)))
	}
	rid := httpguard.RequestID(c)
	var token string
	outcome, status, err := s.run(httpguard.Context(c), user, action, id.User, &token)
	audit := events.AuditEvent{Kind: events.AuditAdmin, User: user, Outcome: action + ": " + outcome, Client: auth.ClientTag(c), RequestID: rid, Detail: "by " + id.User}
	if err != nil {
		audit.Outcome, audit.Detail = action+": refused", audit.Detail+": "+err.Error()
		s.o.Publisher.Audit(audit)
		return web.Fail(c, err)
	}
	s.o.Publisher.Audit(audit)
	s.o.Log.Info("admin action", "admin", id.User, "user", user, "action", action, "outcome", outcome)
	if token != "" {
		// Shown to the administrator once, to hand to the user.
		return web.ShowToken(c, user, token, "/_/admin?"+url.Values{"q": {user}}.Encode())
	}
	if web.WantsHTML(c) {
		return c.Redirect("/_/admin?"+url.Values{"q": {user}, "did": {action}}.Encode(), fiber.StatusSeeOther)
	}
	return c.Status(status).JSON(fiber.Map{"user": user, "action": action, "outcome": outcome})
}

// refused is an account action's error as its answer: the *web.Error
// accounts gave, else 503 (the command failed or went unanswered).
func refused(err error) error {
	var e *web.Error
	if errors.As(err, &e) {
		return e
	}
	return web.Unavailable(err)
}

// run carries an action out; it returns what happened and the status to
// answer with, or why it could not be done (a *web.Error). A token reset puts the new
// token in token.
func (s *Service) run(ctx context.Context, user, action, by string, token *string) (string, int, error) {
	box, boxed := s.o.Sandboxes.Load(ctx, user)
	_, account := s.o.Users.Load(ctx, user)
	if !boxed && !account {
		return "", 0, web.Refuse(fiber.StatusNotFound, "no such user")
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	switch action {
	case "suspend", "wake":
		want, done := state.PhaseReady, "suspended"
		cmd := events.NewAdminSuspend(user, box.Revision, by)
		if action == "wake" {
			want, done, cmd = state.PhaseSuspended, "woken", events.NewWake(user, box.Revision)
		}
		if !box.Value.Managed {
			return "", 0, web.Refuse(fiber.StatusConflict, "this sandbox is not managed by the gateway")
		}
		if box.Value.Phase != want {
			return "", 0, web.Refuse(fiber.StatusConflict, fmt.Sprintf("the sandbox is %s; only a %s one can be %s", phaseOr(box.Value.Phase), want, done))
		}
		if _, err := s.o.Publisher.Command(ctx, cmd); err != nil {
			return "", 0, web.Unavailable(err)
		}
		return "requested", fiber.StatusAccepted, nil
	case "token":
		t, err := s.o.Accounts.ReplaceToken(ctx, user, "admin:"+by)
		if err != nil {
			return "", 0, refused(err)
		}
		*token = t
		return "token replaced; the old one no longer works, sessions are kept", fiber.StatusOK, nil
	case "revoke":
		n, err := s.o.Auth.Store().RevokeAll(ctx, user)
		if err != nil {
			return "", 0, web.Unavailable(err)
		}
		// What revoke does not end, said where the administrator reads
		// the outcome: the bearer token signs in again.
		return fmt.Sprintf("%d sessions ended; the account's bearer token still works", n), fiber.StatusOK, nil
	}
	verb, want := events.VerbDelete, state.OutcomeDeleted
	if action == "recreate" {
		verb, want = events.VerbRecreate, state.OutcomeRecreated
	}
	res, err := s.o.Accounts.Act(ctx, user, verb, "")
	switch {
	case err != nil:
		return "", 0, refused(err)
	case res.Outcome != want:
		return "", 0, web.Refuse(fiber.StatusConflict, fmt.Sprintf("lifecycle answered %s: %s", res.Outcome, res.Error))
	}
	return res.Outcome, fiber.StatusOK, nil
}

func phaseOr(p state.Phase) string {
	if p == "" {
		return "unknown"
	}
	return string(p)
}
