// Package origins tests origin isolation end to end (issue 22): every
// sandbox on its own origin below SANDBOX_DOMAIN, the gateway's pages on one
// no sandbox can script. Real edges (two, behind nginx), lifecycle, NATS,
// devcluster with dshsim pods, and headless Chromium.
//
// The names are under example.com, which the browser maps to the loopback
// front (--host-resolver-rules): example.com is a registrable domain, so
// the gateway (aaas.example.com) and every sandbox (<user>.sbx.example.com)
// are same-site, as in production (aaas.example.com and
// sandboxes.example.com). SameSite then protects nothing between them and
// the tests show the exact origin checks do.
package origins_test

import (
	"context"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

const (
	gatewayName = "aaas.example.com"
	sandboxZone = "sbx.example.com"
)

// world is a stack in subdomain mode: the gateway at aaas.example.com:<port>
// and sandboxes at <user>.sbx.example.com:<port>, both reached through one
// nginx front on 127.0.0.1:<port> that pools two edges.
type world struct {
	*testenv.Stack
	t     *testing.T
	port  string
	front *testenv.Front
	edges []*testenv.Edge
}

// newWorld starts it; env is added to every edge's environment; mutate,
// if set, adjusts the sandbox template.
func newWorld(t *testing.T, env map[string]string, mutate func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool)) *world {
	t.Helper()
	s := pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Sandbox: mutate})
	addr := testenv.FreeAddr(t)
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	w := &world{Stack: s, t: t, port: port}
	s.Env["SANDBOX_DOMAIN"] = sandboxZone + ":" + port
	for k, v := range env {
		s.Env[k] = v
	}
	var backends []string
	for _, id := range []string{"edge-a", "edge-b"} {
		// The gateway's name only: the first public host is where a
		// sandbox origin sends a browser to sign in.
		e := s.Edge(id, map[string]string{"PUBLIC_HOSTS": gatewayName + ":" + port})
		w.edges = append(w.edges, e)
		backends = append(backends, strings.TrimPrefix(e.URL, "http://"))
	}
	w.front = testenv.NewFrontAt(t, addr, backends...)
	return w
}

// gateway is the gateway's origin.
func (w *world) gateway() string { return "http://" + gatewayName + ":" + w.port }

// sandbox is user's sandbox origin.
func (w *world) sandbox(user string) string {
	return "http://" + user + "." + sandboxZone + ":" + w.port
}

// dialFront connects to the front whatever the URL names, as DNS would.
func (w *world) dialFront(ctx context.Context, _, _ string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", w.front.Addr)
}

// client is a cookie-keeping client of the gateway, through the front.
func (w *world) client() *testenv.Client {
	c := testenv.NewClient(w.t, w.gateway())
	c.HTTP.Transport = &http.Transport{DialContext: w.dialFront, MaxIdleConnsPerHost: 16}
	return c
}

// edgeClient is a client of the gateway's names sent straight to edge e,
// not through the front: to show something holds on each edge.
func (w *world) edgeClient(e *testenv.Edge, base string) *testenv.Client {
	c := testenv.NewClient(w.t, base)
	target := strings.TrimPrefix(e.URL, "http://")
	c.HTTP.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", target)
	}}
	return c
}

// dialWS opens a WebSocket through the front.
func (w *world) dialWS(url string, h http.Header) (*websocket.Conn, *http.Response, error) {
	d := websocket.Dialer{HandshakeTimeout: 30 * time.Second, NetDialContext: w.dialFront}
	return d.Dial(strings.Replace(url, "http://", "ws://", 1), h)
}

// makeAdmin restarts every edge with ADMIN_USERS binding name to the
// account of token, as an operator does once the account exists (README,
// Administration).
func (w *world) makeAdmin(name, token string) {
	w.t.Helper()
	w.Env["ADMIN_USERS"] = name + ":" + ident.HashHex(token)
	for _, e := range w.edges {
		e.Stop()
		e.Env["ADMIN_USERS"] = w.Env["ADMIN_USERS"]
		e.Restart(w.t)
		e.WaitReady(w.t, time.Minute)
	}
}

// browser is Chromium resolving every example.com name to the front, and
// treating the test's origins as the secure contexts they are behind TLS
// in production (service workers need one).
func (w *world) browser(users ...string) context.Context {
	w.t.Helper()
	secure := []string{w.gateway()}
	for _, u := range users {
		secure = append(secure, w.sandbox(u))
	}
	return testenv.Browser(w.t,
		chromedp.Flag("host-resolver-rules", "MAP *.example.com 127.0.0.1"),
		chromedp.Flag("unsafely-treat-insecure-origin-as-secure", strings.Join(secure, ",")),
		// The default list, plus no HTTPS upgrade of these plain-HTTP names.
		chromedp.Flag("disable-features", "Translate,BlinkGenPropertyTrees,HttpsUpgrades"),
	)
}

// sessionKeys are user's keys in the sessions bucket (gateway and sandbox
// sessions).
func (w *world) sessionKeys(user string) []string {
	w.t.Helper()
	ctx := testenv.Context(w.t, time.Minute)
	b, err := w.JS.KeyValue(ctx, state.BucketSessions)
	if err != nil {
		w.t.Fatal(err)
	}
	l, err := b.ListKeysFiltered(ctx, user+".>")
	if err != nil {
		w.t.Fatal(err)
	}
	var keys []string
	for k := range l.Keys() {
		keys = append(keys, k)
	}
	return keys
}

// trustGatewayHost lists the gateway's name in the template's
// DSH_TRUSTED_HOSTS, as path mode needs (there the edge forwards the
// browser's Host); subdomain mode needs no entry.
func trustGatewayHost(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
	c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
	for i := range c.Env {
		if c.Env[i].Name == "DSH_TRUSTED_HOSTS" {
			c.Env[i] = corev1.EnvVar{Name: "DSH_TRUSTED_HOSTS", Value: gatewayName}
		}
	}
}
