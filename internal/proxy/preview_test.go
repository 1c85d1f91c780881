package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/dshsim"
	tu "github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// previewFixture is the proxy fixture with an app (dshsim's, as an agent
// starts it) listening beside bob's DSH on port app, a listed port idle
// that nothing listens on, and the edge's preview hosts
// <port>-<user>.sbx.test served as the edge serves them.
type previewFixture struct {
	*fixture
	app, idle int
	url       string // the edge, http://127.0.0.1:port
}

// The tokens previewAuth admits: bob's and ann's; the cookie sid=bob is
// bob's ambient credential.
const annToken = "Bearer ann"

type previewAuth struct{}

func (previewAuth) AuthenticateFor(c *fiber.Ctx, _ string) (auth.Identity, error) {
	switch {
	case c.Get(fiber.HeaderAuthorization) == fixtureToken:
		return auth.Identity{User: fixtureUser, Method: auth.MethodBearer}, nil
	case c.Get(fiber.HeaderAuthorization) == annToken:
		return auth.Identity{User: "ann", Method: auth.MethodBearer}, nil
	case c.Cookies("sid") == fixtureUser:
		return auth.Identity{User: fixtureUser, Method: auth.MethodCookie}, nil
	}
	return auth.Identity{}, errUnauthorized
}

func (previewAuth) Valid(auth.Identity) bool { return true }

// previewApp is dshsim's app, plus /private, which answers 401 as an app
// with its own sign-in does.
func previewApp() http.Handler {
	app := dshsim.NewApp()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/private" {
			w.Header().Set("WWW-Authenticate", `Basic realm="app"`)
			http.Error(w, "the app's own sign-in", http.StatusUnauthorized)
			return
		}
		app.ServeHTTP(w, r)
	})
}

func newPreviewFixture(t testing.TB, mutate func(*Options)) *previewFixture {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	app := &http.Server{Handler: previewApp()}
	go func() { _ = app.Serve(ln) }()
	t.Cleanup(func() { _ = app.Close() })
	pf := &previewFixture{app: ln.Addr().(*net.TCPAddr).Port, idle: freePort(t)}
	pf.fixture = newFixture(t, echoHandler, func(o *Options) {
		subdomain(o)
		o.Auth = previewAuth{}
		o.PreviewPorts = []int{min(pf.app, pf.idle), max(pf.app, pf.idle)}
		if mutate != nil {
			mutate(o)
		}
	})
	pf.url = pf.fixture.url
	return pf
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func previewHost(port int, user string) string {
	return strconv.Itoa(port) + "-" + user + "." + fixtureDomain
}

// get asks the edge for path on host with header pairs; no redirects are
// followed, and every request has a generous deadline (a hang fails it).
func (pf *previewFixture) get(method, host, path string, header ...string) *http.Response {
	pf.t.Helper()
	req, err := http.NewRequest(method, pf.url+path, nil)
	if err != nil {
		pf.t.Fatal(err)
	}
	req.Host = host
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	if err != nil {
		pf.t.Fatal(err)
	}
	pf.t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func body(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The app gets the request with the whole path as it arrived, Host
// localhost:<port> (so a dev server's host check passes), the preview's
// origin in X-Forwarded-Host, and none of the browser's credentials: no
// gateway or sandbox cookie, no bearer token, and no DSH cookie; DSH is
// never asked and no handshake is.
func TestPreviewRequestHygiene(t *testing.T) {
	pf := newPreviewFixture(t, nil)
	host := previewHost(pf.app, fixtureUser)
	resp := pf.get("GET", host, "/echo?x=1&y=%20", "Authorization", fixtureToken,
		"Cookie", "dsh_gw_session=gw; __Host-aaas-sandbox=sb; aaas_sandbox=sb; dsh-auth-1=d; app=1",
		"X-Forwarded-For", "6.6.6.6", "X-Custom", "kept")
	var e struct {
		Method, Path, Query, Host string
		Headers                   http.Header
	}
	if b := body(t, resp); resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(b), &e) != nil {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if e.Host != "localhost:"+strconv.Itoa(pf.app) || e.Path != "/echo" || e.Query != "x=1&y=%20" {
		t.Fatalf("the app got %+v", e)
	}
	for h, want := range map[string]string{"X-Forwarded-Host": host, "X-Forwarded-Proto": "http", "X-Forwarded-For": "127.0.0.1", "X-Custom": "kept"} {
		if got := e.Headers.Values(h); len(got) != 1 || got[0] != want {
			t.Errorf("the app saw %s=%q, want %q", h, got, want)
		}
	}
	for _, h := range []string{"Cookie", "Authorization", "X-Forwarded-Prefix"} {
		if v := e.Headers.Values(h); len(v) != 0 {
			t.Errorf("the app saw %s=%q", h, v)
		}
	}
	if n := pf.upstreamConns.Load(); n != 0 {
		t.Errorf("DSH got %d connections for a preview", n)
	}
	s, err := pf.js.Stream(context.Background(), events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetLastMsgForSubject(context.Background(), events.CommandSubject(events.VerbHandshake, fixtureUser)); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Errorf("a handshake was asked for: %v", err)
	}
}

// The app's answers get the DSH origin's hygiene: its cookie is not set
// on the preview origin, the answer is private, a redirect to the name
// the app knows itself by stays on the preview origin, and a 401 of the
// app's own passes as it is (it is no refused DSH cookie).
func TestPreviewResponseHygiene(t *testing.T) {
	pf := newPreviewFixture(t, nil)
	host := previewHost(pf.app, fixtureUser)
	resp := pf.get("GET", host, "/", "Authorization", fixtureToken)
	if b := body(t, resp); resp.StatusCode != http.StatusOK || !strings.Contains(b, "/hmr") {
		t.Fatalf("page: %d %s", resp.StatusCode, b)
	}
	if v := resp.Header.Values("Set-Cookie"); len(v) != 0 {
		t.Errorf("the app set %q on the preview origin", v)
	}
	if cc := resp.Header.Get("Cache-Control"); !strings.Contains(cc, "private") {
		t.Errorf("Cache-Control %q", cc)
	}
	resp = pf.get("GET", host, "/redirect", "Authorization", fixtureToken)
	if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/echo" {
		t.Errorf("redirect: %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	resp = pf.get("GET", host, "/private", "Authorization", fixtureToken)
	if b := body(t, resp); resp.StatusCode != http.StatusUnauthorized || !strings.Contains(b, "the app's own sign-in") || resp.Header.Get("WWW-Authenticate") == "" {
		t.Errorf("the app's 401: %d %q %s", resp.StatusCode, resp.Header.Get("WWW-Authenticate"), b)
	}
}

// Hot reload: the page's WebSocket reaches the app (its subprotocol
// negotiated), the app's pushes reach the page, and an event stream
// arrives event by event.
func TestPreviewWebSocketAndStream(t *testing.T) {
	pf := newPreviewFixture(t, nil)
	host := previewHost(pf.app, fixtureUser)
	d := websocket.Dialer{Subprotocols: []string{"vite-hmr"}, HandshakeTimeout: 30 * time.Second}
	ws, resp, err := d.Dial("ws"+strings.TrimPrefix(pf.url, "http")+"/hmr", http.Header{
		"Host": {host}, "Authorization": {fixtureToken}, "Origin": {"http://" + host},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	if sp := resp.Header.Get("Sec-WebSocket-Protocol"); sp != "vite-hmr" {
		t.Fatalf("subprotocol %q", sp)
	}
	read := func() string {
		t.Helper()
		_ = ws.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, b, err := ws.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if m := read(); m != `{"type":"connected"}` {
		t.Fatalf("first message %q", m)
	}
	r := pf.get("POST", host, "/__reload", "Authorization", fixtureToken)
	if b := body(t, r); r.StatusCode != http.StatusOK || b != "{\"clients\":1}\n" {
		t.Fatalf("reload: %d %s", r.StatusCode, b)
	}
	if m := read(); m != `{"type":"full-reload","path":"*"}` {
		t.Fatalf("pushed %q", m)
	}
	if err := ws.WriteMessage(websocket.TextMessage, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if m := read(); m != "hello" {
		t.Fatalf("echo %q", m)
	}

	// The second event is an hour away: the first can only arrive if the
	// answer streams.
	r = pf.get("GET", host, "/events?count=2&interval=3600000", "Authorization", fixtureToken)
	line, err := bufio.NewReader(r.Body).ReadString('\n')
	if err != nil || line != "data: 1\n" || !strings.HasPrefix(r.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("stream: %q %v %q", line, err, r.Header.Get("Content-Type"))
	}
}

// Previews are their owner's by default; PREVIEW_ACCESS=users opens them
// to every signed-in user, and to no one else. Ambient credentials need
// the preview's own origin for a mutation or a WebSocket.
func TestPreviewAccess(t *testing.T) {
	for _, users := range []bool{false, true} {
		t.Run(fmt.Sprintf("users=%v", users), func(t *testing.T) {
			pf := newPreviewFixture(t, func(o *Options) { o.PreviewUsers = users })
			host := previewHost(pf.app, fixtureUser)
			if r := pf.get("GET", host, "/echo", "Authorization", fixtureToken); r.StatusCode != http.StatusOK {
				t.Fatalf("owner: %d", r.StatusCode)
			}
			want := http.StatusForbidden
			if users {
				want = http.StatusOK
			}
			r := pf.get("GET", host, "/echo", "Authorization", annToken)
			if b := body(t, r); r.StatusCode != want || (!users && !strings.Contains(b, "owner only")) {
				t.Fatalf("another user: %d, want %d: %s", r.StatusCode, want, b)
			}
			if users {
				// A name with no sandbox: refused at once, not waited for.
				if r := pf.get("GET", previewHost(pf.app, "carl"), "/echo", "Authorization", annToken); r.StatusCode != http.StatusNotFound {
					t.Fatalf("a preview of no sandbox: %d", r.StatusCode)
				}
			}
			if r := pf.get("GET", host, "/echo"); r.StatusCode != http.StatusUnauthorized {
				t.Fatalf("no credentials: %d", r.StatusCode)
			}
			if r := pf.get("POST", host, "/__reload", "Cookie", "sid=bob", "Origin", "http://"+previewHost(pf.app, "ann")); r.StatusCode != http.StatusForbidden {
				t.Fatalf("a cookie's POST from a sibling origin: %d", r.StatusCode)
			}
			if r := pf.get("POST", host, "/__reload", "Cookie", "sid=bob", "Origin", "http://"+host); r.StatusCode != http.StatusOK {
				t.Fatalf("a cookie's POST from the preview's own origin: %d", r.StatusCode)
			}
		})
	}
}

// A port that is not listed answers 404 before anything else, signed in
// or not; a listed port nothing listens on answers a clear 502 at once
// (HTTP) or closes the socket with the same words, and the same port
// serves as soon as an app listens there.
func TestPreviewUnlistedAndNothingListening(t *testing.T) {
	pf := newPreviewFixture(t, nil)
	unlisted := freePort(t)
	for _, auth := range []string{"", fixtureToken} {
		r := pf.get("GET", previewHost(unlisted, fixtureUser), "/", "Authorization", auth, "Accept", "text/html")
		if b := body(t, r); r.StatusCode != http.StatusNotFound || !strings.Contains(b, "not a preview port") {
			t.Fatalf("unlisted port (auth %q): %d %s", auth, r.StatusCode, b)
		}
	}
	want := fmt.Sprintf("Nothing is listening on port %d in your sandbox", pf.idle)
	host := previewHost(pf.idle, fixtureUser)
	r := pf.get("GET", host, "/", "Authorization", fixtureToken, "Accept", "text/html")
	if b := body(t, r); r.StatusCode != http.StatusBadGateway || !strings.Contains(b, want) || !strings.HasPrefix(r.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("nothing listening: %d %s", r.StatusCode, b)
	}
	ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(pf.url, "http")+"/hmr", http.Header{"Host": {host}, "Authorization": {fixtureToken}})
	if err != nil {
		t.Fatal(err)
	}
	_ = ws.SetReadDeadline(time.Now().Add(30 * time.Second))
	_, _, err = ws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != websocket.CloseInternalServerErr || !strings.HasPrefix(ce.Text, want) {
		t.Fatalf("socket to nothing: %v", err)
	}
	ws.Close()

	// Positive control: the same port, once an app listens on it.
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(pf.idle))
	if err != nil {
		t.Fatal(err)
	}
	app := &http.Server{Handler: previewApp()}
	go func() { _ = app.Serve(ln) }()
	t.Cleanup(func() { _ = app.Close() })
	if r := pf.get("GET", host, "/echo", "Authorization", fixtureToken); r.StatusCode != http.StatusOK {
		t.Fatalf("after the app started: %d", r.StatusCode)
	}
}

// A preview of a suspended sandbox wakes it, as the DSH origin does: a
// navigation gets the starting page, a request is answered once the
// sandbox is Ready.
func TestPreviewWakesTheSandbox(t *testing.T) {
	pf := newPreviewFixture(t, func(o *Options) { o.WakeTimeout = time.Minute })
	ready := state.Sandbox{User: fixtureUser, Phase: state.PhaseReady, PodUID: fixturePod, Address: pf.upstream.Listener.Addr().String()}
	pf.putBox(state.Sandbox{User: fixtureUser, Phase: state.PhaseSuspended, PodUID: fixturePod})
	s, err := pf.js.Stream(context.Background(), events.StreamCommands)
	if err != nil {
		t.Fatal(err)
	}
	// A navigation gets the starting page at once, which reloads itself.
	nav := pf.get("GET", previewHost(pf.app, fixtureUser), "/", "Authorization", fixtureToken, "Accept", "text/html")
	if page := body(t, nav); nav.StatusCode != http.StatusServiceUnavailable || !strings.Contains(page, "Starting your sandbox") || !strings.Contains(page, `http-equiv="refresh"`) {
		t.Fatalf("a navigation while asleep: %d %s", nav.StatusCode, page)
	}
	answered := make(chan *http.Response, 1)
	req, _ := http.NewRequest("GET", pf.url+"/echo", nil)
	req.Host = previewHost(pf.app, fixtureUser)
	req.Header.Set("Authorization", fixtureToken)
	go func() {
		resp, err := (&http.Client{Timeout: time.Minute}).Do(req)
		if err != nil {
			resp = &http.Response{StatusCode: 0, Status: err.Error(), Body: io.NopCloser(strings.NewReader(err.Error()))}
		}
		answered <- resp
	}()
	// Lifecycle's part: the wake arrives, the sandbox becomes Ready.
	tu.Eventually(t, 30*time.Second, func() error {
		_, err := s.GetLastMsgForSubject(context.Background(), events.CommandSubject(events.VerbWake, fixtureUser))
		return err
	})
	select {
	case r := <-answered:
		t.Fatalf("answered before the sandbox was Ready: %d", r.StatusCode)
	default:
	}
	pf.putBox(ready)
	r := <-answered
	if b := body(t, r); r.StatusCode != http.StatusOK || !strings.Contains(b, `"host":"localhost:`) {
		t.Fatalf("after the wake: %d %s", r.StatusCode, b)
	}
}
