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
	"strings"

	"github.com/gofiber/fiber/v2"
)

//go:embed templates/*.html
var templates embed.FS

//go:embed static
var static embed.FS

var pages = template.Must(template.New("").ParseFS(templates, "templates/*.html"))

// Landing is the data of the landing page.
type Landing struct {
	// User is the signed-in user, empty when signed out.
	User   string
	Phase  string
	Reason string
	// Invite asks for an invite code on signup; SSO hides the forms.
	Invite bool
	SSO    bool
	// Error is shown above the forms.
	Error      string
	MaxUserLen int
}

// Starting is the data of the page shown while a sandbox wakes.
type Starting struct {
	User   string
	Phase  string
	Reason string
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
	// Query and Phase are the filters shown; Next links the next page.
	Query, Phase string
	Phases       []string
	Actions      []string
	Total        int
	Next         string
	Notice       string
}

// AdminRow is one user on the admin page.
type AdminRow struct {
	User, Phase, Reason, Pod string
	Managed                  bool
	Age, LastActive          string
	Sessions                 int
	InFlight                 string
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

// RenderStarting writes the starting page.
func RenderStarting(w io.Writer, d Starting) error {
	return pages.ExecuteTemplate(w, "starting.html", d)
}

// RenderProblem writes an error page.
func RenderProblem(w io.Writer, d Problem) error { return pages.ExecuteTemplate(w, "problem.html", d) }

// WantsHTML is the edge's one negotiation rule for answers it writes
// itself: a page for requests that accept text/html (browser navigations
// and form posts), JSON for everything else (fetch, XHR, API clients).
func WantsHTML(c *fiber.Ctx) bool {
	return strings.Contains(c.Get(fiber.HeaderAccept), "text/html")
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
		return RenderProblem(c, d)
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
