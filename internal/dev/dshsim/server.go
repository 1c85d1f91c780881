// Package dshsim is the DSH Web stand-in: a small server that behaves like DSH
// Web in every way the gateway depends on (launch-token handshake, auth
// cookies, host check, HTTP, SSE and WebSocket APIs, state under DSH_HOME and
// $HOME) so tests and demos can run without the real image. The contract is
// /work/shared/UPSTREAM.md; the gateway must not special-case the simulator.
package dshsim

import (
	"bufio"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// authCookiePrefix starts the name of every DSH auth cookie; the suffix is
// the instance id, so cookies from an earlier process never match.
const authCookiePrefix = "dsh-auth-"

// Server is one simulated DSH Web instance.
type Server struct {
	opts     Options
	out      *lineWriter
	port     string // printed in the token line; Run replaces it with the bound port
	instance string // random per process, suffix of the auth cookie name
	handler  http.Handler
	// now is the clock auth cookies expire by; tests set their own.
	now func() time.Time

	mu       sync.Mutex
	token    string
	sessions map[string]time.Time // auth cookie value -> expiry

	stopOnce    sync.Once
	streamsDone chan struct{} // closed on shutdown so endless SSE streams end

	apps apps // started by POST /api/apps

	model *modelClient // nil: no provider configured, chat answers itself
}

// NewServer prepares DSH_HOME and the workspace and, like DSH's credentials
// plugin, refuses to start when .credentials.yaml has any group or other
// permission bit. It does not print the token line; Run does.
func NewServer(o Options, stdout io.Writer) (*Server, error) {
	out := &lineWriter{w: stdout}
	if err := prepareState(o, out); err != nil {
		return nil, err
	}
	_, port, err := net.SplitHostPort(o.Listen)
	if err != nil {
		return nil, fmt.Errorf("parse listen address %q: %w", o.Listen, err)
	}
	s := &Server{
		opts:        o,
		out:         out,
		port:        port,
		instance:    hex.EncodeToString(randomBytes(4)),
		token:       newToken(),
		now:         time.Now,
		sessions:    map[string]time.Time{},
		streamsDone: make(chan struct{}),
	}
	if o.Provider.BaseURL != "" {
		var source net.IP
		if o.SourceIP.IsValid() {
			source = net.IP(o.SourceIP.AsSlice())
		}
		s.model = newModelClient(o.Provider, source, filepath.Join(o.DSHHome, ".credentials.yaml"))
	}
	s.handler = s.routes()
	return s, nil
}

func prepareState(o Options, out *lineWriter) error {
	if err := os.MkdirAll(filepath.Join(o.DSHHome, "sessions"), 0o700); err != nil {
		return fmt.Errorf("create DSH_HOME: %w", err)
	}
	if err := os.MkdirAll(o.Workspace, 0o755); err != nil {
		return fmt.Errorf("create workspace: %w", err)
	}
	creds := filepath.Join(o.DSHHome, ".credentials.yaml")
	fi, err := os.Stat(creds)
	switch {
	case err == nil:
		if perm := fi.Mode().Perm(); perm&0o077 != 0 {
			err := fmt.Errorf("refusing to start: %s has mode %04o; it must be 0600 (no group/other access)", creds, perm)
			out.printf("dsh: %v", err)
			return err
		}
		return nil
	case os.IsNotExist(err):
		f, err := os.OpenFile(creds, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return fmt.Errorf("create credentials: %w", err)
		}
		_, werr := io.WriteString(f, "# dsh credentials\n")
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			return fmt.Errorf("write credentials: %w", werr)
		}
		return nil
	default:
		return fmt.Errorf("check credentials: %w", err)
	}
}

// Handler serves every request: host check first, then auth, then the app.
func (s *Server) Handler() http.Handler { return s.handler }

// Token returns the current launch token.
func (s *Server) Token() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.token
}

// Rotate replaces the launch token, signs out every auth cookie issued so far
// (as a restart would) and prints the new token line.
func (s *Server) Rotate() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.token = newToken()
	s.sessions = map[string]time.Time{}
	s.out.printf("dsh: launch token rotated; existing sessions signed out")
	s.announceLocked()
}

// announce prints the token line with the log lines real DSH prints around it.
func (s *Server) announce() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.announceLocked()
}

// announceLocked runs under s.mu so that, with concurrent rotations, the last
// token line printed is always the current token.
func (s *Server) announceLocked() {
	s.out.printf("\x1b[2mdsh: loading config from %s\x1b[0m", filepath.Join(s.opts.DSHHome, "config.yaml"))
	s.out.printf("dsh: workspace %s", s.opts.Workspace)
	if !s.opts.NoToken {
		s.out.printf("\x1b[32mdsh web: http://0.0.0.0:%s/?token=%s\x1b[0m", s.port, s.token)
	}
	for range s.opts.FakeTokens {
		s.out.printf("dsh web: http://0.0.0.0:%s/?token=%s", s.port, newToken())
	}
	s.out.printf("\x1b[2mdsh: ready\x1b[0m")
}

// flood prints opts.LogFlood bytes of log lines, a kibibyte each.
func (s *Server) flood() {
	line := "dsh: [flood] " + strings.Repeat("x", 1010)
	for n := 0; n < s.opts.LogFlood; n += len(line) + 1 {
		s.out.printf("%s", line)
	}
}

func (s *Server) stopStreams() { s.stopOnce.Do(func() { close(s.streamsDone) }) }

func (s *Server) routes() http.Handler {
	app := http.NewServeMux()
	app.HandleFunc("GET /{$}", static(indexHTML, "text/html; charset=utf-8"))
	app.HandleFunc("GET /app.js", static(appJS, "text/javascript; charset=utf-8"))
	app.HandleFunc("GET /style.css", static(styleCSS, "text/css; charset=utf-8"))
	app.HandleFunc("GET /settings", func(w http.ResponseWriter, _ *http.Request) {
		// Root-absolute on purpose: the gateway must rewrite it under /u/<user>/.
		w.Header().Set("Location", "/settings/")
		w.WriteHeader(http.StatusFound)
	})
	app.HandleFunc("GET /settings/{$}", static(settingsHTML, "text/html; charset=utf-8"))
	app.HandleFunc("GET /api/ws", s.serveWS)
	app.HandleFunc("GET /api/events", s.serveEvents)
	app.HandleFunc("POST /api/chat", s.postChat)
	app.HandleFunc("GET /api/chat", s.getChat)
	app.HandleFunc("GET /api/files", s.listFiles)
	app.HandleFunc("/api/echo", s.serveEcho)
	app.HandleFunc("POST /api/apps", s.serveStartApp)

	// Not a ServeMux: it would answer unclean paths such as /a/../b with a
	// redirect before auth, and the contract says 401.
	favicon := static(faviconSVG, "image/svg+xml")
	authed := s.requireAuth(s.withFiles(app))
	root := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/favicon.svg" && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
			favicon(w, r)
			return
		}
		authed.ServeHTTP(w, r)
	})
	return s.logRequests(s.checkHost(root))
}

// withFiles routes /api/files/<name> before ServeMux sees it: the mux would
// redirect names like ".." instead of letting the handler reject them.
func (s *Server) withFiles(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name, ok := strings.CutPrefix(r.URL.Path, "/api/files/")
		if !ok {
			next.ServeHTTP(w, r)
			return
		}
		switch r.Method {
		case http.MethodGet, http.MethodHead:
			s.getFile(w, r, name)
		case http.MethodPut:
			s.putFile(w, r, name)
		default:
			w.Header().Set("Allow", "GET, HEAD, PUT")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		}
	})
}

func static(body []byte, contentType string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", contentType)
		_, _ = w.Write(body)
	}
}

func (s *Server) checkHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := hostname(r.Host)
		if !s.trusted(host) {
			http.Error(w, fmt.Sprintf("forbidden: host %q is not in DSH_TRUSTED_HOSTS", host), http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) trusted(host string) bool {
	if strings.EqualFold(host, "localhost") || host == "127.0.0.1" {
		return true
	}
	for _, t := range s.opts.TrustedHosts {
		if strings.EqualFold(host, t) {
			return true
		}
	}
	return false
}

// hostname strips the port from a Host header, and the brackets of an IPv6
// literal with or without a port.
func hostname(hostport string) string {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		return h
	}
	return strings.TrimSuffix(strings.TrimPrefix(hostport, "["), "]")
}

func (s *Server) requireAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/" && r.URL.Query().Has("token") {
			s.handshake(w, r)
			return
		}
		if s.opts.RefuseCookies || !s.authorized(r) {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) handshake(w http.ResponseWriter, r *http.Request) {
	if s.opts.SilentHandshake {
		<-r.Context().Done()
		return
	}
	if d := s.opts.RefuseHandshakeAfter; d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			http.Error(w, "unauthorized", http.StatusUnauthorized)
		case <-r.Context().Done():
		}
		return
	}
	given := r.URL.Query().Get("token")
	now := s.now()

	s.mu.Lock()
	ok := subtle.ConstantTimeCompare([]byte(given), []byte(s.token)) == 1
	var value string
	if ok {
		// Prune here so cookies that are never presented again do not pile up.
		for v, exp := range s.sessions {
			if now.After(exp) {
				delete(s.sessions, v)
			}
		}
		value = base64.RawURLEncoding.EncodeToString(randomBytes(32))
		s.sessions[value] = now.Add(s.opts.AuthTTL)
	}
	s.mu.Unlock()

	if !ok {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	http.SetCookie(w, &http.Cookie{Name: s.cookieName(), Value: value, Path: "/", HttpOnly: true})
	w.Header().Set("Location", "./")
	w.WriteHeader(http.StatusSeeOther)
}

func (s *Server) cookieName() string { return authCookiePrefix + s.instance }

func (s *Server) authorized(r *http.Request) bool {
	c, err := r.Cookie(s.cookieName())
	if err != nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	exp, ok := s.sessions[c.Value]
	if ok && s.now().After(exp) {
		delete(s.sessions, c.Value)
		return false
	}
	return ok
}

// logRequests prints one line per request. It logs the escaped path only:
// the query of the handshake carries the launch token. Probe requests for
// the favicon are not logged, so probes do not push the launch-token line
// out of the log tail the gateway reads.
func (s *Server) logRequests(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/favicon.svg" {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w}
		next.ServeHTTP(rec, r)
		if rec.status == 0 {
			rec.status = http.StatusOK
		}
		s.out.printf("dsh: %s %s %d %s", r.Method, r.URL.EscapedPath(), rec.status, time.Since(start).Round(time.Microsecond))
	})
}

// statusRecorder remembers the response status. Unwrap keeps Flush reachable
// through http.ResponseController; Hijack records the WebSocket upgrade.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

func (r *statusRecorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, brw, err := http.NewResponseController(r.ResponseWriter).Hijack()
	if err == nil {
		r.status = http.StatusSwitchingProtocols
	}
	return conn, brw, err
}

// lineWriter serialises whole lines from concurrent goroutines so the
// container log never interleaves two lines.
type lineWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lineWriter) printf(format string, args ...any) {
	line := fmt.Sprintf(format, args...) + "\n"
	l.mu.Lock()
	defer l.mu.Unlock()
	_, _ = io.WriteString(l.w, line)
}

// newToken returns a launch token: 32 random bytes, URL-safe base64.
func newToken() string { return base64.RawURLEncoding.EncodeToString(randomBytes(32)) }

// randomBytes relies on crypto/rand.Read never failing (since Go 1.24 it
// crashes the program instead of returning an error).
func randomBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}
