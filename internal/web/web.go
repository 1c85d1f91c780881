// Package web holds the edge's own pages: the landing page (sign up, sign
// in, your sandbox), the "starting your sandbox" page shown while a
// sandbox wakes, the admin view, and error pages. Templates and assets are embedded; the
// pages work without JavaScript and use a little of it to follow state
// live.
package web

import (
	"embed"
	"encoding/json"
	"html/template"
	"io"
	"io/fs"
	"mime"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/state"
)

//go:embed templates/*.html
var templates embed.FS

//go:embed static
var static embed.FS

var pages = template.Must(template.New("").Funcs(template.FuncMap{"head": func(title, base string) head { return head{title, base} }}).
	ParseFS(templates, "templates/*.html"))

// head is the data of every page's <head>: its title, and the origin its
// stylesheet comes from (see gatewayBase).
type head struct{ Title, Base string }

// onOrigin is the data of a page the edge may serve on a sandbox origin:
// the page's own, and Base, the origin its stylesheet and sign-in link
// are on (see gatewayBase).
type onOrigin[T any] struct {
	Page T
	Base string
}

// gatewayBase is where the edge's own pages take their assets and sign-in
// link from: their own origin (relative links) on the gateway's hosts; on
// a sandbox origin, whose every path is the tenant's (its /_/static/ too),
// the gateway's: the request's scheme and the first of PUBLIC_HOSTS.
func gatewayBase(c *fiber.Ctx) string {
	if info := httpguard.Get(c); info.OnSandboxDomain {
		return info.Scheme + "://" + info.Gateway
	}
	return ""
}

// Sites says where the edge's pages send a browser for a user's sandbox,
// by the deployment's hosts.
type Sites struct {
	domain  string
	admin   []string
	gateway string
}

// NewSites is the Sites of SANDBOX_DOMAIN, ADMIN_HOSTS and PUBLIC_HOSTS
// (all canonical; "" and nil when unset).
func NewSites(sandboxDomain string, adminHosts, publicHosts []string) Sites {
	s := Sites{domain: sandboxDomain, admin: adminHosts}
	if len(publicHosts) > 0 && publicHosts[0] != "*" {
		s.gateway = publicHosts[0]
	}
	return s
}

// SandboxURL is where a page served to c links user's sandbox: its own
// origin in subdomain mode (c's scheme); in path mode /u/<user>/ on the
// first public host when c is on an admin host, which serves no /u/, and
// on c's own host otherwise (also when PUBLIC_HOSTS is *, which names no
// host to link to).
func (s Sites) SandboxURL(c *fiber.Ctx, user string) string {
	switch {
	case s.domain != "":
		return httpguard.Scheme(c) + "://" + httpguard.SandboxHost(user, 0, s.domain) + "/"
	case s.AdminHost(c) && s.gateway != "":
		return httpguard.Scheme(c) + "://" + s.gateway + "/u/" + user + "/"
	}
	return "/u/" + user + "/"
}

// AdminHost reports whether c was made to one of ADMIN_HOSTS.
func (s Sites) AdminHost(c *fiber.Ctx) bool { return slices.Contains(s.admin, httpguard.Host(c)) }

// Gateway is the first public host, "" when PUBLIC_HOSTS is *.
func (s Sites) Gateway() string { return s.gateway }

// Landing is the data of the landing page.
type Landing struct {
	// User is the signed-in user, empty when signed out; Sandbox is
	// where their sandbox is reached (Sites.SandboxURL).
	User    string
	Sandbox string
	Phase   string
	Reason  string
	// Invite asks for an invite code on signup; SSO hides the forms.
	Invite bool
	SSO    bool
	// SignOut is the SSO proxy's sign-out (AUTH_PROXY_SIGN_OUT_URL),
	// offered to an SSO user the gateway refuses, to sign in as another.
	SignOut string
	// Error is shown above the forms.
	Error      string
	MaxUserLen int
	// Models is the signed-in user's model spend, budget and own keys;
	// nil hides it.
	Models *Models
	// Sleep is when and why the sandbox sleeps, and the keep-awake
	// choices (When, Slept).
	Sleep Sleep
	// TokensOn shows the user's named API tokens, APITokens (not when
	// they are not enabled, or the user came with an API token).
	TokensOn  bool
	APITokens []APIToken
	// Profile is the sandbox's profile, shown when Profiles offers a
	// choice; Profiles are those the signup form offers (none: no choice).
	Profile  string
	Profiles []Profile
	// Sandboxes are the user's sandboxes, their first one first, listed
	// when MAX_SANDBOXES_PER_USER (MaxSandboxes) is above 1; MoreSandboxes
	// offers the form for another.
	Sandboxes                       []Sandbox
	MaxSandboxes, MaxSandboxNameLen int
	MoreSandboxes                   bool
}

// Sandbox is one of the user's sandboxes on their page; Name is "" for
// their first.
type Sandbox struct{ Name, URL, Phase, Profile string }

// Profile is a profile a user may choose, on the signup form and the
// recreate page.
type Profile struct{ Name, Description string }

// APIToken is one of the user's named API tokens on their page.
type APIToken struct{ Name, Created, Expires string }

// Sleep is what the user's page says about their sandbox's sleep: the
// last activity, the suspend to come and its reason (in words), a
// keep-awake in force, the last suspend, and the keep-awake lengths
// offered.
type Sleep struct {
	LastActive, SuspendAt, SuspendWhy, KeepAwakeUntil, Slept string
	// Dormancy says what happens to an account left unused
	// (DORMANT_AFTER, DORMANT_DELETE_AFTER), "" when nothing does.
	Dormancy     string
	Busy         bool
	Running      bool
	KeepAwakeFor []Choice
}

// Choice is one option of a select: its value and label.
type Choice struct{ Value, Label string }

// Models is a user's model calls this month as their page shows them.
type Models struct {
	Month, Spent, Budget string
	Calls                int64
	// Left is what is left of the budget, "" when none applies.
	Left string
	// OwnKeys is what the calls made with their own keys cost them.
	OwnKeys string
	// BYOK offers a form per provider in Keys.
	BYOK bool
	Keys []ProviderKey
}

// ProviderKey is a provider and, when the user stored a key for it, the
// key's last four characters and when it was set.
type ProviderKey struct{ Provider, Hint, Set string }

// Slept says when and why the gateway last suspended a sandbox, for the
// user's pages: "Suspended 2 Dec 14:02 UTC because it was idle for 15
// minutes; your files were kept." "" when it never did.
func Slept(s *state.Suspension) string {
	if s == nil {
		return ""
	}
	return "Suspended " + s.At.UTC().Format("2 Jan 15:04 MST") + " because " + s.Detail + "; your files were kept."
}

// When is a moment for the user's pages, "" for none.
func When(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format("2 Jan 15:04:05 MST")
}

// Starting is the data of the page shown while a sandbox wakes.
type Starting struct {
	User   string
	Phase  string
	Reason string
	// Slept is why it was last suspended (Slept), "" if never.
	Slept string
	// Reload: the page reloads itself every few seconds instead of
	// following the gateway's status stream, which a sandbox origin does
	// not serve (every path there but the sign-in is the sandbox's); each
	// reload is a navigation, which wakes the sandbox and shows this page
	// again until it is Ready.
	Reload bool
}

// Problem is an error page.
type Problem struct {
	Status int
	Title  string
	Detail string
	// SignIn offers a link to the landing page.
	SignIn bool
}

// Admin is the data of the admin page.
type Admin struct {
	// Admin is who is looking.
	Admin string
	Rows  []AdminRow
	// Query, Phase, Profile and Revision are the filters shown; Next
	// links the next page. Profiles are the profiles to filter by (none:
	// one profile, and no column for it).
	Query, Phase, Profile, Revision string
	Phases, Profiles                []string
	Actions                         []string
	Total                           int
	Next                            string
	Notice                          string
	// Spend shows the spend and budget columns (Month's), the list in
	// Sort's order ("spend" or by name), linked by SortLink and NameLink.
	Spend              bool
	Sort, Month        string
	SortLink, NameLink string
	// Rollouts are each profile's rollout (ROLLOUT).
	Rollouts []AdminRollout
}

// AdminRollout is how far a profile's sandboxes have come to its
// template's revision (Target, "" when lifecycle could not read it):
// Done of Total are on it.
type AdminRollout struct {
	Profile, Target string
	Done, Total     int
	Revisions       []AdminRevision
}

// AdminRevision is one revision of a profile's sandboxes: how many are of
// it, and how many were rolled back from it (it is then halted).
type AdminRevision struct {
	Revision          string
	Sandboxes, Halted int
	Target            bool
}

// AdminRow is one user on the admin page.
type AdminRow struct {
	// User is the sandbox's key; a named sandbox's row says its Owner
	// and its name (Sandbox), and offers only what acts on a sandbox.
	User, Owner, Sandbox        string
	Phase, Profile, Reason, Pod string
	// Revision is the sandbox's pod template's (ROLLOUT); Halted the
	// revision a rollout was rolled back from here.
	Revision, Halted string
	Managed          bool
	Age, LastActive  string
	Sessions         int
	InFlight         string
	// URL is where the user's sandbox is reached (Sites.SandboxURL).
	URL string
	// Spent and Budget are the user's model spend this month and the
	// budget that applies.
	Spent, Budget string
	// Dormant marks an account unused for DORMANT_AFTER; DeleteAt is when
	// it will be deleted ("" never).
	Dormant  bool
	DeleteAt string
}

// AdminBudgetConfirm asks an administrator to confirm a budget change
// (What, in words), posting the same fields again to Path.
type AdminBudgetConfirm struct {
	Scope, Name, Path, USD, What string
	Unlimited, Clear             bool
}

// RenderAdminBudgetConfirm writes the page that confirms a budget change.
func RenderAdminBudgetConfirm(w io.Writer, d AdminBudgetConfirm) error {
	return pages.ExecuteTemplate(w, "admin_budget_confirm.html", d)
}

// Confirm asks a user to confirm a destructive action on their own
// account (Action: recreate or delete), posting to Path.
type Confirm struct {
	User, Action, Path string
	// Profiles, on the recreate page, are those the new sandbox may be
	// made of (none: no choice), Profile the current one.
	Profiles []Profile
	Profile  string
}

// Token shows a new bearer token once: User's, with where to go Back to.
type Token struct {
	User, Token, Back string
	// Note, when set, says why the token is shown instead of the usual
	// word on the token it replaced (a signup that could not sign in).
	Note string
}

// RenderToken writes the page that shows a new token.
func RenderToken(w io.Writer, d Token) error { return pages.ExecuteTemplate(w, "token.html", d) }

// RenderConfirm writes the page that confirms a user's action.
func RenderConfirm(w io.Writer, d Confirm) error { return pages.ExecuteTemplate(w, "confirm.html", d) }

// AdminAudit is the audit view: the filter shown (Since and Until RFC
// 3339) and the events, oldest first; More says there are more after
// them (NextQuery the next page's filter), ExportQuery is the filter for
// the export links.
type AdminAudit struct {
	User, Kind, Since, Until string
	Kinds                    []string
	Events                   []AuditRow
	More                     bool
	NextQuery, ExportQuery   template.URL
}

// AuditRow is one audit event on the audit view.
type AuditRow struct{ At, Kind, User, Outcome, Source, RequestID, Detail string }

// RenderAdminAudit writes the audit view.
func RenderAdminAudit(w io.Writer, d AdminAudit) error {
	return pages.ExecuteTemplate(w, "admin_audit.html", d)
}

// AdminConfirm asks an administrator to confirm an action.
type AdminConfirm struct{ User, Action string }

// RenderAdmin writes the admin page.
func RenderAdmin(w io.Writer, d Admin) error { return pages.ExecuteTemplate(w, "admin.html", d) }

// RenderAdminConfirm writes the page that confirms an admin action.
func RenderAdminConfirm(w io.Writer, d AdminConfirm) error {
	return pages.ExecuteTemplate(w, "admin_confirm.html", d)
}

// RenderLanding writes the landing page.
func RenderLanding(w io.Writer, d Landing) error { return pages.ExecuteTemplate(w, "landing.html", d) }

// RenderStarting writes the starting page as the answer to c.
func RenderStarting(c *fiber.Ctx, d Starting) error {
	return pages.ExecuteTemplate(c, "starting.html", onOrigin[Starting]{d, gatewayBase(c)})
}

// WantsHTML is the edge's one negotiation rule for every answer it writes
// itself, pages, JSON and errors alike: a request whose Accept names
// text/html gets a page; an API client's (a bearer token, a JSON body, an
// Accept naming JSON) JSON; of the rest, a GET or HEAD JSON (nothing asked
// for a page) and anything that changes something a page (a form or a
// button posts it, as browsers do).
func WantsHTML(c *fiber.Ctx) bool {
	accept := c.Get(fiber.HeaderAccept)
	switch {
	case strings.Contains(accept, fiber.MIMETextHTML):
		return true
	case strings.HasPrefix(c.Get(fiber.HeaderAuthorization), "Bearer "),
		strings.HasPrefix(c.Get(fiber.HeaderContentType), fiber.MIMEApplicationJSON),
		strings.Contains(accept, fiber.MIMEApplicationJSON):
		return false
	}
	m := c.Method()
	return m != fiber.MethodGet && m != fiber.MethodHead
}

// ShowToken answers with a token shown once: JSON for API clients, a page
// for browsers (back links where to go next). Never cached.
func ShowToken(c *fiber.Ctx, user, token, back string) error {
	c.Set(fiber.HeaderCacheControl, "no-store")
	if !WantsHTML(c) {
		return c.JSON(fiber.Map{"user": user, "token": token})
	}
	c.Type("html")
	return RenderToken(c, Token{User: user, Token: token, Back: back})
}

// problemJSON is an RFC 9457 problem document.
type problemJSON struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
}

// WriteProblem answers with d: the problem page, or
// application/problem+json, by WantsHTML. Every error the edge writes goes
// through it.
func WriteProblem(c *fiber.Ctx, d Problem) error {
	c.Status(d.Status)
	c.Set(fiber.HeaderCacheControl, "no-store")
	if WantsHTML(c) {
		c.Type("html")
		return pages.ExecuteTemplate(c, "problem.html", onOrigin[Problem]{d, gatewayBase(c)})
	}
	b, err := json.Marshal(problemJSON{Type: "about:blank", Title: d.Title, Status: d.Status, Detail: d.Detail})
	if err != nil {
		return err
	}
	c.Set(fiber.HeaderContentType, "application/problem+json")
	return c.Send(b)
}

// Asset returns an embedded static file and its content type.
func Asset(name string) ([]byte, string, bool) {
	b, err := fs.ReadFile(static, path.Join("static", path.Clean("/"+name)))
	if err != nil {
		return nil, "", false
	}
	return b, mime.TypeByExtension(path.Ext(name)), true
}
