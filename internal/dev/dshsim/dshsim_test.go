package dshsim

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/fasthttp/websocket"
)

// The contract tests follow /work/shared/UPSTREAM.md point by point.

var (
	ansiCode  = regexp.MustCompile(`\x1b\[[0-9;]*[A-Za-z]`)
	tokenLine = regexp.MustCompile(`^dsh web: http://0\.0\.0\.0:(\d+)/\?token=([A-Za-z0-9_-]+)$`)
	setCookie = regexp.MustCompile(`^dsh-auth-([0-9a-f]+)=([A-Za-z0-9_-]+); Path=/; HttpOnly$`)
)

// tokenLines returns [port, token] for every token line, oldest first,
// ignoring ANSI colour codes around it.
func tokenLines(out string) [][2]string {
	var found [][2]string
	for line := range strings.SplitSeq(out, "\n") {
		if m := tokenLine.FindStringSubmatch(ansiCode.ReplaceAllString(line, "")); m != nil {
			found = append(found, [2]string{m[1], m[2]})
		}
	}
	return found
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func testOptions(t *testing.T) Options {
	dir := t.TempDir()
	return Options{
		Listen:    ":3080",
		DSHHome:   filepath.Join(dir, "dsh"),
		Workspace: filepath.Join(dir, "workspace"),
		AuthTTL:   time.Hour,
	}
}

type fixture struct {
	t      *testing.T
	srv    *Server
	ts     *httptest.Server
	out    *testutil.Buffer
	client *http.Client
}

func newFixture(t *testing.T, o Options) *fixture {
	t.Helper()
	out := &testutil.Buffer{}
	srv, err := NewServer(o, out)
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	// First (cleanups run last in, first out): a model call the browser
	// left goes on until shutdown, and Close waits for it.
	t.Cleanup(srv.stopStreams)
	client := ts.Client()
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &fixture{t: t, srv: srv, ts: ts, out: out, client: client}
}

func (f *fixture) request(method, path string, body io.Reader, cookie *http.Cookie) *http.Request {
	f.t.Helper()
	req, err := http.NewRequest(method, f.ts.URL+path, body)
	if err != nil {
		f.t.Fatalf("new request %s %s: %v", method, path, err)
	}
	if cookie != nil {
		req.AddCookie(cookie)
	}
	return req
}

func (f *fixture) do(req *http.Request) (*http.Response, string) {
	f.t.Helper()
	resp, err := f.client.Do(req)
	if err != nil {
		f.t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		f.t.Fatalf("read %s %s: %v", req.Method, req.URL, err)
	}
	return resp, string(body)
}

func (f *fixture) get(path string, cookie *http.Cookie) (*http.Response, string) {
	f.t.Helper()
	return f.do(f.request(http.MethodGet, path, nil, cookie))
}

func (f *fixture) status(method, path string, cookie *http.Cookie) int {
	f.t.Helper()
	resp, _ := f.do(f.request(method, path, nil, cookie))
	return resp.StatusCode
}

// handshake performs GET /?token=<current token> and returns the auth cookie.
func (f *fixture) handshake() *http.Cookie {
	f.t.Helper()
	resp, _ := f.get("/?token="+f.srv.Token(), nil)
	if resp.StatusCode != http.StatusSeeOther {
		f.t.Fatalf("handshake status = %d, want 303", resp.StatusCode)
	}
	cookies := resp.Cookies()
	if len(cookies) != 1 {
		f.t.Fatalf("handshake set %d cookies, want 1", len(cookies))
	}
	return cookies[0]
}

func cookieHeader(c *http.Cookie) string { return c.Name + "=" + c.Value }

func TestOptionsFromEnv(t *testing.T) {
	env := func(vars map[string]string) func(string) string {
		return func(k string) string { return vars[k] }
	}
	full := map[string]string{
		"HOME":               "/workspace",
		"DSHSIM_LISTEN":      ":9000",
		"DSH_HOME":           "/data/.dsh",
		"DSH_TRUSTED_HOSTS":  " a.example, ,B.example ",
		"DSH_AUTH_TTL":       "300ms",
		"DSHSIM_CRASH_AFTER": "2s",
		"DSHSIM_SLOW_START":  "1s",
		"DSHSIM_NO_TOKEN":    "1",
		"DSHSIM_NOISE":       "true",

		"DSHSIM_REFUSE_HANDSHAKE_AFTER": "9s",
		"DSHSIM_REFUSE_COOKIES":         "1",
		"DSHSIM_LOG_FLOOD":              "4096",
		"DSHSIM_VERSION":                "1.0.1",
	}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want Options
	}{{
		name: "defaults",
		env:  map[string]string{"HOME": "/workspace"},
		want: Options{Listen: ":3080", DSHHome: "/home/node/.dsh", Workspace: "/workspace", AuthTTL: 24 * time.Hour, Model: "deepseek-chat"},
	}, {
		name: "environment",
		env:  full,
		want: Options{
			Listen: ":9000", DSHHome: "/data/.dsh", Workspace: "/workspace",
			TrustedHosts: []string{"a.example", "B.example"}, AuthTTL: 300 * time.Millisecond,
			CrashAfter: 2 * time.Second, SlowStart: time.Second, NoToken: true, Noise: true,
			RefuseHandshakeAfter: 9 * time.Second, RefuseCookies: true, LogFlood: 4096, Model: "deepseek-chat", Version: "1.0.1",
		},
	}, {
		name: "flags win and positional arguments are skipped",
		args: []string{"web", "--listen", "127.0.0.1:1", "--crash-after=3s", "extra", "--no-token=false", "--slow-start", "5ms"},
		env:  full,
		want: Options{
			Listen: "127.0.0.1:1", DSHHome: "/data/.dsh", Workspace: "/workspace",
			TrustedHosts: []string{"a.example", "B.example"}, AuthTTL: 300 * time.Millisecond,
			CrashAfter: 3 * time.Second, SlowStart: 5 * time.Millisecond, NoToken: false, Noise: true,
			RefuseHandshakeAfter: 9 * time.Second, RefuseCookies: true, LogFlood: 4096, Model: "deepseek-chat", Version: "1.0.1",
		},
	}, {
		name: "DSH Web's own command line",
		args: []string{"web", "--host", "0.0.0.0", "--port", "3080"},
		env:  map[string]string{"HOME": "/workspace"},
		want: Options{Listen: "0.0.0.0:3080", DSHHome: "/home/node/.dsh", Workspace: "/workspace", AuthTTL: 24 * time.Hour, Model: "deepseek-chat"},
	}, {
		name: "port alone keeps the default host",
		args: []string{"web", "--port=4000"},
		env:  map[string]string{"HOME": "/workspace", "DSHSIM_LISTEN": "127.0.0.1:9"},
		want: Options{Listen: "127.0.0.1:4000", DSHHome: "/home/node/.dsh", Workspace: "/workspace", AuthTTL: 24 * time.Hour, Model: "deepseek-chat"},
	}, {
		name: "the first provider base URL set wins, with its own key",
		env: map[string]string{"HOME": "/workspace", "OPENAI_BASE_URL": "http://broker:8090/openai", "OPENAI_API_KEY": "o-key",
			"DEEPSEEK_BASE_URL": "http://broker:8090/deepseek/", "DEEPSEEK_API_KEY": "d-key", "ANTHROPIC_BASE_URL": "http://broker:8090/anthropic",
			"DSHSIM_MODEL": "deepseek-reasoner", "DEVCLUSTER_POD_IP": "127.0.0.9"},
		want: Options{Listen: ":3080", DSHHome: "/home/node/.dsh", Workspace: "/workspace", AuthTTL: 24 * time.Hour, Model: "deepseek-reasoner",
			Provider: Provider{Name: "deepseek", BaseURL: "http://broker:8090/deepseek", Key: "d-key"}, SourceIP: netip.MustParseAddr("127.0.0.9")},
	}, {
		name: "anthropic",
		env:  map[string]string{"HOME": "/workspace", "ANTHROPIC_BASE_URL": "https://api.anthropic.com", "ANTHROPIC_API_KEY": "a-key", "OPENAI_API_KEY": "o-key"},
		want: Options{Listen: ":3080", DSHHome: "/home/node/.dsh", Workspace: "/workspace", AuthTTL: 24 * time.Hour, Model: "deepseek-chat",
			Provider: Provider{Name: "anthropic", BaseURL: "https://api.anthropic.com", Key: "a-key"}},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := OptionsFromEnv(tt.args, env(tt.env))
			if err != nil {
				t.Fatalf("OptionsFromEnv: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("OptionsFromEnv =\n%+v\nwant\n%+v", got, tt.want)
			}
		})
	}

	bad := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"bad ttl", nil, map[string]string{"HOME": "/w", "DSH_AUTH_TTL": "soon"}, "DSH_AUTH_TTL"},
		{"zero ttl", nil, map[string]string{"HOME": "/w", "DSH_AUTH_TTL": "0s"}, "DSH_AUTH_TTL must be positive"},
		{"bad bool", nil, map[string]string{"HOME": "/w", "DSHSIM_NO_TOKEN": "maybe"}, "DSHSIM_NO_TOKEN"},
		{"bad refusal delay", nil, map[string]string{"HOME": "/w", "DSHSIM_REFUSE_HANDSHAKE_AFTER": "later"}, "DSHSIM_REFUSE_HANDSHAKE_AFTER"},
		{"bad refuse bool", nil, map[string]string{"HOME": "/w", "DSHSIM_REFUSE_COOKIES": "sometimes"}, "DSHSIM_REFUSE_COOKIES"},
		{"negative flood", nil, map[string]string{"HOME": "/w", "DSHSIM_LOG_FLOOD": "-1"}, "DSHSIM_LOG_FLOOD"},
		{"unknown flag", []string{"--bogus"}, map[string]string{"HOME": "/w"}, "bogus"},
		{"bad flag duration", []string{"web", "--crash-after", "x"}, map[string]string{"HOME": "/w"}, "crash-after"},
		{"bad port", []string{"web", "--port", "http"}, map[string]string{"HOME": "/w"}, "--port"},
		{"port out of range", []string{"web", "--port", "70000"}, map[string]string{"HOME": "/w"}, "--port"},
		{"base URL not a URL", nil, map[string]string{"HOME": "/w", "OPENAI_BASE_URL": "broker:8090"}, "OPENAI_BASE_URL"},
		{"base URL not http", nil, map[string]string{"HOME": "/w", "DEEPSEEK_BASE_URL": "file:///etc/passwd"}, "DEEPSEEK_BASE_URL"},
		{"bad model", nil, map[string]string{"HOME": "/w", "DSHSIM_MODEL": "a model"}, "DSHSIM_MODEL"},
		{"bad pod IP", nil, map[string]string{"HOME": "/w", "DEVCLUSTER_POD_IP": "pod"}, "DEVCLUSTER_POD_IP"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			_, err := OptionsFromEnv(tt.args, env(tt.env))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("OptionsFromEnv error = %v, want it to mention %q", err, tt.want)
			}
		})
	}
}

// Contract: DSH_HOME holds sessions and .credentials.yaml, created 0600;
// the workspace is $HOME.
func TestStartupCreatesState(t *testing.T) {
	o := testOptions(t)
	if _, err := NewServer(o, io.Discard); err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	wantMode := map[string]os.FileMode{
		o.DSHHome:                            os.ModeDir | 0o700,
		filepath.Join(o.DSHHome, "sessions"): os.ModeDir | 0o700,
		filepath.Join(o.DSHHome, ".credentials.yaml"): 0o600,
	}
	for path, want := range wantMode {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatalf("stat: %v", err)
		}
		if fi.Mode() != want {
			t.Errorf("%s mode = %v, want %v", path, fi.Mode(), want)
		}
	}
	if fi, err := os.Stat(o.Workspace); err != nil || !fi.IsDir() {
		t.Errorf("workspace %s not created: %v", o.Workspace, err)
	}

	// An existing 0600 file is kept as it is.
	creds := filepath.Join(o.DSHHome, ".credentials.yaml")
	if err := os.WriteFile(creds, []byte("api_key: x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := NewServer(o, io.Discard); err != nil {
		t.Fatalf("NewServer with 0600 credentials: %v", err)
	}
	if b, _ := os.ReadFile(creds); string(b) != "api_key: x\n" {
		t.Errorf("credentials rewritten to %q", b)
	}
}

// Contract: refuse to start when .credentials.yaml has a group/other bit.
func TestStartupRefusesLooseCredentials(t *testing.T) {
	for _, mode := range []os.FileMode{0o640, 0o660, 0o604, 0o601} {
		t.Run(fmt.Sprintf("%04o", mode), func(t *testing.T) {
			o := testOptions(t)
			creds := filepath.Join(o.DSHHome, ".credentials.yaml")
			if err := os.MkdirAll(o.DSHHome, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(creds, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(creds, mode); err != nil {
				t.Fatal(err)
			}
			out := &testutil.Buffer{}
			_, err := NewServer(o, out)
			want := fmt.Sprintf("refusing to start: %s has mode %04o; it must be 0600 (no group/other access)", creds, mode)
			if err == nil || err.Error() != want {
				t.Fatalf("NewServer error = %v, want %q", err, want)
			}
			if got := out.String(); got != "dsh: "+want+"\n" {
				t.Errorf("stdout = %q, want the refusal", got)
			}
		})
	}
}

// Contract: GET /?token=<token> answers 303 with the dsh-auth cookie; the
// token is URL-safe base64.
func TestHandshake(t *testing.T) {
	f := newFixture(t, testOptions(t))
	token := f.srv.Token()
	if raw, err := base64.RawURLEncoding.DecodeString(token); err != nil || len(raw) != 32 {
		t.Fatalf("token %q is not 32 bytes of URL-safe base64: %v", token, err)
	}

	resp, _ := f.get("/?token="+token, nil)
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("status = %d, want 303", resp.StatusCode)
	}
	if loc := resp.Header.Get("Location"); loc != "./" {
		t.Errorf("Location = %q, want ./", loc)
	}
	sc := resp.Header.Values("Set-Cookie")
	if len(sc) != 1 || !setCookie.MatchString(sc[0]) {
		t.Fatalf("Set-Cookie = %q, want dsh-auth-<id>=<value>; Path=/; HttpOnly", sc)
	}

	cookie := resp.Cookies()[0]
	resp, body := f.get("/", cookie)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<base href="./">`) {
		t.Fatalf("GET / with cookie = %d %q, want the app page", resp.StatusCode, body)
	}

	// Each handshake issues a new, independently valid cookie.
	second := f.handshake()
	if second.Value == cookie.Value || second.Name != cookie.Name {
		t.Errorf("second cookie %s=%s, first %s=%s", second.Name, second.Value, cookie.Name, cookie.Value)
	}
	for _, c := range []*http.Cookie{cookie, second} {
		if got := f.status(http.MethodGet, "/api/files", c); got != http.StatusOK {
			t.Errorf("GET /api/files with %s = %d, want 200", c.Value, got)
		}
	}
}

// Contract: any other request without a valid dsh-auth cookie answers 401.
func TestUnauthenticatedRequestsAre401(t *testing.T) {
	f := newFixture(t, testOptions(t))
	valid := f.handshake()
	for _, path := range []string{"/", "/app.js", "/style.css", "/api/files", "/api/files/x", "/api/echo", "/api/events", "/api/chat", "/settings", "/settings/", "/nope", "/a/../b", "/?token=", "/?token=wrong"} {
		resp, body := f.get(path, nil)
		if resp.StatusCode != http.StatusUnauthorized || body != "unauthorized\n" {
			t.Errorf("GET %s without cookie = %d %q, want 401 unauthorized", path, resp.StatusCode, body)
		}
	}
	if got := f.status(http.MethodPut, "/api/files/x", nil); got != http.StatusUnauthorized {
		t.Errorf("PUT /api/files/x without cookie = %d, want 401", got)
	}
	forged := []*http.Cookie{
		{Name: valid.Name, Value: "forged"},
		{Name: authCookiePrefix + "00000000", Value: valid.Value}, // another instance's cookie name
	}
	for _, c := range forged {
		if got := f.status(http.MethodGet, "/", c); got != http.StatusUnauthorized {
			t.Errorf("GET / with cookie %s=%s = %d, want 401", c.Name, c.Value, got)
		}
	}
	if ws, err := os.ReadDir(f.srv.opts.Workspace); err != nil || len(ws) != 0 {
		t.Errorf("workspace after unauthenticated PUT = %v, %v; want empty", ws, err)
	}
}

// Contract: /favicon.svg needs no auth (probes use it).
func TestFaviconNeedsNoAuth(t *testing.T) {
	f := newFixture(t, testOptions(t))
	for _, method := range []string{http.MethodGet, http.MethodHead} {
		resp, body := f.do(f.request(method, "/favicon.svg", nil, nil))
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "image/svg+xml" {
			t.Fatalf("%s /favicon.svg = %d %s, want 200 image/svg+xml", method, resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		if method == http.MethodGet && !strings.HasPrefix(body, "<svg") {
			t.Errorf("favicon body = %q, want an SVG", body)
		}
	}
}

// Contract: auth cookies expire after DSH_AUTH_TTL; a new handshake fixes it.
// The server's clock is the test's, so both sides of the TTL are asserted.
func TestAuthCookieExpires(t *testing.T) {
	o := testOptions(t)
	o.AuthTTL = time.Hour
	f := newFixture(t, o)
	var mu sync.Mutex
	now := time.Unix(1_000_000, 0)
	f.srv.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	at := func(d time.Duration) { mu.Lock(); now = time.Unix(1_000_000, 0).Add(d); mu.Unlock() }
	cookie := f.handshake()
	at(o.AuthTTL - time.Nanosecond)
	if got := f.status(http.MethodGet, "/", cookie); got != http.StatusOK {
		t.Fatalf("cookie just within its TTL: GET / = %d, want 200", got)
	}
	at(o.AuthTTL + time.Nanosecond)
	if got := f.status(http.MethodGet, "/", cookie); got != http.StatusUnauthorized {
		t.Fatalf("cookie past its TTL: GET / = %d, want 401", got)
	}
	// Expired once is expired for good, even if the clock went back.
	at(0)
	if got := f.status(http.MethodGet, "/", cookie); got != http.StatusUnauthorized {
		t.Fatalf("expired cookie again: GET / = %d, want 401", got)
	}
	if got := f.status(http.MethodGet, "/", f.handshake()); got != http.StatusOK {
		t.Errorf("after a new handshake GET / = %d, want 200", got)
	}
}

// A hostile pod: every handshake is refused, but only after the delay, and
// a client that gives up first gets nothing at all.
func TestRefuseHandshakeAfter(t *testing.T) {
	o := testOptions(t)
	o.RefuseHandshakeAfter = 300 * time.Millisecond
	f := newFixture(t, o)
	begin := time.Now()
	resp, _ := f.get("/?token="+f.srv.Token(), nil)
	if resp.StatusCode != http.StatusUnauthorized || len(resp.Cookies()) != 0 {
		t.Fatalf("handshake with the real token = %d, %d cookies; want 401 and none", resp.StatusCode, len(resp.Cookies()))
	}
	if took := time.Since(begin); took < o.RefuseHandshakeAfter {
		t.Fatalf("refused after %s, before the %s delay", took, o.RefuseHandshakeAfter)
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.RefuseHandshakeAfter/3)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, f.ts.URL+"/?token="+f.srv.Token(), nil)
	if resp, err := f.client.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("a client that gave up got %d", resp.StatusCode)
	} else if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a client that gave up: %v, want its own deadline", err)
	}
}

// A DSH that refuses every cookie: the handshake succeeds, and every
// request made with its cookie is 401, as with an expired one.
func TestRefuseCookies(t *testing.T) {
	o := testOptions(t)
	o.RefuseCookies = true
	f := newFixture(t, o)
	cookie := f.handshake()
	for _, path := range []string{"/", "/api/files", "/app.js"} {
		if got := f.status(http.MethodGet, path, cookie); got != http.StatusUnauthorized {
			t.Errorf("GET %s with a fresh cookie = %d, want 401", path, got)
		}
	}
	if resp, _ := f.get("/favicon.svg", nil); resp.StatusCode != http.StatusOK {
		t.Errorf("the favicon (probes) = %d, want 200", resp.StatusCode)
	}
}

func TestRotate(t *testing.T) {
	f := newFixture(t, testOptions(t))
	oldToken, oldCookie := f.srv.Token(), f.handshake()

	f.srv.Rotate()
	newToken := f.srv.Token()
	if newToken == oldToken {
		t.Fatal("Rotate kept the token")
	}
	lines := tokenLines(f.out.String())
	if len(lines) == 0 || lines[len(lines)-1] != [2]string{"3080", newToken} {
		t.Fatalf("token lines after Rotate = %v, want the last to carry port 3080 and %s", lines, newToken)
	}
	if got := f.status(http.MethodGet, "/", oldCookie); got != http.StatusUnauthorized {
		t.Errorf("old cookie after Rotate: GET / = %d, want 401", got)
	}
	if got := f.status(http.MethodGet, "/?token="+oldToken, nil); got != http.StatusUnauthorized {
		t.Errorf("old token after Rotate: handshake = %d, want 401", got)
	}
	if got := f.status(http.MethodGet, "/", f.handshake()); got != http.StatusOK {
		t.Errorf("new handshake after Rotate: GET / = %d, want 200", got)
	}
}

// Contract: a Host outside DSH_TRUSTED_HOSTS answers 403; localhost and
// 127.0.0.1 are always trusted, with any port.
func TestHostCheck(t *testing.T) {
	o := testOptions(t)
	o.TrustedHosts = []string{"dsh.example.com", "fd00::1"}
	f := newFixture(t, o)
	cookie := f.handshake()
	trusted := []string{"localhost", "localhost:3080", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:9999", "dsh.example.com", "DSH.Example.COM:8443", "[fd00::1]:3080", "[fd00::1]"}
	untrusted := []string{"evil.example", "evil.example:3080", "dsh.example.com.evil.example", "127.0.0.2", "[::1]:3080", "localhost.evil"}
	for _, host := range trusted {
		for path, want := range map[string]int{"/favicon.svg": http.StatusOK, "/api/files": http.StatusOK} {
			req := f.request(http.MethodGet, path, nil, cookie)
			req.Host = host
			if resp, body := f.do(req); resp.StatusCode != want {
				t.Errorf("Host %s: GET %s = %d %q, want %d", host, path, resp.StatusCode, body, want)
			}
		}
	}
	for _, host := range untrusted {
		for _, path := range []string{"/favicon.svg", "/", "/?token=" + f.srv.Token()} {
			req := f.request(http.MethodGet, path, nil, cookie)
			req.Host = host
			resp, body := f.do(req)
			if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, hostname(host)) {
				t.Errorf("Host %s: GET %s = %d %q, want 403 naming the host", host, path, resp.StatusCode, body)
			}
		}
	}
}

// Contract: GET / is the app page with <base href="./"> and only relative URLs.
func TestAppPage(t *testing.T) {
	f := newFixture(t, testOptions(t))
	cookie := f.handshake()
	resp, page := f.get("/", cookie)
	if ct := resp.Header.Get("Content-Type"); ct != "text/html; charset=utf-8" {
		t.Errorf("GET / Content-Type = %q", ct)
	}
	for _, want := range []string{`<base href="./">`, `src="app.js"`, `href="style.css"`, `href="settings/"`,
		`id="chat-input"`, `id="chat-model"`, `id="chat-log"`, `id="ws-input"`, `id="ws-log"`, `id="events"`, `id="files"`, `id="upload"`} {
		if !strings.Contains(page, want) {
			t.Errorf("app page lacks %s", want)
		}
	}
	resp, js := f.get("/app.js", cookie)
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/javascript") {
		t.Fatalf("GET /app.js = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	for _, want := range []string{`"api/ws"`, `"api/events?interval=1000&count=1000000"`, `"api/chat"`, `"api/files"`, `"api/files/"`, `"PUT"`, `"POST"`} {
		if !strings.Contains(js, want) {
			t.Errorf("app.js lacks %s", want)
		}
	}
	rootAbsolute := regexp.MustCompile("(src|href)=\"/|[\"'`]/[a-z]")
	for name, text := range map[string]string{"index.html": page, "app.js": js} {
		if m := rootAbsolute.FindString(text); m != "" {
			t.Errorf("%s has a root-absolute URL: %s", name, m)
		}
	}
	if resp, _ := f.get("/style.css", cookie); resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/css") {
		t.Errorf("GET /style.css = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
}

func dialWS(t *testing.T, f *fixture, cookie *http.Cookie) *websocket.Conn {
	t.Helper()
	wsURL := "ws" + strings.TrimPrefix(f.ts.URL, "http") + "/api/ws"
	conn, resp, err := websocket.DefaultDialer.Dial(wsURL, http.Header{"Cookie": {cookieHeader(cookie)}})
	if err != nil {
		t.Fatalf("dial %s: %v (response %v)", wsURL, err, resp)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Contract: /api/ws echoes text and binary frames; big:<n> sends n bytes.
func TestWebSocket(t *testing.T) {
	f := newFixture(t, testOptions(t))
	wsURL := "ws" + strings.TrimPrefix(f.ts.URL, "http") + "/api/ws"
	if _, resp, err := websocket.DefaultDialer.Dial(wsURL, nil); err == nil || resp == nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("dial without cookie: err %v, response %v; want 401", err, resp)
	}

	conn := dialWS(t, f, f.handshake())
	roundTrip := func(kind int, data []byte) (int, []byte) {
		t.Helper()
		if err := conn.WriteMessage(kind, data); err != nil {
			t.Fatalf("write: %v", err)
		}
		gotKind, got, err := conn.ReadMessage()
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		return gotKind, got
	}

	if kind, got := roundTrip(websocket.TextMessage, []byte("hello")); kind != websocket.TextMessage || string(got) != "hello" {
		t.Errorf("text echo = %d %q", kind, got)
	}
	bin := []byte{0, 1, 2, 0xfe, 0xff}
	if kind, got := roundTrip(websocket.BinaryMessage, bin); kind != websocket.BinaryMessage || !bytes.Equal(got, bin) {
		t.Errorf("binary echo = %d %v", kind, got)
	}
	const big = 17 << 20
	kind, got := roundTrip(websocket.TextMessage, fmt.Appendf(nil, "big:%d", big))
	if kind != websocket.BinaryMessage || len(got) != big {
		t.Fatalf("big:%d answered kind %d with %d bytes", big, kind, len(got))
	}
	if !bytes.HasPrefix(got, []byte("abcdefghijklmnopqrstuvwxyzabc")) {
		t.Errorf("big message starts %q", got[:29])
	}
	if kind, got := roundTrip(websocket.TextMessage, []byte("big:lots")); kind != websocket.TextMessage || string(got) != "big:lots" {
		t.Errorf("malformed big request = %d %q, want a plain echo", kind, got)
	}

	pongs := make(chan string, 1)
	conn.SetPongHandler(func(data string) error { pongs <- data; return nil })
	if err := conn.WriteControl(websocket.PingMessage, []byte("p1"), time.Now().Add(5*time.Second)); err != nil {
		t.Fatalf("ping: %v", err)
	}
	roundTrip(websocket.TextMessage, []byte("after ping")) // the pong is handled while reading
	select {
	case got := <-pongs:
		if got != "p1" {
			t.Errorf("pong = %q, want p1", got)
		}
	default:
		t.Error("no pong before the next echo")
	}
}

type sseEvent struct{ id, event, data string }

// readEvent reads one SSE event; io.EOF means the stream ended cleanly.
func readEvent(r *bufio.Reader) (sseEvent, error) {
	var ev sseEvent
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			if err == io.EOF && line == "" && ev == (sseEvent{}) {
				return ev, io.EOF
			}
			return ev, fmt.Errorf("read event: %w", err)
		}
		line = strings.TrimSuffix(line, "\n")
		if line == "" {
			return ev, nil
		}
		field, value, _ := strings.Cut(line, ": ")
		switch field {
		case "id":
			ev.id = value
		case "event":
			ev.event = value
		case "data":
			ev.data = value
		}
	}
}

// Contract: /api/events sends count events, one every interval ms, each
// flushed as it is produced.
func TestEvents(t *testing.T) {
	f := newFixture(t, testOptions(t))
	cookie := f.handshake()

	// An endless stream: the first event can only be read if it is flushed.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := f.request(http.MethodGet, "/api/events?interval=1000&count=1000000", nil, cookie).WithContext(ctx)
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatalf("GET /api/events: %v", err)
	}
	if ct, cc := resp.Header.Get("Content-Type"), resp.Header.Get("Cache-Control"); ct != "text/event-stream" || cc != "no-cache" {
		t.Errorf("Content-Type %q, Cache-Control %q", ct, cc)
	}
	ev, err := readEvent(bufio.NewReader(resp.Body))
	if err != nil {
		t.Fatalf("first event: %v", err)
	}
	var data struct {
		I  int    `json:"i"`
		At string `json:"at"`
	}
	if err := json.Unmarshal([]byte(ev.data), &data); err != nil {
		t.Fatalf("event data %q: %v", ev.data, err)
	}
	if _, err := time.Parse(time.RFC3339Nano, data.At); ev.id != "1" || ev.event != "tick" || data.I != 1 || err != nil {
		t.Errorf("first event = %+v (at: %v)", ev, err)
	}
	resp.Body.Close()
	// The handler logs once it returns, which it does when the client leaves.
	eventually(t, "the endless stream to stop after the client left", func() bool {
		return strings.Contains(f.out.String(), "dsh: GET /api/events 200")
	})

	resp, err = f.client.Do(f.request(http.MethodGet, "/api/events?interval=10&count=3", nil, cookie))
	if err != nil {
		t.Fatalf("GET /api/events: %v", err)
	}
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	var ids []string
	for {
		ev, err := readEvent(r)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ev.id)
	}
	if strings.Join(ids, ",") != "1,2,3" {
		t.Errorf("event ids = %v, want 1,2,3", ids)
	}

	if got := f.status(http.MethodGet, "/api/events?interval=soon", cookie); got != http.StatusBadRequest {
		t.Errorf("bad interval = %d, want 400", got)
	}
}

func postChat(t *testing.T, f *fixture, cookie *http.Cookie, body string) (int, []sseEvent) {
	t.Helper()
	req := f.request(http.MethodPost, "/api/chat", strings.NewReader(body), cookie)
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatalf("POST /api/chat: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, nil
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("chat Content-Type = %q", ct)
	}
	r := bufio.NewReader(resp.Body)
	var events []sseEvent
	for {
		ev, err := readEvent(r)
		if err == io.EOF {
			return resp.StatusCode, events
		}
		if err != nil {
			t.Fatal(err)
		}
		events = append(events, ev)
	}
}

func chatHistory(t *testing.T, f *fixture, cookie *http.Cookie, session string) []chatMessage {
	t.Helper()
	resp, body := f.get("/api/chat?session="+session, cookie)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET history %s = %d %q", session, resp.StatusCode, body)
	}
	var history []chatMessage
	if err := json.Unmarshal([]byte(body), &history); err != nil {
		t.Fatalf("history %q: %v", body, err)
	}
	return history
}

// Contract: POST /api/chat streams the reply token by token and appends it
// to a session file in DSH_HOME/sessions so conversations persist.
func TestChat(t *testing.T) {
	o := testOptions(t)
	f := newFixture(t, o)
	cookie := f.handshake()

	status, events := postChat(t, f, cookie, `{"message":"hello  there world","session":"s-1"}`)
	if status != http.StatusOK || len(events) == 0 {
		t.Fatalf("chat = %d with %d events", status, len(events))
	}
	var words []string
	for _, ev := range events[:len(events)-1] {
		words = append(words, ev.data)
	}
	if strings.Join(words, "|") != "You|said:|hello|there|world" || events[len(events)-1].event != "done" {
		t.Fatalf("chat stream = %+v", events)
	}
	postChat(t, f, cookie, `{"message":"again","session":"s-1"}`)
	postChat(t, f, cookie, `{"message":"no session"}`)

	want := []chatMessage{
		{"user", "hello  there world"}, {"assistant", "You said: hello  there world"},
		{"user", "again"}, {"assistant", "You said: again"},
	}
	if got := chatHistory(t, f, cookie, "s-1"); !reflect.DeepEqual(got, want) {
		t.Errorf("history s-1 = %+v, want %+v", got, want)
	}
	if got := chatHistory(t, f, cookie, ""); len(got) != 2 || got[0].Text != "no session" {
		t.Errorf("default session history = %+v", got)
	}
	if got := chatHistory(t, f, cookie, "never-used"); got == nil || len(got) != 0 {
		t.Errorf("unused session history = %#v, want []", got)
	}
	for _, name := range []string{"s-1.jsonl", "default.jsonl"} {
		if _, err := os.Stat(filepath.Join(o.DSHHome, "sessions", name)); err != nil {
			t.Errorf("session file: %v", err)
		}
	}

	// A new process with the same DSH_HOME sees the conversation.
	restarted := newFixture(t, o)
	if got := chatHistory(t, restarted, restarted.handshake(), "s-1"); !reflect.DeepEqual(got, want) {
		t.Errorf("history after restart = %+v, want %+v", got, want)
	}
}

func TestChatRejectsBadSessions(t *testing.T) {
	f := newFixture(t, testOptions(t))
	cookie := f.handshake()
	for _, session := range []string{"../etc", "a b", "a/b", "a.b", "é", strings.Repeat("a", 65)} {
		body, _ := json.Marshal(map[string]string{"message": "hi", "session": session})
		if status, _ := postChat(t, f, cookie, string(body)); status != http.StatusBadRequest {
			t.Errorf("POST session %q = %d, want 400", session, status)
		}
		req := f.request(http.MethodGet, "/api/chat", nil, cookie)
		req.URL.RawQuery = url.Values{"session": {session}}.Encode()
		if resp, _ := f.do(req); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("GET session %q = %d, want 400", session, resp.StatusCode)
		}
	}
	if status, _ := postChat(t, f, cookie, `{"message":`); status != http.StatusBadRequest {
		t.Errorf("malformed JSON = %d, want 400", status)
	}
	if status, _ := postChat(t, f, cookie, `{"message":"hi","session":"`+strings.Repeat("a", 64)+`"}`); status != http.StatusOK {
		t.Errorf("64-character session = %d, want 200", status)
	}
	entries, err := os.ReadDir(filepath.Join(f.srv.opts.DSHHome, "sessions"))
	if err != nil || len(entries) != 1 {
		t.Errorf("session files = %v, %v; want only the valid one", entries, err)
	}
}

// Contract: PUT /api/files/<name> streams the body to disk and answers size
// and SHA-256; GET returns it; GET /api/files lists the workspace.
func TestFiles(t *testing.T) {
	o := testOptions(t)
	f := newFixture(t, o)
	cookie := f.handshake()
	if err := os.Mkdir(filepath.Join(o.Workspace, "zdir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(o.Workspace, "a.txt"), []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}

	const size = 64 << 20
	sent := sha256.New()
	body := io.TeeReader(io.LimitReader(rand.NewChaCha8([32]byte{1}), size), sent)
	req := f.request(http.MethodPut, "/api/files/big.bin", body, cookie)
	resp, text := f.do(req)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("PUT big.bin = %d %q", resp.StatusCode, text)
	}
	var put struct {
		Name   string `json:"name"`
		Size   int64  `json:"size"`
		SHA256 string `json:"sha256"`
	}
	if err := json.Unmarshal([]byte(text), &put); err != nil {
		t.Fatalf("PUT response %q: %v", text, err)
	}
	wantSum := hex.EncodeToString(sent.Sum(nil))
	if put.Name != "big.bin" || put.Size != size || put.SHA256 != wantSum {
		t.Errorf("PUT response = %+v, want big.bin %d %s", put, size, wantSum)
	}

	resp, err := f.client.Do(f.request(http.MethodGet, "/api/files/big.bin", nil, cookie))
	if err != nil {
		t.Fatal(err)
	}
	got := sha256.New()
	n, err := io.Copy(got, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || n != size || hex.EncodeToString(got.Sum(nil)) != wantSum {
		t.Errorf("GET big.bin = %d, %d bytes, err %v; want the uploaded bytes", resp.StatusCode, n, err)
	}

	// Uploading over an existing file replaces it.
	if resp, text := f.do(f.request(http.MethodPut, "/api/files/a.txt", strings.NewReader("new"), cookie)); resp.StatusCode != http.StatusCreated {
		t.Errorf("PUT a.txt = %d %q", resp.StatusCode, text)
	}
	if _, text := f.get("/api/files/a.txt", cookie); text != "new" {
		t.Errorf("GET a.txt = %q, want new", text)
	}

	_, text = f.get("/api/files", cookie)
	var list []fileEntry
	if err := json.Unmarshal([]byte(text), &list); err != nil {
		t.Fatalf("list %q: %v", text, err)
	}
	dirInfo, err := os.Stat(filepath.Join(o.Workspace, "zdir"))
	if err != nil {
		t.Fatal(err)
	}
	wantList := []fileEntry{{"a.txt", 3, false}, {"big.bin", size, false}, {"zdir", dirInfo.Size(), true}}
	if !reflect.DeepEqual(list, wantList) {
		t.Errorf("list = %+v, want %+v", list, wantList)
	}

	for _, path := range []string{"/api/files/missing", "/api/files/zdir"} {
		if got := f.status(http.MethodGet, path, cookie); got != http.StatusNotFound {
			t.Errorf("GET %s = %d, want 404", path, got)
		}
	}
	if got := f.status(http.MethodDelete, "/api/files/a.txt", cookie); got != http.StatusMethodNotAllowed {
		t.Errorf("DELETE = %d, want 405", got)
	}
}

// An upload that stops mid-body must leave nothing in the workspace.
func TestAbortedUploadLeavesNothing(t *testing.T) {
	o := testOptions(t)
	f := newFixture(t, o)
	cookie := f.handshake()

	conn, err := net.Dial("tcp", f.ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "PUT /api/files/partial.bin HTTP/1.1\r\nHost: localhost\r\nCookie: %s\r\nContent-Length: %d\r\n\r\n", cookieHeader(cookie), 1<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(make([]byte, 256<<10)); err != nil {
		t.Fatal(err)
	}
	// The body is streamed: part of it reaches disk before the end arrives.
	eventually(t, "the partial upload on disk", func() bool {
		entries, _ := os.ReadDir(o.Workspace)
		for _, e := range entries {
			if info, err := e.Info(); err == nil && strings.HasPrefix(e.Name(), uploadTempPrefix) && info.Size() > 0 {
				return true
			}
		}
		return false
	})
	conn.Close()

	eventually(t, "the aborted upload to be logged", func() bool {
		return strings.Contains(f.out.String(), "dsh: PUT /api/files/partial.bin 400")
	})
	if entries, err := os.ReadDir(o.Workspace); err != nil || len(entries) != 0 {
		t.Errorf("workspace after aborted upload = %v, %v; want empty", entries, err)
	}
}

func TestBadFileNames(t *testing.T) {
	o := testOptions(t)
	f := newFixture(t, o)
	cookie := f.handshake()
	for _, path := range []string{"/api/files/", "/api/files/.", "/api/files/..", "/api/files/%2E%2E", "/api/files/a%2Fb", "/api/files/a/b", "/api/files/a%00b", "/api/files/../x"} {
		for _, method := range []string{http.MethodPut, http.MethodGet} {
			resp, body := f.do(f.request(method, path, strings.NewReader("x"), cookie))
			if resp.StatusCode != http.StatusBadRequest {
				t.Errorf("%s %s = %d %q, want 400", method, path, resp.StatusCode, body)
			}
		}
	}
	if entries, err := os.ReadDir(o.Workspace); err != nil || len(entries) != 0 {
		t.Errorf("workspace after bad names = %v, %v; want empty", entries, err)
	}
}

// Contract: a workspace file is served with a content type from its
// extension, as a tenant's own server would, so a test can put a page in a
// workspace; bytes never make a file HTML when its name does not.
func TestFileContentTypes(t *testing.T) {
	o := testOptions(t)
	f := newFixture(t, o)
	cookie := f.handshake()
	const page = "<!doctype html><html><script>alert(1)</script></html>"
	for name, want := range map[string]string{
		"evil.html":  "text/html; charset=utf-8",
		"EVIL.HTM":   "text/html; charset=utf-8",
		"app.js":     "text/javascript; charset=utf-8",
		"sw.mjs":     "text/javascript; charset=utf-8",
		"style.css":  "text/css; charset=utf-8",
		"data.json":  "application/json",
		"notes.txt":  "text/plain; charset=utf-8",
		"logo.svg":   "image/svg+xml",
		"page":       "application/octet-stream",
		"page.html~": "application/octet-stream",
		".html":      "text/html; charset=utf-8",
	} {
		if resp, text := f.do(f.request(http.MethodPut, "/api/files/"+name, strings.NewReader(page), cookie)); resp.StatusCode != http.StatusCreated {
			t.Fatalf("PUT %s = %d %q", name, resp.StatusCode, text)
		}
		for _, method := range []string{http.MethodGet, http.MethodHead} {
			resp, body := f.do(f.request(method, "/api/files/"+name, nil, cookie))
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != want {
				t.Errorf("%s %s = %d %q, want 200 %q", method, name, resp.StatusCode, resp.Header.Get("Content-Type"), want)
			}
			if method == http.MethodGet && body != page {
				t.Errorf("GET %s = %q, want the stored bytes", name, body)
			}
		}
	}
}

// Contract: /api/echo reports method, path, query, Host and every header,
// hiding only the dsh-auth cookie value, and the image's version.
func TestEcho(t *testing.T) {
	o := testOptions(t)
	o.Version = "1.0.1"
	f := newFixture(t, o)
	cookie := f.handshake()
	req := f.request(http.MethodPost, "/api/echo?x=1&y=two", strings.NewReader("body"), nil)
	req.Header.Set("Cookie", "theme=dark; "+cookieHeader(cookie)+"; dsh-auth-deadbeef=stale;other=1")
	req.Header.Set("Authorization", "Bearer abc")
	req.Header.Set("X-Forwarded-For", "203.0.113.7")
	req.Header.Add("X-Custom", "a")
	req.Header.Add("X-Custom", "b")
	resp, body := f.do(req)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("echo = %d %q", resp.StatusCode, body)
	}
	if strings.Contains(body, cookie.Value) || strings.Contains(body, "stale") {
		t.Fatalf("echo leaks an auth cookie value: %s", body)
	}
	var echo struct {
		Method     string              `json:"method"`
		Path       string              `json:"path"`
		Query      string              `json:"query"`
		Host       string              `json:"host"`
		RemoteAddr string              `json:"remote_addr"`
		Headers    map[string][]string `json:"headers"`
		Version    string              `json:"version"`
	}
	if err := json.Unmarshal([]byte(body), &echo); err != nil {
		t.Fatalf("echo %q: %v", body, err)
	}
	host := strings.TrimPrefix(f.ts.URL, "http://")
	if echo.Version != "1.0.1" || echo.Method != "POST" || echo.Path != "/api/echo" || echo.Query != "x=1&y=two" || echo.Host != host || !strings.HasPrefix(echo.RemoteAddr, "127.0.0.1:") {
		t.Errorf("echo = %+v", echo)
	}
	want := map[string][]string{
		"Cookie":          {"theme=dark; " + cookie.Name + "=REDACTED; dsh-auth-deadbeef=REDACTED;other=1"},
		"Authorization":   {"Bearer abc"},
		"X-Forwarded-For": {"203.0.113.7"},
		"X-Custom":        {"a", "b"},
		"Content-Length":  {"4"},
	}
	for name, values := range want {
		if !reflect.DeepEqual(echo.Headers[name], values) {
			t.Errorf("echo header %s = %q, want %q", name, echo.Headers[name], values)
		}
	}
}

// Contract: GET /settings answers 302 Location /settings/ (root-absolute).
func TestSettingsRedirect(t *testing.T) {
	f := newFixture(t, testOptions(t))
	cookie := f.handshake()
	resp, _ := f.get("/settings", cookie)
	if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/settings/" {
		t.Errorf("GET /settings = %d Location %q, want 302 /settings/", resp.StatusCode, resp.Header.Get("Location"))
	}
	resp, body := f.get("/settings/", cookie)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="settings"`) {
		t.Errorf("GET /settings/ = %d %q", resp.StatusCode, body)
	}
}

// The container log carries one line per request but never a cookie value,
// and the token only inside the token line.
func TestLogHidesSecrets(t *testing.T) {
	f := newFixture(t, testOptions(t))
	f.srv.announce()
	oldToken, oldCookie := f.srv.Token(), f.handshake()
	f.get("/api/files", oldCookie)
	f.get("/?token=wrong", nil)
	f.srv.Rotate()
	newToken, newCookie := f.srv.Token(), f.handshake()
	f.get("/api/echo", newCookie)

	out := f.out.String()
	for _, want := range []string{"dsh: GET / 303", "dsh: GET /api/files 200", "dsh: GET / 401", "dsh: GET /api/echo 200"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	for _, secret := range []string{oldCookie.Value, newCookie.Value} {
		if strings.Contains(out, secret) {
			t.Errorf("log contains cookie value %s", secret)
		}
	}
	for line := range strings.SplitSeq(out, "\n") {
		if tokenLine.MatchString(ansiCode.ReplaceAllString(line, "")) {
			continue
		}
		if strings.Contains(line, oldToken) || strings.Contains(line, newToken) {
			t.Errorf("token outside a token line: %q", line)
		}
	}
}

type running struct {
	out    *testutil.Buffer
	cancel context.CancelFunc
	done   chan error
}

func startRun(t *testing.T, o Options) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{out: &testutil.Buffer{}, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- Run(ctx, o, r.out) }()
	t.Cleanup(func() {
		cancel()
		<-r.done
	})
	return r
}

func (r *running) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
		return nil
	}
}

// Contract: the token line names the port DSH listens on, wrapped in colour
// codes between other log lines; shutdown ends open streams and returns nil.
func TestRun(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	o.Noise = true
	r := startRun(t, o)
	eventually(t, "the token line", func() bool { return len(tokenLines(r.out.String())) == 1 })
	port, token := tokenLines(r.out.String())[0][0], tokenLines(r.out.String())[0][1]
	if !strings.Contains(r.out.String(), "\x1b[32mdsh web: http://0.0.0.0:"+port+"/?token="+token+"\x1b[0m\n") {
		t.Errorf("token line is not wrapped in colour codes:\n%q", r.out.String())
	}

	base := "http://127.0.0.1:" + port
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Get(base + "/?token=" + token)
	if err != nil || resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("handshake on the announced port: %v %v", resp, err)
	}
	resp.Body.Close()
	req, _ := http.NewRequest(http.MethodGet, base+"/api/events?interval=1000&count=1000000", nil)
	req.AddCookie(resp.Cookies()[0])
	stream, err := client.Do(req)
	if err != nil || stream.StatusCode != http.StatusOK {
		t.Fatalf("open stream: %v %v", stream, err)
	}
	defer stream.Body.Close()

	eventually(t, "model output noise", func() bool { return strings.Contains(r.out.String(), "assistant>") })
	start := time.Now()
	r.cancel()
	if err := r.wait(t); err != nil {
		t.Fatalf("Run = %v, want nil after a graceful shutdown", err)
	}
	// An open SSE stream must not hold shutdown until its timeout.
	if elapsed := time.Since(start); elapsed >= shutdownTimeout {
		t.Errorf("shutdown took %s", elapsed)
	}
	if _, err := io.ReadAll(stream.Body); err != nil {
		t.Errorf("stream after shutdown: %v, want a clean end", err)
	}
	if got := tokenLines(r.out.String()); len(got) != 1 {
		t.Errorf("token lines = %v, want exactly one", got)
	}
}

func TestRunRotateSignal(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	rotate := make(chan os.Signal, 1)
	o.RotateSignals = rotate
	r := startRun(t, o)
	eventually(t, "the token line", func() bool { return len(tokenLines(r.out.String())) == 1 })
	rotate <- nil
	eventually(t, "a second token line", func() bool { return len(tokenLines(r.out.String())) == 2 })
	lines := tokenLines(r.out.String())
	if lines[0][1] == lines[1][1] || lines[0][0] != lines[1][0] {
		t.Errorf("token lines after rotation = %v, want a new token on the same port", lines)
	}
}

func TestRunCrashAfter(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	o.CrashAfter = 100 * time.Millisecond
	r := startRun(t, o)
	if err := r.wait(t); !errors.Is(err, ErrSimulatedCrash) {
		t.Fatalf("Run = %v, want ErrSimulatedCrash", err)
	}
	if !strings.Contains(r.out.String(), "dsh: fatal: simulated crash after 100ms") {
		t.Errorf("no crash line in:\n%s", r.out.String())
	}
}

// DSHSIM_LOG_FLOOD prints at least that many bytes before the first token
// line, none of which looks like a token line.
func TestRunLogFlood(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	o.LogFlood = 64 << 10
	r := startRun(t, o)
	eventually(t, "the token line", func() bool { return len(tokenLines(r.out.String())) == 1 })
	out := r.out.String()
	before, _, _ := strings.Cut(out, "dsh web: http://")
	if n := strings.Count(before, "dsh: [flood] "); len(before) < o.LogFlood || n < o.LogFlood/1024 {
		t.Fatalf("%d bytes (%d flood lines) before the token line, want at least %d", len(before), n, o.LogFlood)
	}
	if got := tokenLines(before); len(got) != 0 {
		t.Fatalf("the flood holds token lines: %v", got)
	}
}

func TestRunNoToken(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	o.NoToken = true
	r := startRun(t, o)
	eventually(t, "the ready line", func() bool { return strings.Contains(r.out.String(), "dsh: ready") })
	if got := tokenLines(r.out.String()); len(got) != 0 {
		t.Errorf("token lines = %v, want none", got)
	}
}

func TestRunSlowStart(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	o.SlowStart = 300 * time.Millisecond
	start := time.Now()
	r := startRun(t, o)
	eventually(t, "the token line", func() bool { return len(tokenLines(r.out.String())) == 1 })
	if elapsed := time.Since(start); elapsed < o.SlowStart {
		t.Errorf("token line after %s, before the slow start of %s", elapsed, o.SlowStart)
	}
}

func TestRunStartupFailures(t *testing.T) {
	t.Run("loose credentials", func(t *testing.T) {
		o := testOptions(t)
		o.Listen = "127.0.0.1:0"
		if err := os.MkdirAll(o.DSHHome, 0o700); err != nil {
			t.Fatal(err)
		}
		creds := filepath.Join(o.DSHHome, ".credentials.yaml")
		if err := os.WriteFile(creds, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(creds, 0o640); err != nil {
			t.Fatal(err)
		}
		r := startRun(t, o)
		if err := r.wait(t); err == nil || !strings.Contains(err.Error(), "refusing to start") {
			t.Errorf("Run = %v, want a refusal", err)
		}
		if got := tokenLines(r.out.String()); len(got) != 0 {
			t.Errorf("token lines = %v, want none", got)
		}
	})
	t.Run("address in use", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		o := testOptions(t)
		o.Listen = ln.Addr().String()
		r := startRun(t, o)
		if err := r.wait(t); err == nil || !strings.Contains(err.Error(), "listen on "+o.Listen) {
			t.Errorf("Run = %v, want a listen error", err)
		}
	})
}
