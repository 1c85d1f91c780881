package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// These tests run the real binary as a child process, the way the simulated
// node runs it per pod, and read its stdout as the container log.

var binary string

func TestMain(m *testing.M) {
	os.Exit(buildAndRun(m))
}

func buildAndRun(m *testing.M) int {
	dir, err := os.MkdirTemp("", "dshsim-test-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "create build dir: %v\n", err)
		return 1
	}
	defer os.RemoveAll(dir)
	binary = filepath.Join(dir, "dshsim")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build dshsim: %v\n%s", err, out)
		return 1
	}
	return m.Run()
}

var (
	ansiCode  = regexp.MustCompile(`\x1b\[[0-9;]*[A-Za-z]`)
	tokenLine = regexp.MustCompile(`dsh web: http://0\.0\.0\.0:(\d+)/\?token=([A-Za-z0-9_-]+)`)
	setCookie = regexp.MustCompile(`^dsh-auth-[0-9a-f]+=[A-Za-z0-9_-]+; Path=/; HttpOnly$`)
)

// sim is one running dshsim process.
type sim struct {
	t      *testing.T
	cmd    *exec.Cmd
	port   string
	stderr bytes.Buffer // read only after exit

	mu    sync.Mutex
	lines []string

	exited chan struct{}
}

type dirs struct{ dshHome, home string }

func newDirs(t *testing.T) dirs {
	base := t.TempDir()
	return dirs{dshHome: filepath.Join(base, "dsh"), home: filepath.Join(base, "workspace")}
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)
}

// start runs `dshsim web --listen 127.0.0.1:<free port> args...`.
func start(t *testing.T, d dirs, args []string, env ...string) *sim {
	t.Helper()
	port := freePort(t)
	return launch(t, d, port, append([]string{"web", "--listen", "127.0.0.1:" + port}, args...), env)
}

// launch runs dshsim with only the given environment, so variables of the
// test run cannot leak in, and collects its stdout line by line.
func launch(t *testing.T, d dirs, port string, args, env []string) *sim {
	t.Helper()
	s := &sim{t: t, port: port, exited: make(chan struct{})}
	s.cmd = exec.Command(binary, args...)
	s.cmd.Env = append([]string{"DSH_HOME=" + d.dshHome, "HOME=" + d.home}, env...)
	s.cmd.Stderr = &s.stderr
	stdout, err := s.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start dshsim: %v", err)
	}
	go func() {
		defer close(s.exited)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			s.mu.Lock()
			s.lines = append(s.lines, sc.Text())
			s.mu.Unlock()
		}
		_ = s.cmd.Wait() // only after stdout is drained, as os/exec requires
	}()
	t.Cleanup(func() {
		_ = s.cmd.Process.Kill()
		<-s.exited
	})
	return s
}

func (s *sim) output() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.lines...)
}

// tokens returns [port, token] of every token line so far, oldest first.
func (s *sim) tokens() [][2]string {
	var found [][2]string
	for _, line := range s.output() {
		if m := tokenLine.FindStringSubmatch(ansiCode.ReplaceAllString(line, "")); m != nil {
			found = append(found, [2]string{m[1], m[2]})
		}
	}
	return found
}

func (s *sim) waitFor(what string, cond func() bool) {
	s.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		select {
		case <-s.exited:
			if cond() {
				return
			}
			s.t.Fatalf("dshsim exited while waiting for %s; stdout:\n%s\nstderr:\n%s", what, strings.Join(s.output(), "\n"), s.stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("timed out waiting for %s; stdout:\n%s", what, strings.Join(s.output(), "\n"))
		}
	}
}

// token waits for the n-th token line and returns its token; the newest
// line wins.
func (s *sim) token(n int) string {
	s.t.Helper()
	s.waitFor(fmt.Sprintf("token line %d", n), func() bool { return len(s.tokens()) >= n })
	tl := s.tokens()[n-1]
	if tl[0] != s.port {
		s.t.Fatalf("token line names port %s, dshsim listens on %s", tl[0], s.port)
	}
	return tl[1]
}

// wait returns the exit code.
func (s *sim) wait() int {
	s.t.Helper()
	select {
	case <-s.exited:
		return s.cmd.ProcessState.ExitCode()
	case <-time.After(15 * time.Second):
		s.t.Fatal("dshsim did not exit")
		return -1
	}
}

func (s *sim) signal(sig os.Signal) {
	s.t.Helper()
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("signal %v: %v", sig, err)
	}
}

func (s *sim) url(path string) string { return "http://127.0.0.1:" + s.port + path }

var client = &http.Client{
	Timeout:       30 * time.Second,
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
}

func (s *sim) do(method, path string, body io.Reader, cookie *http.Cookie) (*http.Response, []byte) {
	s.t.Helper()
	req, err := http.NewRequest(method, s.url(path), body)
	if err != nil {
		s.t.Fatal(err)
	}
	if cookie != nil {
		req.AddCookie(cookie)
	}
	resp, err := client.Do(req)
	if err != nil {
		s.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("read %s %s: %v", method, path, err)
	}
	return resp, b
}

func (s *sim) status(path string, cookie *http.Cookie) int {
	s.t.Helper()
	resp, _ := s.do(http.MethodGet, path, nil, cookie)
	return resp.StatusCode
}

func (s *sim) handshake(token string) *http.Cookie {
	s.t.Helper()
	resp, _ := s.do(http.MethodGet, "/?token="+token, nil, nil)
	sc := resp.Header.Values("Set-Cookie")
	if resp.StatusCode != http.StatusSeeOther || len(sc) != 1 || !setCookie.MatchString(sc[0]) {
		s.t.Fatalf("handshake = %d Set-Cookie %q, want 303 with the dsh-auth cookie", resp.StatusCode, sc)
	}
	return resp.Cookies()[0]
}

func TestTokenLineAndHandshake(t *testing.T) {
	t.Parallel()
	d := newDirs(t)
	s := start(t, d, nil)
	token := s.token(1)
	var raw string
	for _, line := range s.output() {
		if strings.Contains(line, token) {
			raw = line
		}
	}
	if !strings.HasPrefix(raw, "\x1b[") || !strings.HasSuffix(raw, "\x1b[0m") {
		t.Errorf("token line %q is not wrapped in colour codes", raw)
	}

	if got := s.status("/", nil); got != http.StatusUnauthorized {
		t.Errorf("GET / without cookie = %d, want 401", got)
	}
	if got := s.status("/favicon.svg", nil); got != http.StatusOK {
		t.Errorf("GET /favicon.svg = %d, want 200", got)
	}
	cookie := s.handshake(token)
	if got := s.status("/", cookie); got != http.StatusOK {
		t.Errorf("GET / with cookie = %d, want 200", got)
	}
	creds, err := os.Stat(filepath.Join(d.dshHome, ".credentials.yaml"))
	if err != nil || creds.Mode().Perm() != 0o600 {
		t.Errorf(".credentials.yaml: %v, %v; want mode 0600", creds, err)
	}

	s.signal(syscall.SIGTERM)
	if code := s.wait(); code != 0 {
		t.Errorf("exit code after SIGTERM = %d, want 0; stderr %s", code, s.stderr.String())
	}
}

func TestListenFromEnvironment(t *testing.T) {
	t.Parallel()
	d := newDirs(t)
	port := freePort(t)
	s := launch(t, d, port, []string{"web"}, []string{"DSHSIM_LISTEN=127.0.0.1:" + port})
	s.handshake(s.token(1))
	s.signal(os.Interrupt)
	if code := s.wait(); code != 0 {
		t.Errorf("exit code after SIGINT = %d, want 0", code)
	}
}

func TestSIGHUPRotatesToken(t *testing.T) {
	t.Parallel()
	s := start(t, newDirs(t), nil)
	oldToken := s.token(1)
	oldCookie := s.handshake(oldToken)

	s.signal(syscall.SIGHUP)
	newToken := s.token(2)
	if newToken == oldToken {
		t.Fatal("SIGHUP printed the same token")
	}
	if got := s.status("/", oldCookie); got != http.StatusUnauthorized {
		t.Errorf("old cookie after SIGHUP: GET / = %d, want 401", got)
	}
	if got := s.status("/?token="+oldToken, nil); got != http.StatusUnauthorized {
		t.Errorf("old token after SIGHUP: handshake = %d, want 401", got)
	}
	if got := s.status("/", s.handshake(newToken)); got != http.StatusOK {
		t.Errorf("new handshake: GET / = %d, want 200", got)
	}
}

func TestLooseCredentialsExitStatus1(t *testing.T) {
	t.Parallel()
	d := newDirs(t)
	if err := os.MkdirAll(d.dshHome, 0o700); err != nil {
		t.Fatal(err)
	}
	creds := filepath.Join(d.dshHome, ".credentials.yaml")
	if err := os.WriteFile(creds, []byte("key: x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// What the kubelet's default fsGroup policy does on every pod start.
	if err := os.Chmod(creds, 0o640); err != nil {
		t.Fatal(err)
	}
	s := start(t, d, nil)
	if code := s.wait(); code != 1 {
		t.Fatalf("exit code = %d, want 1", code)
	}
	msg := "refusing to start: " + creds + " has mode 0640; it must be 0600 (no group/other access)"
	if out := strings.Join(s.output(), "\n"); !strings.Contains(out, "dsh: "+msg) {
		t.Errorf("stdout lacks %q:\n%s", msg, out)
	}
	if got := s.stderr.String(); got != "dshsim: "+msg+"\n" {
		t.Errorf("stderr = %q, want the refusal", got)
	}
	if len(s.tokens()) != 0 {
		t.Errorf("a refused start printed a token line")
	}
}

// Contract: state under DSH_HOME and $HOME survives a restart (suspend and
// resume keep the volume); the restart invalidates old cookies.
func TestStatePersistsAcrossRestart(t *testing.T) {
	t.Parallel()
	d := newDirs(t)
	first := start(t, d, nil)
	firstToken := first.token(1)
	cookie := first.handshake(firstToken)
	if resp, body := first.do(http.MethodPut, "/api/files/notes.txt", strings.NewReader("remember me\n"), cookie); resp.StatusCode != http.StatusCreated {
		t.Fatalf("PUT notes.txt = %d %s", resp.StatusCode, body)
	}
	if resp, body := first.do(http.MethodPost, "/api/chat", strings.NewReader(`{"message":"hi there","session":"persist"}`), cookie); resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "event: done") {
		t.Fatalf("POST /api/chat = %d %s", resp.StatusCode, body)
	}
	first.signal(syscall.SIGTERM)
	if code := first.wait(); code != 0 {
		t.Fatalf("first exit code = %d", code)
	}

	second := start(t, d, nil)
	secondToken := second.token(1)
	if secondToken == firstToken {
		t.Error("restart kept the token")
	}
	if got := second.status("/", cookie); got != http.StatusUnauthorized {
		t.Errorf("cookie from before the restart: GET / = %d, want 401", got)
	}
	cookie = second.handshake(secondToken)
	if resp, body := second.do(http.MethodGet, "/api/files/notes.txt", nil, cookie); resp.StatusCode != http.StatusOK || string(body) != "remember me\n" {
		t.Errorf("GET notes.txt after restart = %d %q", resp.StatusCode, body)
	}
	_, body := second.do(http.MethodGet, "/api/chat?session=persist", nil, cookie)
	var history []map[string]string
	if err := json.Unmarshal(body, &history); err != nil {
		t.Fatalf("history %s: %v", body, err)
	}
	want := []map[string]string{{"role": "user", "text": "hi there"}, {"role": "assistant", "text": "You said: hi there"}}
	if fmt.Sprint(history) != fmt.Sprint(want) {
		t.Errorf("history after restart = %v, want %v", history, want)
	}
}

func TestCrashAfter(t *testing.T) {
	t.Parallel()
	s := start(t, newDirs(t), []string{"--crash-after", "300ms"})
	s.token(1)
	if code := s.wait(); code != 2 {
		t.Errorf("exit code = %d, want 2", code)
	}
	if out := strings.Join(s.output(), "\n"); !strings.Contains(out, "simulated crash") {
		t.Errorf("stdout lacks the crash line:\n%s", out)
	}
	if !strings.Contains(s.stderr.String(), "dshsim: crash after 300ms: simulated crash") {
		t.Errorf("stderr = %q", s.stderr.String())
	}
}

func TestNoToken(t *testing.T) {
	t.Parallel()
	s := start(t, newDirs(t), []string{"--no-token"})
	// The token line would be printed before the server answers requests.
	s.waitFor("the server to answer", func() bool {
		resp, err := client.Get(s.url("/favicon.svg"))
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	s.signal(syscall.SIGTERM)
	if code := s.wait(); code != 0 {
		t.Errorf("exit code = %d, want 0", code)
	}
	if got := s.tokens(); len(got) != 0 {
		t.Errorf("--no-token printed token lines %v", got)
	}
	if out := strings.Join(s.output(), "\n"); !strings.Contains(out, "dsh: ready") {
		t.Errorf("stdout lacks the ready line:\n%s", out)
	}
}

func TestNoiseKeepsTokenLineParsable(t *testing.T) {
	t.Parallel()
	s := start(t, newDirs(t), nil, "DSHSIM_NOISE=1")
	token := s.token(1)
	s.waitFor("noise after the token line", func() bool {
		out := s.output()
		noisy := 0
		for _, line := range out[len(out)-min(len(out), 5):] {
			if strings.Contains(line, "\x1b[") && !strings.Contains(line, token) {
				noisy++
			}
		}
		return noisy >= 3
	})
	if got := s.tokens(); len(got) != 1 || got[0][1] != token {
		t.Errorf("token lines with noise = %v, want only %s", got, token)
	}
	if got := s.status("/", s.handshake(token)); got != http.StatusOK {
		t.Errorf("GET / = %d, want 200", got)
	}
}

func TestSlowStart(t *testing.T) {
	t.Parallel()
	begin := time.Now()
	s := start(t, newDirs(t), []string{"--slow-start", "500ms"})
	s.token(1)
	if elapsed := time.Since(begin); elapsed < 500*time.Millisecond {
		t.Errorf("token line after %s, before the 500ms slow start", elapsed)
	}
}

// SIGTERM with a live SSE stream still exits 0: the server ended the
// stream itself. Had the stream held shutdown until its timeout, the
// shutdown would have failed, and the process would exit 1 — the exit
// code says it, no wall-clock margin needed.
func TestSIGTERMWithOpenStream(t *testing.T) {
	t.Parallel()
	s := start(t, newDirs(t), nil)
	cookie := s.handshake(s.token(1))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url("/api/events?interval=1000&count=1000000"), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.AddCookie(cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || first != "id: 1\n" {
		t.Fatalf("first line = %q, %v", first, err)
	}

	s.signal(syscall.SIGTERM)
	if code := s.wait(); code != 0 {
		t.Errorf("exit code = %d, want 0 (1 is a shutdown that timed out waiting for the stream)", code)
	}
	if _, err := io.ReadAll(resp.Body); err != nil {
		t.Errorf("stream after exit: %v, want a clean end", err)
	}
}
