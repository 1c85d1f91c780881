package proxy

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// subdomain is the fixture's mutate for subdomain mode.
func subdomain(o *Options) {
	o.SandboxDomain = fixtureDomain
}

// bobOrigin is bob's sandbox origin's host.
const bobOrigin = fixtureUser + "." + fixtureDomain

// at sends one request to the edge for host (the Host header), as bob
// (the token) unless header sets Authorization, following no redirect.
func (f *fixture) at(method, host, path string, body io.Reader, header ...string) *http.Response {
	f.t.Helper()
	req, err := http.NewRequest(method, f.url+path, body)
	if err != nil {
		f.t.Fatal(err)
	}
	req.Host = host
	req.Header.Set("Authorization", fixtureToken)
	for i := 0; i+1 < len(header); i += 2 {
		if header[i+1] == "" {
			req.Header.Del(header[i])
		} else {
			req.Header.Set(header[i], header[i+1])
		}
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// localHost is the Host the edge sends bob's DSH on a sandbox origin:
// localhost at the pod's port.
func (f *fixture) localHost() string {
	_, port, _ := net.SplitHostPort(f.upstream.Listener.Addr().String())
	return "localhost:" + port
}

// On a sandbox origin every path is the sandbox's, the gateway's own
// ones too, forwarded whole as it arrived: DSH gets Host localhost:<pod
// port> (always trusted), the browser's host as X-Forwarded-Host, no
// prefix, and no cookie of the browser's (neither the gateway's nor the
// sandbox origin's session), only its own.
func TestOriginForwardsWholePath(t *testing.T) {
	f := newFixture(t, echoHandler, subdomain)
	f.seal(f.localHost())
	for _, path := range []string{"/", "/_/admin/users", "/login", "/users", "/u/alice/x", "/a/../b%2Fc?x=1", "/_aaas/other"} {
		resp := f.at("GET", bobOrigin, path, nil, "Cookie", "__Host-dsh_gw_session=gw; __Host-aaas-sandbox=sbx; aaas_sandbox=sbx2; other=1")
		if resp.StatusCode == gatewayStatus {
			t.Fatalf("%s on %s reached a gateway route", path, bobOrigin)
		}
		e := readEcho(t, resp)
		if e.URI != path {
			t.Errorf("%s: DSH saw %q", path, e.URI)
		}
		for h, want := range map[string]string{
			"Cookie": "dsh-auth=first", "X-Forwarded-Host": bobOrigin, "X-Forwarded-Proto": "http", "X-Forwarded-Prefix": "", "Authorization": "",
		} {
			if got := strings.Join(e.Headers.Values(h), ","); got != want {
				t.Errorf("%s: DSH got %s %q, want %q", path, h, got, want)
			}
		}
		if e.Host != f.localHost() {
			t.Errorf("%s: DSH got Host %q, want %q", path, e.Host, f.localHost())
		}
	}
	// The positive control: the gateway's host still reaches its routes.
	if resp := f.at("GET", fixtureGateway, "/_/admin/users", nil); resp.StatusCode != gatewayStatus {
		t.Fatalf("the gateway's own route answered %d", resp.StatusCode)
	}
}

// The handshake on a sandbox origin is asked for the Host DSH gets
// (localhost:<pod port>) with no prefix, and keyed on it: one handshake
// serves the pod whatever the browser's host.
func TestOriginHandshakeIsForTheUpstreamHost(t *testing.T) {
	f := newFixture(t, echoHandler, subdomain)
	nc, err := nats.Connect(f.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	var mu sync.Mutex
	var asked []events.HandshakeArgs
	if _, err := nc.Subscribe(events.CommandSubject(events.VerbHandshake, fixtureUser), func(m *nats.Msg) {
		var c events.Command
		if json.Unmarshal(m.Data, &c) == nil && c.Handshake != nil {
			mu.Lock()
			asked = append(asked, *c.Handshake)
			mu.Unlock()
			f.seal(c.Handshake.Host)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if e := readEcho(t, f.at("GET", bobOrigin, "/x", nil)); e.Headers.Get("Cookie") != "dsh-auth=first" {
			t.Fatalf("DSH got cookie %q", e.Headers.Get("Cookie"))
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) != 1 || asked[0].Host != f.localHost() || asked[0].Prefix != "" || asked[0].Proto != "http" || asked[0].PodUID != fixturePod {
		t.Fatalf("handshakes asked: %+v; want one for %s with no prefix", asked, f.localHost())
	}
}

// DSH's redirects stay within the sandbox origin: root-absolute paths as
// they are, and URLs on localhost (any port), on the pod's address or on
// the origin itself onto the origin; other hosts, the gateway's and other
// users' origins among them, pass as they are (the browser leaves the
// origin). Refresh follows the same rules.
func TestOriginRedirectsStayOnTheOrigin(t *testing.T) {
	var upstream string
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		to := strings.ReplaceAll(r.URL.Query().Get("to"), "UPSTREAM", upstream)
		if r.URL.Query().Get("refresh") != "" {
			w.Header().Set("Refresh", "0; url="+to)
			return
		}
		w.Header().Set("Location", to)
		w.WriteHeader(http.StatusFound)
	}), subdomain)
	upstream = f.upstream.Listener.Addr().String()
	f.seal(f.localHost())
	for _, tt := range []struct{ to, want string }{
		{"/next?a=1", "/next?a=1"},
		{"/u/bob/x", "/u/bob/x"},
		{"next", "next"},
		{"../../up", "/up"},
		{"http://" + f.localHost() + "/x?y", "/x?y"},
		{"http://localhost/y", "/y"},
		{"http://LOCALHOST:1/z#f", "/z#f"},
		{"http://UPSTREAM/w", "/w"},
		{"http://bob.sbx.test/v", "http://bob.sbx.test/v"},
		{"http://alice.sbx.test/", "http://alice.sbx.test/"},
		{"http://gw.test/_/admin", "http://gw.test/_/admin"},
		{"https://elsewhere.example/", "https://elsewhere.example/"},
	} {
		q := "?to=" + strings.NewReplacer("?", "%3F", "#", "%23").Replace(tt.to)
		resp := f.at("GET", bobOrigin, "/a/b"+q, nil)
		if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != tt.want {
			t.Errorf("Location %q: %d %q, want %q", tt.to, resp.StatusCode, resp.Header.Get("Location"), tt.want)
		}
		resp = f.at("GET", bobOrigin, "/a/b"+q+"&refresh=1", nil)
		if got := resp.Header.Get("Refresh"); got != "0; url="+tt.want {
			t.Errorf("Refresh %q: %q, want %q", tt.to, got, "0; url="+tt.want)
		}
	}
	if resp := f.at("GET", bobOrigin, "/a?to=//elsewhere.example/", nil); resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("a protocol-relative Location: %d", resp.StatusCode)
	}
}

// In subdomain mode the gateway serves no tenant byte: /u/<user>/… is a
// permanent redirect to the user's origin with path and query kept (301
// for GET and HEAD, 308 otherwise), and a path a browser reads under
// another user's prefix is refused, not redirected.
func TestGatewayRedirectsToOrigins(t *testing.T) {
	f := newFixture(t, echoHandler, subdomain)
	for _, tt := range []struct {
		method, path string
		status       int
		location     string
	}{
		{"GET", "/u/bob/x/y?q=1&r=%20", http.StatusMovedPermanently, "http://bob.sbx.test/x/y?q=1&r=%20"},
		{"HEAD", "/u/bob/", http.StatusMovedPermanently, "http://bob.sbx.test/"},
		{"GET", "/u/bob", http.StatusMovedPermanently, "http://bob.sbx.test/"},
		{"GET", "/u/alice", http.StatusMovedPermanently, "http://alice.sbx.test/"},
		{"POST", "/u/bob/api", http.StatusPermanentRedirect, "http://bob.sbx.test/api"},
		{"GET", "/u/bob/..%2Falice/", http.StatusMovedPermanently, "http://bob.sbx.test/..%2Falice/"}, // one segment to browsers
		{"GET", "/u/bob/%2e%2e/alice/", http.StatusNotFound, ""},                                      // read as /u/alice/
		{"GET", "/u/dshx/", http.StatusNotFound, ""},
		{"GET", "/u/Bob/", http.StatusNotFound, ""},
	} {
		resp := f.at(tt.method, fixtureGateway, tt.path, nil)
		if resp.StatusCode != tt.status || resp.Header.Get("Location") != tt.location {
			t.Errorf("%s %s: %d %q, want %d %q", tt.method, tt.path, resp.StatusCode, resp.Header.Get("Location"), tt.status, tt.location)
		}
	}
	if n := f.upstreamConns.Load(); n != 0 {
		t.Fatalf("the gateway's host opened %d connections to DSH", n)
	}
	// The positive control: bob's origin reaches DSH.
	f.seal(f.localHost())
	readEcho(t, f.at("GET", bobOrigin, "/x", nil))
	if n := f.upstreamConns.Load(); n != 1 {
		t.Fatalf("bob's origin opened %d connections to DSH", n)
	}
}

// A host below the domain that names no sandbox gets the 404 page and
// nothing is proxied; one further below is not served at all (421).
func TestOriginsOfNoOne(t *testing.T) {
	f := newFixture(t, echoHandler, subdomain)
	f.seal(f.localHost())
	for host, want := range map[string]int{
		"dshx.sbx.test": http.StatusNotFound, "0-bob.sbx.test": http.StatusNotFound, "a--b.sbx.test": http.StatusNotFound,
		"x.bob.sbx.test": http.StatusMisdirectedRequest, "sbx.test": http.StatusMisdirectedRequest,
	} {
		if resp := f.at("GET", host, "/_/admin/users", nil); resp.StatusCode != want {
			t.Errorf("%s: %d, want %d", host, resp.StatusCode, want)
		}
	}
	if n := f.upstreamConns.Load(); n != 0 {
		t.Fatalf("%d connections to DSH", n)
	}
}

// A navigation to a sleeping sandbox's origin wakes it and gets the
// starting page, which reloads itself (the gateway's status stream is not
// on this origin) and loads nothing from the origin's paths, which are
// the sandbox's: its stylesheet is the gateway's. In path mode the page
// follows the status stream and takes its stylesheet from its own origin.
func TestOriginStartingPage(t *testing.T) {
	for _, tt := range []struct {
		name       string
		mutate     func(*Options)
		host, path string
		reload     bool
		style      string
	}{
		{"origin", subdomain, bobOrigin, "/", true, "http://" + fixtureGateway + "/_/static/style.css"},
		{"path mode", nil, "gw.test", "/u/bob/", false, "/_/static/style.css"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, echoHandler, tt.mutate)
			nc, err := nats.Connect(f.natsURL)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			wakes, err := nc.SubscribeSync(events.CommandSubject(events.VerbWake, fixtureUser))
			if err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			f.putBox(state.Sandbox{User: fixtureUser, Phase: state.PhaseSuspended, PodUID: fixturePod})
			resp := f.at("GET", tt.host, tt.path, nil, "Accept", "text/html")
			page, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(page), "Starting your sandbox") {
				t.Fatalf("%d %s", resp.StatusCode, page)
			}
			reloads := strings.Contains(string(page), `<meta http-equiv="refresh" content="2">`)
			streams := strings.Contains(string(page), `/_/static/status.js`)
			if reloads != tt.reload || streams == tt.reload {
				t.Fatalf("reloads %v, follows the status stream %v:\n%s", reloads, streams, page)
			}
			if !strings.Contains(string(page), `<link rel="stylesheet" href="`+tt.style+`">`) {
				t.Fatalf("the stylesheet is not %s:\n%s", tt.style, page)
			}
			if _, err := wakes.NextMsg(5 * time.Second); err != nil {
				t.Fatalf("no wake published: %v", err)
			}
		})
	}
}

// The edge's error pages on a sandbox origin (a 401 with its sign-in
// link, the 404 of a host that names no one) reference nothing on that
// origin, whose paths are the tenant's: the stylesheet and the sign-in
// link are the gateway's, and DSH is asked for nothing. In path mode the
// same 401 page uses its own origin.
func TestOriginErrorPagesUseTheGateway(t *testing.T) {
	gw := "http://" + fixtureGateway
	for _, tc := range []struct {
		what             string
		mutate           func(*Options)
		host, path, base string
		status           int
	}{
		{"a 401 on bob's origin", subdomain, bobOrigin, "/", gw, http.StatusUnauthorized},
		{"the 404 of an origin of no one", subdomain, "dshx." + fixtureDomain, "/", gw, http.StatusNotFound},
		{"a 401 in path mode", nil, fixtureGateway, "/u/bob/", "", http.StatusUnauthorized},
	} {
		t.Run(tc.what, func(t *testing.T) {
			f := newFixture(t, echoHandler, tc.mutate)
			resp := f.at("GET", tc.host, tc.path, nil, "Accept", "text/html", "Authorization", "")
			page, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status {
				t.Fatalf("%d, want %d\n%s", resp.StatusCode, tc.status, page)
			}
			refs := regexp.MustCompile(`(?:href|src)="([^"]*)"`).FindAllStringSubmatch(string(page), -1)
			if len(refs) == 0 {
				t.Fatalf("the page references nothing:\n%s", page)
			}
			for _, r := range refs {
				if !strings.HasPrefix(r[1], tc.base+"/") || tc.base == "" && strings.HasPrefix(r[1], "//") {
					t.Errorf("the page references %q, not on %q", r[1], tc.base)
				}
			}
			if tc.status == http.StatusUnauthorized && !strings.Contains(string(page), `href="`+tc.base+`/">Sign in`) {
				t.Errorf("no sign-in link to %q/:\n%s", tc.base, page)
			}
			if n := f.upstreamConns.Load(); n != 0 {
				t.Fatalf("%d connections to DSH", n)
			}
		})
	}
}

// A WebSocket on a sandbox origin reaches DSH with the same headers as
// HTTP: Host localhost:<pod port>, the origin as X-Forwarded-Host, no
// prefix, no browser cookie.
func TestOriginWebSocket(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		b, _ := json.Marshal(map[string]string{"host": r.Host, "xfh": r.Header.Get("X-Forwarded-Host"), "prefix": r.Header.Get("X-Forwarded-Prefix"), "cookie": r.Header.Get("Cookie"), "uri": r.RequestURI})
		_ = c.WriteMessage(websocket.TextMessage, b)
	}), subdomain)
	f.seal(f.localHost())
	ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(f.url, "http")+"/_/ws?x=1", http.Header{
		"Authorization": {fixtureToken}, "Host": {bobOrigin}, "Cookie": {"__Host-aaas-sandbox=s; __Host-dsh_gw_session=g"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	_, msg, err := ws.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]string
	_ = json.Unmarshal(msg, &got)
	want := map[string]string{"host": f.localHost(), "xfh": bobOrigin, "prefix": "", "cookie": "dsh-auth=first", "uri": "/_/ws?x=1"}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("DSH's upgrade had %s %q, want %q", k, got[k], v)
		}
	}
	var ce *websocket.CloseError
	if _, _, err := ws.ReadMessage(); err != nil && !errors.As(err, &ce) && !strings.Contains(err.Error(), "EOF") {
		t.Logf("after the message: %v", err)
	}
}

// ambientBob admits the cookie "s=bob" as bob: credentials the browser
// attaches by itself, which the origin rules are about.
type ambientBob struct{}

func (ambientBob) AuthenticateFor(c *fiber.Ctx, _ string) (auth.Identity, error) {
	if c.Cookies("s") != "bob" {
		return auth.Identity{}, errUnauthorized
	}
	return auth.Identity{User: fixtureUser, Method: auth.MethodCookie}, nil
}

func (ambientBob) Valid(auth.Identity) bool { return true }

// Sibling sandbox origins are same-site, so SameSite protects nothing
// between them: with ambient credentials a mutation, and a WebSocket that
// names an origin, are accepted on bob's origin only from exactly that
// origin (scheme, host and port), never from alice's or the gateway's.
func TestOriginsAcceptOnlyTheirOwnOrigin(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if websocket.IsWebSocketUpgrade(r) {
			// As dshsim: UPSTREAM.md names no Origin check of DSH's.
			c, err := (&websocket.Upgrader{CheckOrigin: func(*http.Request) bool { return true }}).Upgrade(w, r, nil)
			if err == nil {
				_ = c.WriteMessage(websocket.TextMessage, []byte("open"))
				c.Close()
			}
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}), func(o *Options) {
		subdomain(o)
		o.Auth = ambientBob{}
	})
	f.seal(f.localHost())
	for _, tt := range []struct {
		origin string
		ok     bool
	}{
		{"http://bob.sbx.test", true},
		{"http://alice.sbx.test", false},
		{"http://gw.test", false},
		{"https://bob.sbx.test", false},
		{"http://bob.sbx.test:8080", false},
		{"http://5173-bob.sbx.test", false},
		{"null", false},
	} {
		resp := f.at("POST", bobOrigin, "/api/chat", strings.NewReader("{}"), "Authorization", "", "Cookie", "s=bob", "Origin", tt.origin)
		if got := resp.StatusCode == http.StatusNoContent; got != tt.ok || (!tt.ok && resp.StatusCode != http.StatusForbidden) {
			t.Errorf("POST from %s: %d", tt.origin, resp.StatusCode)
		}
		ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(f.url, "http")+"/ws", http.Header{"Host": {bobOrigin}, "Cookie": {"s=bob"}, "Origin": {tt.origin}})
		if err != nil {
			t.Fatalf("WebSocket from %s: %v", tt.origin, err)
		}
		_, msg, err := ws.ReadMessage()
		ws.Close()
		var ce *websocket.CloseError
		switch {
		case tt.ok && (err != nil || string(msg) != "open"):
			t.Errorf("WebSocket from %s: %q %v", tt.origin, msg, err)
		case !tt.ok && (!errors.As(err, &ce) || ce.Code != closeForbidden):
			t.Errorf("WebSocket from %s: %q %v, want %d", tt.origin, msg, err, closeForbidden)
		}
	}
}
