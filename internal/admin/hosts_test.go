package admin

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
)

// app serves s's routes the way cmd/edge mounts them: the host policy
// (PUBLIC_HOSTS gw.example plus the admin hosts), the admin routes, and a
// stand-in for the proxy's /u/ route behind NoSandboxes.
func app(t *testing.T, s *Service) *fiber.App {
	t.Helper()
	pol, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: append([]string{"gw.example"}, s.o.Hosts...)})
	if err != nil {
		t.Fatal(err)
	}
	a := fiber.New(fiber.Config{DisableStartupMessage: true, StrictRouting: true, CaseSensitive: true, StreamRequestBody: true})
	a.Use(pol.Middleware)
	s.Register(a)
	a.All("/u/*", s.NoSandboxes, func(c *fiber.Ctx) error { return c.SendString("a tenant's byte") })
	return a
}

func get(t *testing.T, a *fiber.App, host, path, token string) (int, string) {
	t.Helper()
	req := httptest.NewRequest(http.MethodGet, path, nil)
	req.Host = host
	req.Header.Set("Accept", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := a.Test(req, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// With ADMIN_HOSTS, the admin view and API answer the administrator only
// on those hosts, and those hosts serve no /u/ route; the public host
// serves /u/ and no admin view. Without ADMIN_HOSTS (the laptop switch,
// or subdomain mode) the admin API answers on the public host.
func TestAdminHostsServeTheAdminViewAndNoSandbox(t *testing.T) {
	s, token := fixture(t, 3, Options{Hosts: []string{"admin.example"}, PublicHosts: []string{"gw.example", "gw2.example"}})
	a := app(t, s)
	for _, tc := range []struct {
		host, path, token string
		status            int
		body              string // a part of the answer
	}{
		{"admin.example", "/_/admin/users", token, 200, `"user":"u00001"`},
		{"admin.example", "/_/admin", token, 200, "Administration"},
		{"gw.example", "/_/admin/users", token, 404, "Cannot GET /_/admin/users"},
		{"gw.example", "/_/admin", token, 404, "Cannot GET /_/admin"},
		{"admin.example", "/_/admin/users", "", 404, "Cannot GET"},
		{"admin.example", "/u/u00001/", token, 404, "Sandboxes are at http://gw.example/u/"},
		{"admin.example", "/u/u00001/api/echo?x=1", "", 404, "serves the administration, not sandboxes"},
		{"gw.example", "/u/u00001/", token, 200, "a tenant's byte"},
	} {
		status, body := get(t, a, tc.host, tc.path, tc.token)
		if status != tc.status || !strings.Contains(body, tc.body) {
			t.Errorf("GET %s%s: %d %.200s; want %d with %q", tc.host, tc.path, status, body, tc.status, tc.body)
		}
		if tc.host == "admin.example" && strings.HasPrefix(tc.path, "/u/") && strings.Contains(body, "tenant") {
			t.Errorf("GET %s%s reached the proxy", tc.host, tc.path)
		}
	}

	// No admin hosts: the view is where the gateway is.
	s, token = fixture(t, 3, Options{})
	if status, body := get(t, app(t, s), "gw.example", "/_/admin/users", token); status != 200 || !strings.Contains(body, `"user":"u00001"`) {
		t.Errorf("without ADMIN_HOSTS: %d %.200s", status, body)
	}
}

// The view links each user to their sandbox: its own origin with
// SANDBOX_DOMAIN (the request's scheme, the domain's port), /u/<user>/ on
// the public host from an admin host, /u/<user>/ where the view is served
// otherwise; a name no account can have gets no link.
func TestAdminViewLinksToSandboxes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		where Options
		host  string
		want  string // u00001's link
	}{
		{"subdomain mode", Options{SandboxDomain: "sbx.example:8443"}, "gw.example", "http://u00001.sbx.example:8443/"},
		{"subdomain mode with an admin host", Options{SandboxDomain: "sbx.example", Hosts: []string{"admin.example"}}, "admin.example", "http://u00001.sbx.example/"},
		{"path mode from an admin host", Options{Hosts: []string{"admin.example"}, PublicHosts: []string{"gw.example", "gw2.example"}}, "admin.example", "http://gw.example/u/u00001/"},
		{"path mode from an admin host, PUBLIC_HOSTS *", Options{Hosts: []string{"admin.example"}, PublicHosts: []string{"*"}}, "admin.example", "/u/u00001/"},
		{"path mode, the laptop switch", Options{PublicHosts: []string{"gw.example", "gw2.example"}}, "gw.example", "/u/u00001/"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, token := fixture(t, 3, tc.where)
			a := app(t, s)
			status, body := get(t, a, tc.host, "/_/admin/users", token)
			if status != 200 {
				t.Fatalf("list: %d %s", status, body)
			}
			var p Page
			if err := json.Unmarshal([]byte(body), &p); err != nil {
				t.Fatal(err)
			}
			links := map[string]string{}
			for _, r := range p.Users {
				links[r.User] = r.URL
			}
			if links["u00001"] != tc.want {
				t.Errorf("u00001's link %q, want %q", links["u00001"], tc.want)
			}
			req := httptest.NewRequest(http.MethodGet, "/_/admin", nil)
			req.Host = tc.host
			req.Header.Set("Authorization", "Bearer "+token)
			resp, err := a.Test(req, -1)
			if err != nil {
				t.Fatal(err)
			}
			page, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if want := `id="open-u00001" href="` + tc.want + `"`; !strings.Contains(string(page), want) {
				t.Errorf("the page has no %s:\n%s", want, page)
			}
			a.Get("/link/:user", func(c *fiber.Ctx) error { return c.SendString(s.sandboxURL(c, c.Params("user"))) })
			for _, bad := range []string{"Zed", "5173-u00001", "a.b", "dshx"} {
				if _, link := get(t, a, tc.host, "/link/"+bad, ""); link != "" {
					t.Errorf("%q, no account's name, is linked to %q", bad, link)
				}
			}
		})
	}
}

// With the session cookie (credentials a browser attaches by itself), the
// admin view and list answer the gateway's own pages and addresses typed
// in, never a page of another origin: a sandbox origin is a sibling of the
// gateway (Sec-Fetch-Site same-site), which CORS alone would leave to read
// nothing but still get an answer. The token, sent on purpose, is judged
// by itself. The same cookie on the same path with the gateway's own
// Fetch Metadata is the positive control.
func TestAdminReadsWithTheCookieOnlyFromTheGatewaysPages(t *testing.T) {
	s, token := fixture(t, 3, Options{SandboxDomain: "sbx.example", PublicHosts: []string{"gw.example"}})
	a := app(t, s)
	sid, err := s.o.Auth.Store().Create(context.Background(), "u00001", "login")
	if err != nil {
		t.Fatal(err)
	}
	cookie := s.o.Auth.CookieName() + "=" + sid
	for _, tc := range []struct {
		name, path, cookie, token string
		headers                   map[string]string
		status                    int
	}{
		{"own page", "/_/admin/users", cookie, "", map[string]string{"Sec-Fetch-Site": "same-origin"}, 200},
		{"typed address", "/_/admin", cookie, "", map[string]string{"Sec-Fetch-Site": "none"}, 200},
		{"no fetch metadata (an API client)", "/_/admin/users", cookie, "", nil, 200},
		{"a sandbox origin's page", "/_/admin/users", cookie, "", map[string]string{"Sec-Fetch-Site": "same-site", "Origin": "http://ann.sbx.example"}, 403},
		{"a sandbox origin's navigation", "/_/admin", cookie, "", map[string]string{"Sec-Fetch-Site": "same-site"}, 403},
		{"another site", "/_/admin/users", cookie, "", map[string]string{"Sec-Fetch-Site": "cross-site"}, 403},
		{"a foreign Origin without fetch metadata", "/_/admin/users", cookie, "", map[string]string{"Origin": "http://ann.sbx.example"}, 403},
		{"the token from anywhere", "/_/admin/users", "", token, map[string]string{"Sec-Fetch-Site": "same-site"}, 200},
	} {
		req := httptest.NewRequest(http.MethodGet, tc.path, nil)
		req.Host = "gw.example"
		req.Header.Set("Accept", "application/json")
		if tc.cookie != "" {
			req.Header.Set("Cookie", tc.cookie)
		}
		if tc.token != "" {
			req.Header.Set("Authorization", "Bearer "+tc.token)
		}
		for k, v := range tc.headers {
			req.Header.Set(k, v)
		}
		resp, err := a.Test(req, -1)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s: GET %s = %d %.200s, want %d", tc.name, tc.path, resp.StatusCode, b, tc.status)
		}
		if tc.status == 403 && strings.Contains(string(b), "u00002") {
			t.Errorf("%s: the refusal carries the user list", tc.name)
		}
	}
}
