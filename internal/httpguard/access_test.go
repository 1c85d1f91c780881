package httpguard_test

import (
	"bufio"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
)

// lines are the JSON log lines written to logs so far.
func lines(t *testing.T, logs *testutil.Buffer) []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(logs.String()))
	for sc.Scan() {
		m := map[string]any{}
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

// accessServer is an edge-shaped app (Access outermost, then the
// policy) answering a few routes; trusted lists TRUSTED_PROXIES.
func accessServer(t *testing.T, trusted []netip.Prefix) (base string, logs *testutil.Buffer) {
	t.Helper()
	p, err := httpguard.NewPolicy(httpguard.Options{TrustedProxies: trusted, PublicHosts: []string{"*"}})
	if err != nil {
		t.Fatal(err)
	}
	logs = &testutil.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	a := fiber.New(fiber.Config{DisableStartupMessage: true})
	a.Use(p.Access(log), httpguard.ConsumeBody, httpguard.Recover(log), p.Middleware)
	a.Get("/u/ann/files", func(c *fiber.Ctx) error {
		httpguard.SetUser(c, "ann")
		return c.SendString("twelve bytes")
	})
	a.Get("/_/admin/users", func(c *fiber.Ctx) error { return fiber.NewError(fiber.StatusForbidden, "no") })
	a.Get("/healthz", func(c *fiber.Ctx) error { return c.SendString("ok") })
	a.Get("/login", func(c *fiber.Ctx) error { panic("boom") })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = a.Listener(ln) }()
	t.Cleanup(func() { _ = a.Shutdown() })
	return "http://" + ln.Addr().String(), logs
}

func get(t *testing.T, url string, header ...string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// Every request gets one access line with the status the client got,
// the body's length, the route's class (never its path or query), the
// user it was authenticated as and the id the client sees.
func TestAccessLine(t *testing.T) {
	base, logs := accessServer(t, nil)
	for _, tc := range []struct {
		path         string
		status       int
		route, user  string
		bytes        float64
		level, query string
	}{
		{"/u/ann/files", 200, "sandbox", "ann", 12, "INFO", "?code=sign-in-secret"},
		{"/_/admin/users", 403, "admin", "", -2, "INFO", ""},
		{"/healthz", 200, "probe", "", 2, "DEBUG", ""},
		{"/login", 500, "account", "", -2, "INFO", ""},
		{"/nowhere", 404, "account", "", -2, "INFO", ""},
	} {
		before := len(lines(t, logs))
		resp := get(t, base+tc.path+tc.query)
		rid := resp.Header.Get(ident.HeaderRequestID)
		if resp.StatusCode != tc.status || rid == "" {
			t.Fatalf("%s: %d, request id %q", tc.path, resp.StatusCode, rid)
		}
		var line map[string]any
		for _, l := range lines(t, logs)[before:] {
			if l["msg"] == "request" {
				if line != nil {
					t.Fatalf("%s: two access lines", tc.path)
				}
				line = l
			}
		}
		if line == nil {
			t.Fatalf("%s: no access line in %v", tc.path, lines(t, logs)[before:])
		}
		if line["request_id"] != rid || line["status"] != float64(tc.status) || line["route"] != tc.route ||
			line["user"] != tc.user || line["method"] != "GET" || line["level"] != tc.level {
			t.Errorf("%s: access line %v; want request id %s, status %d, route %s, user %q, level %s", tc.path, line, rid, tc.status, tc.route, tc.user, tc.level)
		}
		if _, ok := line["duration_us"].(float64); !ok {
			t.Errorf("%s: duration_us %v is not a number", tc.path, line["duration_us"])
		}
		if tc.bytes >= 0 && line["bytes"] != tc.bytes {
			t.Errorf("%s: bytes %v, want %v", tc.path, line["bytes"], tc.bytes)
		}
	}
	// The panic's line quotes the same id as the access line.
	var panicID, accessID any
	for _, l := range lines(t, logs) {
		switch {
		case l["msg"] == "handler panic":
			panicID = l["request_id"]
		case l["msg"] == "request" && l["status"] == float64(500):
			accessID = l["request_id"]
		}
	}
	if panicID == nil || panicID != accessID {
		t.Errorf("the panic was logged as request %v, its access line as %v", panicID, accessID)
	}
	if all := logs.String(); strings.Contains(all, "sign-in-secret") || strings.Contains(all, "/u/ann") {
		t.Error("a path or query reached the access log")
	}
}

// A trusted ingress's X-Request-Id is the request's id, if it is one;
// anybody else's, or a hostile one, is replaced by ours.
func TestRequestIDFromATrustedIngressOnly(t *testing.T) {
	trusted, _ := accessServer(t, []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")})
	untrusted, _ := accessServer(t, nil)
	for _, tc := range []struct {
		name, base, id string
		kept           bool
	}{
		{"ingress-nginx's hex", trusted, "4f2d3c1b0a9e8d7c6b5a49382716aabb", true},
		{"a UUID", trusted, "123e4567-e89b-12d3-a456-426614174000", true},
		{"from an untrusted peer", untrusted, "4f2d3c1b0a9e8d7c6b5a49382716aabb", false},
		{"a log-forging value", trusted, `x" level=ERROR msg=forged`, false},
		{"too long", trusted, strings.Repeat("a", 65), false},
		{"a newline, encoded", trusted, "a%0Ab", false},
	} {
		got := get(t, tc.base+"/healthz", ident.HeaderRequestID, tc.id).Header.Get(ident.HeaderRequestID)
		if (got == tc.id) != tc.kept || got == "" {
			t.Errorf("%s: request id %q (sent %q), kept %v", tc.name, got, tc.id, tc.kept)
		}
	}
}

func TestRouteOf(t *testing.T) {
	for _, tc := range []struct {
		path      string
		onSandbox bool
		want      string
	}{
		{"/u/ann/", false, "sandbox"},
		{"/_/admin", true, "sandbox"},
		{"/", true, "sandbox"},
		{"/healthz", false, "probe"},
		{"/readyz", false, "probe"},
		{"/_/admin", false, "admin"},
		{"/_/admin/users/bob/revoke", false, "admin"},
		{"/_/adminx", false, "account"},
		{"/_/status", false, "status"},
		{"/_/status/stream", false, "status"},
		{"/_/sandboxes/work/status", false, "status"},
		{"/_/sandboxes/work/status/stream", false, "status"},
		{"/_/sandboxes/work/suspend", false, "account"},
		{"/_/sandboxes", false, "account"},
		{"/_/static/gw.css", false, "static"},
		{"/users", false, "account"},
		{"/", false, "account"},
	} {
		if got := httpguard.RouteOf(tc.path, tc.onSandbox); got != tc.want {
			t.Errorf("RouteOf(%q, %v) = %q, want %q", tc.path, tc.onSandbox, got, tc.want)
		}
	}
}
