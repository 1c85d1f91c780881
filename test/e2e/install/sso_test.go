package install_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// The organisation's directory at the identity provider: alice is named
// in README's AUTH_PROXY_ALLOW, bob is admitted by his group (acme:devs),
// mallory by neither.
var directory = []struct {
	ID, Username, Password, Email string
	Groups                        []string
}{
	{"alice", "alice", "alice-pw-" + randomHex(4), "alice@acme.example", []string{"acme:staff"}},
	{"bob", "bob", "bob-pw-" + randomHex(4), "bob@acme.example", []string{"acme:staff", "acme:devs"}},
	{"mallory", "mallory", "mallory-pw-" + randomHex(4), "mallory@acme.example", []string{"acme:sales"}},
}

// TestGatewaySSO switches the install to the gateway-sso exposure by
// README's single sign-on section, its values and commands run as
// written (the issuer replaced as an operator replaces it; the test bed
// adds only its images, its provider's CA and the egress to a provider
// inside the cluster), behind Traefik's Gateway API provider, with
// zitadel/oidc's OpenID Connect provider as the organisation's. In
// Chromium over TLS: alice signs in on the provider's login page, lands on
// her page and in her sandbox (DSH's WebSocket connected); "Sign out"
// ends her SSO and sandbox sessions alike; mallory is refused and gets no
// sandbox; bob, admitted by his group, gets his. The network admits what
// the exposure says and nothing else, and both preflights pass with the
// policies and fail without them (ssoPreflight). helm rollback restores
// the ingress exposure afterwards.
func TestGatewaySSO(t *testing.T) {
	ctx := testenv.Context(t, 25*time.Minute)
	status, err := shell(ctx, installDir, "helm status aaas -n "+controlNS+" -o json")
	var release struct{ Version int }
	if err != nil || json.Unmarshal(status, &release) != nil || release.Version == 0 {
		t.Fatalf("helm status: %v %s", err, status)
	}
	t.Cleanup(func() { restoreIngress(t, release.Version) })

	op := identityProvider(t, ctx)
	switchToSSO(t, ctx)
	if _, err := cluster.Client.NetworkingV1().Ingresses(controlNS).Get(ctx, "aaas", metav1.GetOptions{}); err == nil {
		t.Fatal("the Ingress is still there under the SSO exposure")
	}
	// Until Traefik has read the Gateway, its routes and Secrets, it
	// answers 404 or presents its default certificate (ingress waits).
	c := client(t, ingress(t))
	c.HTTP.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	testutil.Eventually(t, 2*time.Minute, func() error {
		r := c.Do(http.MethodGet, "/", nil, "Accept", "text/html")
		if loc := r.Header.Get("Location"); r.StatusCode != http.StatusFound || !strings.HasPrefix(loc, devcluster.OIDCIssuer+"/") {
			return fmt.Errorf("an anonymous browser at https://%s/: %d to %q, not to the provider", domain, r.StatusCode, loc)
		}
		return nil
	})

	t.Run("browser", func(t *testing.T) { ssoJourney(t, op) })
	t.Run("network", ssoReachability)
	t.Run("preflight", func(t *testing.T) { ssoPreflight(t, ctx) })
}

// identityProvider runs the organisation's OpenID Connect provider in the
// cluster (its issuer a name every pod resolves) with directory and one
// client, aaas, whose only redirect is oauth2-proxy's callback on the
// gateway host. It returns the provider pod's address, where the
// browser's name for the issuer points.
func identityProvider(t *testing.T, ctx context.Context) string {
	t.Helper()
	cfg := map[string]any{
		"Issuer": devcluster.OIDCIssuer, "Listen": ":8443", "Cert": "/etc/oidcop/tls.crt", "Key": "/etc/oidcop/tls.key",
		"Clients": []map[string]any{{"ID": "aaas", "Secret": oidcClientSecret, "RedirectURIs": []string{"https://" + domain + "/oauth2/callback"}}},
		"Users":   directory,
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := os.ReadFile(filepath.Join(installDir, "oidc.crt"))
	if err != nil {
		t.Fatal(err)
	}
	key, err := os.ReadFile(filepath.Join(installDir, "oidc.key"))
	if err != nil {
		t.Fatal(err)
	}
	addr, err := cluster.InstallOIDCProvider(ctx, oidcRef, b, cert, key)
	if err != nil {
		dumpPods(devcluster.OIDCNamespace)
		t.Fatal(err)
	}
	return addr
}

// oidcClientSecret is aaas's client secret at the provider, which README's
// command reads from $OIDC_CLIENT_SECRET into the oauth2-proxy Secret.
var oidcClientSecret = "client-secret-" + randomHex(8)

// switchToSSO runs README's single sign-on section. The test bed's own
// additions, in a values file of its own after README's: its registry's
// oauth2-proxy, the provider's CA (the test CA, Secret aaas-test-ca) and
// oauth2-proxy's egress to the provider's namespace and to the real
// node's DNS, which runs on the host (README: an egress rule for a
// provider inside the cluster).
func switchToSSO(t *testing.T, ctx context.Context) {
	t.Helper()
	values, commands, err := readmeBlock("values-sso.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const readmeIssuer = "--oidc-issuer-url=https://sso.example.com"
	if !strings.Contains(values, readmeIssuer) {
		t.Fatalf("README's values-sso.yaml no longer names %s: update this test", readmeIssuer)
	}
	values = strings.Replace(values, readmeIssuer, "--oidc-issuer-url="+devcluster.OIDCIssuer, 1)
	repo, tag, _ := strings.Cut(oauth2ProxyRef, ":")
	testbed, err := json.Marshal(map[string]any{"gatewaySSO": map[string]any{"oauth2Proxy": map[string]any{
		"replicas":   1,
		"image":      map[string]string{"repository": repo, "tag": tag},
		"providerCA": map[string]string{"secretName": "aaas-test-ca", "key": "ca.crt"},
		"egress": []any{
			map[string]any{"to": []any{map[string]any{"namespaceSelector": map[string]any{"matchLabels": map[string]string{"kubernetes.io/metadata.name": devcluster.OIDCNamespace}}}},
				"ports": []any{map[string]any{"protocol": "TCP", "port": 8443}}},
			map[string]any{"to": []any{map[string]any{"ipBlock": map[string]string{"cidr": devcluster.NodeDNSCIDR}}},
				"ports": []any{map[string]any{"protocol": "UDP", "port": 53}, map[string]any{"protocol": "TCP", "port": 53}}},
		},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string][]byte{"values-sso.yaml": []byte(values), "testbed-sso.yaml": testbed} {
		if err := os.WriteFile(filepath.Join(installDir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	upgraded := false
	for _, line := range commands {
		if strings.HasPrefix(line, "helm upgrade ") {
			if !strings.Contains(line, " -f values-sso.yaml") {
				t.Fatalf("README's helm upgrade no longer reads values-sso.yaml: %s", line)
			}
			line, upgraded = strings.Replace(line, " -f values-sso.yaml", " -f values-sso.yaml -f testbed-sso.yaml", 1), true
		}
		out, err := shell(ctx, installDir, line, "OIDC_CLIENT_ID=aaas", "OIDC_CLIENT_SECRET="+oidcClientSecret)
		t.Logf("$ %s\n%s", line, out)
		if err != nil {
			dumpPods(controlNS)
			t.Fatalf("README's command %q: %v", line, err)
		}
	}
	if !upgraded {
		t.Fatal("README's single sign-on section has no helm upgrade")
	}
}

// restoreIngress rolls the release back to version, the ingress exposure,
// and waits until every answer through the front door comes from a
// rolled-back edge: rollout status returns while the SSO edges still
// drain behind Traefik, and a later test's signup met one ("accounts are
// created by signing in through SSO"). The landing page tells them apart
// without changing anything.
func restoreIngress(t *testing.T, version int) {
	ctx := context.Background()
	for _, line := range []string{
		fmt.Sprintf("helm rollback aaas %d -n %s", version, controlNS),
		"kubectl -n " + controlNS + " rollout status deploy/aaas-edge --timeout=5m",
	} {
		if out, err := shell(ctx, installDir, line); err != nil {
			t.Errorf("restoring the ingress exposure: %s: %v\n%s", line, err, out)
		}
	}
	if _, err := cluster.Client.NetworkingV1().NetworkPolicies(controlNS).Get(ctx, "aaas-edge-ingress", metav1.GetOptions{}); err != nil {
		t.Errorf("after the rollback: %v", err)
	}
	c := client(t, ingress(t))
	testutil.Eventually(t, 3*time.Minute, func() error {
		for i := range 12 {
			if r := c.Do(http.MethodGet, "/", nil); r.StatusCode != http.StatusOK || !strings.Contains(string(r.Body), `id="signup-card"`) {
				return fmt.Errorf("answer %d through the front door after the rollback: %d, not the signup page", i+1, r.StatusCode)
			}
		}
		return nil
	})
}

// ssoJourney is the people of directory in headless Chromium, which
// trusts the test CA and resolves the gateway host and the sandboxes'
// wildcard to Traefik, the issuer's name to the provider.
func ssoJourney(t *testing.T, op string) {
	ctx := testenv.Browser(t,
		chromedp.Flag("host-resolver-rules", "MAP "+domain+" "+front+", MAP *."+sandboxDomain+" "+front+", MAP "+strings.TrimPrefix(devcluster.OIDCIssuer, "https://")+" "+op),
		chromedp.Flag("ignore-certificate-errors-spki-list", strings.Join(spkis, ",")),
	)
	id := func(s string) chromedp.ID { return chromedp.ID(s) }
	atProvider := func() {
		t.Helper()
		if loc := testenv.Get(t, ctx, "location", chromedp.Location()); !strings.HasPrefix(loc, devcluster.OIDCIssuer+"/login/") {
			t.Fatalf("at %s, not the provider's login page", loc)
		}
	}
	// browse runs one user action, each written to start from a URL so
	// it can run again: Chromium abandons a navigation when the machine's
	// addresses change (ERR_NETWORK_CHANGED, for the pods other packages'
	// tests start and stop), and then the action is tried again, up to
	// three times; any other failure fails the test.
	browse := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		for try := 1; ; try++ {
			tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			_, err := chromedp.Run(tctx, chromedp.Steps(steps...))
			cancel()
			if err == nil {
				return
			}
			loc := testenv.Get(t, ctx, "location", chromedp.Location())
			if !strings.HasPrefix(loc, "chrome-error:") || try == 3 {
				testenv.Screenshot(t, ctx, "failure-"+strings.ReplaceAll(t.Name(), "/", "_"))
				t.Fatalf("%s: %v (at %s)", what, err, loc)
			}
			// The error page names Chromium's reason (ERR_NETWORK_CHANGED).
			t.Logf("%s: Chromium abandoned a navigation (%v: %q); trying again", what, err,
				testenv.Get(t, ctx, "the error page's text", chromedp.Evaluate[string](`document.body.innerText.slice(0, 300)`)))
		}
	}
	// signIn is directory[i] on the provider's login page, then arrived.
	signIn := func(i int, arrived ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		u := directory[i]
		browse(u.Username+" signs in at the provider", append([]chromedp.Action[chromedp.Void]{
			chromedp.Navigate("https://" + domain + "/"),
			chromedp.WaitVisible(id("username")),
			chromedp.SendKeys(id("username"), u.Username),
			chromedp.SendKeys(id("password"), u.Password),
			chromedp.Submit(id("password")),
		}, arrived...)...)
	}
	onTheirPage := func(user string) []chromedp.Action[chromedp.Void] {
		return []chromedp.Action[chromedp.Void]{
			chromedp.WaitVisible(id("user")),
			testenv.Until(`document.getElementById("user").textContent === "`+user+`"`, 10*time.Second),
		}
	}
	openSandbox := func(user string) {
		t.Helper()
		browse(user+" opens the sandbox from their page", append([]chromedp.Action[chromedp.Void]{chromedp.Navigate("https://" + domain + "/")},
			append(onTheirPage(user),
				chromedp.Click(id("open")),
				chromedp.WaitVisible(id("chat-input")),
				testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, 50*time.Second),
			)...)...)
		if loc := testenv.Get(t, ctx, "location", chromedp.Location()); loc != origin(user)+"/" {
			t.Fatalf("%s landed on %s, want %s/", user, loc, origin(user))
		}
	}

	signIn(0, onTheirPage("alice")...)
	openSandbox("alice")
	testenv.Screenshot(t, ctx, "install-sso-sandbox")
	// oauth2-proxy's cookie is the gateway host's alone, Secure, HttpOnly.
	res, err := chromedp.Call(ctx, network.GetCookies, network.GetCookiesParams{URLs: []string{"https://" + domain + "/"}})
	if err != nil {
		t.Fatal(err)
	}
	var proxyCookie *network.Cookie
	for _, c := range res.Cookies {
		if strings.HasPrefix(c.Name, "__Host-oauth2-proxy") {
			proxyCookie = c
		}
	}
	if proxyCookie == nil || !proxyCookie.Secure || !proxyCookie.HTTPOnly || proxyCookie.Domain != domain {
		t.Fatalf("oauth2-proxy's cookie on %s: %+v", domain, proxyCookie)
	}

	// Sign out: back at the provider's login page, and the sandbox's
	// origin sends the browser there too (its session ended with SSO's).
	// A try whose navigation Chromium abandoned after the click (the warm
	// pool's new pod, made as alice's sandbox took one, changes the
	// host's addresses) has signed alice out already: the next try finds
	// the provider's login page where the button was.
	browse("alice signs out",
		chromedp.Navigate("https://"+domain+"/"),
		chromedp.WaitVisible(chromedp.CSS("#logout, #username")),
		func(ctx context.Context, tgt *chromedp.Target) (chromedp.Void, error) {
			out, err := chromedp.Evaluate[bool](`document.getElementById("logout") === null`)(ctx, tgt)
			if err != nil || out {
				return chromedp.Void{}, err
			}
			if _, err := chromedp.Click(id("logout"))(ctx, tgt); err != nil {
				return chromedp.Void{}, err
			}
			return chromedp.WaitVisible(id("username"))(ctx, tgt)
		},
	)
	atProvider()
	// Revocation reaches every edge within a second: until then an edge
	// may still hold the session.
	testutil.Eventually(t, 10*time.Second, func() error {
		browse("alice's sandbox after signing out", chromedp.Navigate(origin("alice")+"/"))
		loc := testenv.Get(t, ctx, "location", chromedp.Location())
		if !strings.HasPrefix(loc, devcluster.OIDCIssuer+"/login/") {
			return fmt.Errorf("alice's sandbox after signing out: at %s, not the provider's login page", loc)
		}
		return nil
	})

	refused := []chromedp.Action[chromedp.Void]{
		chromedp.WaitVisible(id("sso-sign-out")),
		testenv.Until(`document.body.innerText.includes("not allowed on this gateway")`, 10*time.Second),
	}
	signIn(2, refused...)
	browse("mallory signs in as someone else", append(append([]chromedp.Action[chromedp.Void]{chromedp.Navigate("https://" + domain + "/")}, refused...),
		chromedp.Click(id("sso-sign-out")),
		chromedp.WaitVisible(id("username")),
	)...)
	atProvider()

	signIn(1, onTheirPage("bob")...)
	openSandbox("bob")

	// What the journey left in Kubernetes: alice's and bob's claims,
	// none of mallory's.
	_, ext, err := cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	claims := ext.ExtensionsV1beta1().SandboxClaims(sandboxNS)
	for _, user := range []string{"alice", "bob"} {
		if _, err := claims.Get(context.Background(), "dsh-"+user, metav1.GetOptions{}); err != nil {
			t.Errorf("%s signed in through SSO and has no claim: %v", user, err)
		}
	}
	if _, err := claims.Get(context.Background(), "dsh-mallory", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("mallory, refused, has a claim: %v", err)
	}
}

// ssoReachability is the exposure's network, probed from inside pods:
// oauth2-proxy reaches the edge and its provider and nothing of the
// control plane's; Traefik reaches oauth2-proxy and the edge (the
// sandboxes' route); a stranger in the control plane's namespace or a
// sandbox reaches neither oauth2-proxy nor the edge, spoofed header or
// not; the monitoring namespace reaches the edge's metrics port only.
func ssoReachability(t *testing.T) {
	ctx := testenv.Context(t, 5*time.Minute)
	first := func(ns, selector string) *corev1.Pod {
		t.Helper()
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			t.Fatal(err)
		}
		for i := range pods.Items {
			if p := &pods.Items[i]; p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				return p
			}
		}
		t.Fatalf("no running pod %s in %s", selector, ns)
		return nil
	}
	edge := first(controlNS, "app.kubernetes.io/name=aaas-edge")
	proxy := first(controlNS, "app.kubernetes.io/name=oauth2-proxy")
	traefik := first(devcluster.TraefikNamespace, "app.kubernetes.io/name=traefik")
	nats := first(controlNS, "app.kubernetes.io/name=nats")
	opPod := first(devcluster.OIDCNamespace, "app.kubernetes.io/name=oidc")
	sandbox := first(sandboxNS, "app.kubernetes.io/name=dsh-web")
	if err := cluster.CreateNamespace(ctx, "monitoring"); err != nil {
		t.Fatal(err)
	}
	var (
		edgeHTTP    = net.JoinHostPort(edge.Status.PodIP, "8080")
		edgeMetrics = net.JoinHostPort(edge.Status.PodIP, "9090")
		proxyHTTP   = net.JoinHostPort(proxy.Status.PodIP, "4180")
		natsClient  = net.JoinHostPort(nats.Status.PodIP, "4222")
		provider    = net.JoinHostPort(opPod.Status.PodIP, "8443")
		stranger    = strangerPod(t, controlNS)
		monitor     = strangerPod(t, "monitoring")
	)
	checkReach(t, []reach{
		{proxy, edgeHTTP, true, "oauth2-proxy reaches the edge"},
		{proxy, provider, true, "oauth2-proxy reaches its provider"},
		{proxy, natsClient, false, "oauth2-proxy reaches NATS"},
		{proxy, edgeMetrics, false, "oauth2-proxy reaches the edge's metrics port"},
		{traefik, proxyHTTP, true, "the Gateway's proxy reaches oauth2-proxy"},
		{traefik, edgeHTTP, true, "the Gateway's proxy reaches the edge (the sandboxes' route)"},
		{stranger, edgeHTTP, false, "a stranger in the control plane reaches the edge"},
		{stranger, proxyHTTP, false, "a stranger in the control plane reaches oauth2-proxy"},
		{sandbox, edgeHTTP, false, "a sandbox reaches the edge"},
		{sandbox, proxyHTTP, false, "a sandbox reaches oauth2-proxy"},
		{monitor, edgeMetrics, true, "the monitoring namespace reaches the edge's metrics port"},
		{monitor, edgeHTTP, false, "the monitoring namespace reaches the edge's HTTP port"},
	})
}
