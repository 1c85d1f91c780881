package web_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/web"
)

func TestWantsHTML(t *testing.T) {
	for _, tt := range []struct {
		name              string
		method            string
		accept, ct, authz string
		want              bool
	}{
		{"a browser's navigation", "GET", "text/html,application/xhtml+xml,*/*;q=0.8", "", "", true},
		{"a browser's form", "POST", "text/html", "application/x-www-form-urlencoded", "", true},
		{"a form with no Accept", "POST", "", "application/x-www-form-urlencoded", "", true},
		{"a button's POST", "POST", "*/*", "", "", true},
		{"fetch asking for JSON", "POST", "application/json", "", "", false},
		{"a JSON body", "POST", "*/*", "application/json", "", false},
		{"a bearer token", "POST", "*/*", "application/x-www-form-urlencoded", "Bearer ann.x", false},
		{"a bearer token from a page", "GET", "text/html", "", "Bearer ann.x", true},
		{"curl", "GET", "*/*", "", "", false},
		{"nothing said", "GET", "", "", "", false},
		{"a HEAD", "HEAD", "", "", "", false},
	} {
		app := fiber.New()
		app.All("/", func(c *fiber.Ctx) error {
			c.Set("X-Wants", "json")
			if web.WantsHTML(c) {
				c.Set("X-Wants", "html")
			}
			return nil
		})
		req := httptest.NewRequest(tt.method, "/", strings.NewReader(""))
		for k, v := range map[string]string{"Accept": tt.accept, "Content-Type": tt.ct, "Authorization": tt.authz} {
			if v != "" {
				req.Header.Set(k, v)
			}
		}
		res, err := app.Test(req)
		if err != nil {
			t.Fatal(err)
		}
		if got := res.Header.Get("X-Wants") == "html"; got != tt.want {
			t.Errorf("%s: html %v, want %v", tt.name, got, tt.want)
		}
	}
}

// Every error the edge answers goes through Fail: the status, title,
// Retry-After and body by one rule, and the cause in the log once, never
// in the answer.
func TestFail(t *testing.T) {
	var logs bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(&logs, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })
	secret := errors.New("dial tcp 10.0.0.7:3080: connection refused")
	for _, tt := range []struct {
		name       string
		err        error
		status     int
		title      string
		retryAfter string
		logged     bool
	}{
		{"a refusal", web.Refuse(http.StatusConflict, "already there"), http.StatusConflict, "Not possible", "", false},
		{"the bus away", web.Unavailable(secret), http.StatusServiceUnavailable, "Try again shortly", "2", true},
		{"a rate limit", &web.Error{Status: http.StatusTooManyRequests, Detail: "slow down", RetryAfter: 1500 * time.Millisecond}, http.StatusTooManyRequests, "Too many attempts", "2", false},
		{"its own title", &web.Error{Status: http.StatusForbidden, Title: "Not your sandbox", Detail: "another's"}, http.StatusForbidden, "Not your sandbox", "", false},
		{"the framework's", fiber.NewError(http.StatusMethodNotAllowed, "method not allowed"), http.StatusMethodNotAllowed, "Not possible", "", false},
		{"wrapped", errors.Join(errors.New("context"), web.Refuse(http.StatusNotFound, "no such user")), http.StatusNotFound, "Not found", "", false},
		{"anything else", secret, http.StatusInternalServerError, "Something went wrong", "", true},
	} {
		logs.Reset()
		app := fiber.New()
		app.Get("/", func(c *fiber.Ctx) error { return web.Fail(c, tt.err) })
		res, err := app.Test(httptest.NewRequest("GET", "/", nil))
		if err != nil {
			t.Fatal(err)
		}
		var doc struct {
			Title  string `json:"title"`
			Status int    `json:"status"`
			Detail string `json:"detail"`
		}
		b, _ := io.ReadAll(res.Body)
		if err := json.Unmarshal(b, &doc); err != nil || res.Header.Get("Content-Type") != "application/problem+json" {
			t.Fatalf("%s: %q %v", tt.name, b, err)
		}
		if res.StatusCode != tt.status || doc.Status != tt.status || doc.Title != tt.title || res.Header.Get("Retry-After") != tt.retryAfter {
			t.Errorf("%s: %d %+v Retry-After %q; want %d %q %q", tt.name, res.StatusCode, doc, res.Header.Get("Retry-After"), tt.status, tt.title, tt.retryAfter)
		}
		if strings.Contains(string(b), "10.0.0.7") {
			t.Errorf("%s: the cause reached the client: %s", tt.name, b)
		}
		if got := strings.Count(logs.String(), "10.0.0.7"); got != map[bool]int{true: 1}[tt.logged] {
			t.Errorf("%s: the cause logged %d times: %s", tt.name, got, logs.String())
		}
		if tt.status >= 500 && !strings.Contains(doc.Detail, "(request ") {
			t.Errorf("%s: a 5xx names no request id: %q", tt.name, doc.Detail)
		}
	}
	// A client that left gets its status and nothing else.
	app := fiber.New()
	app.Get("/", func(c *fiber.Ctx) error { return web.Fail(c, context.Canceled) })
	res, err := app.Test(httptest.NewRequest("GET", "/", nil))
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(res.Body); res.StatusCode != web.StatusClientClosed || len(b) != 0 {
		t.Errorf("client gone: %d %q", res.StatusCode, b)
	}
}
