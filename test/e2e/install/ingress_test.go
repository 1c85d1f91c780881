package install_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/testenv"
)

var (
	// roots holds the test's CA, which signed the certificates in the
	// install's TLS Secrets. spkis are the base64 SHA-256 of those
	// certificates' public keys, which Chromium is told to trust (it
	// matches the chain the server presents, which holds no root).
	roots = x509.NewCertPool()
	spkis []string
)

// certificates makes a test CA and, signed by it, the two certificates
// README's exposure asks the operator for: the gateway host's and the
// sandboxes' wildcard. It writes each as <Secret name>.crt and .key in
// dir, the files README's commands make the Secrets from (as README says
// to without cert-manager); and oidc.crt and .key, the identity
// provider's, for its issuer's name.
func certificates(dir string) error {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "aaas install test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		return err
	}
	roots.AddCert(ca)
	// For clients in pods (helm test): the CA that verifies the front door.
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600); err != nil {
		return err
	}
	for i, leaf := range []struct{ secret, host string }{
		{"aaas-tls", domain},
		{"aaas-sandboxes-tls", "*." + sandboxDomain},
		{"oidc", strings.TrimPrefix(devcluster.OIDCIssuer, "https://")},
	} {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: leaf.host}, DNSNames: []string{leaf.host},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		cert, err := x509.ParseCertificate(der)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
		spkis = append(spkis, base64.StdEncoding.EncodeToString(sum[:]))
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return err
		}
		crt, k := filepath.Join(dir, leaf.secret+".crt"), filepath.Join(dir, leaf.secret+".key")
		if err := os.WriteFile(crt, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
			return err
		}
		if err := os.WriteFile(k, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
			return err
		}
	}
	return nil
}

// ingress returns the address of the install's front door: Traefik, the
// operator's ingress controller (installed before README's install, as an
// operator's is), once it serves the install's Ingress, the gateway host
// and the sandboxes' wildcard, each with its Secret's certificate. It is
// the test's stand-in for the DNS records README asks for: every name
// resolves to it.
func ingress(t *testing.T) string {
	t.Helper()
	ctx := testenv.Context(t, 2*time.Minute)
	c := client(t, front)
	for _, base := range []string{"https://" + domain, origin("nobody")} {
		// Until Traefik has read the Ingress and its Secrets it presents
		// its default certificate, which the client refuses, or answers
		// 404 itself: anything else comes from the edge.
		var last string
		for {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/readyz", nil)
			resp, err := c.HTTP.Do(req)
			if err == nil {
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
				resp.Body.Close()
				if resp.StatusCode != http.StatusNotFound || string(b) != "404 page not found\n" {
					break
				}
				last = "Traefik's own 404"
			} else {
				last = err.Error()
			}
			select {
			case <-ctx.Done():
				t.Fatalf("Traefik at %s does not serve %s: %s", front, base, last)
			case <-time.After(250 * time.Millisecond):
			}
		}
	}
	return front
}

// client is a browser on https://aaas.test (and, with At, on the
// sandboxes' origins) whose every name resolves to the ingress at front
// and who trusts the test CA.
func client(t *testing.T, front string) *testenv.Client {
	c := testenv.NewClient(t, "https://"+domain)
	c.HTTP.Transport = &http.Transport{DialContext: dialTo(front), TLSClientConfig: &tls.Config{RootCAs: roots}}
	return c
}

// dialTo connects to addr whatever the name asked for, as the DNS records
// README asks for resolve the gateway host and the wildcard.
func dialTo(addr string) func(ctx context.Context, network, _ string) (net.Conn, error) {
	return func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
}

// TestBrowserOnTheSandboxOrigin is a person in headless Chromium, which
// trusts the test CA's certificates and resolves the gateway host and the wildcard to the
// ingress: sign up on https://aaas.test, continue to the sandbox (the
// gateway's /u/ link, redirected to the sandbox's origin, signed in there
// by a code), DSH's page loaded with its WebSocket connected. The sandbox
// origin holds exactly its own host-only Secure __Host- cookie, which no
// script can read; the gateway's __Host- cookie is the gateway's alone.
func TestBrowserOnTheSandboxOrigin(t *testing.T) {
	front := ingress(t)
	ctx := testenv.Browser(t,
		chromedp.Flag("host-resolver-rules", "MAP "+domain+" "+front+", MAP *."+sandboxDomain+" "+front),
		chromedp.Flag("ignore-certificate-errors-spki-list", strings.Join(spkis, ",")),
	)
	id := func(s string) chromedp.ID { return chromedp.ID(s) }
	testenv.Do(t, ctx, "sign up",
		chromedp.Navigate("https://"+domain+"/"),
		chromedp.WaitVisible(id("signup-user")),
		chromedp.SendKeys(id("signup-user"), "carol"),
		chromedp.SendKeys(id("signup-invite"), invite),
		chromedp.Click(id("signup-submit")),
		chromedp.WaitVisible(id("token-box")),
	)
	testenv.Do(t, ctx, "open the sandbox",
		chromedp.Click(id("continue")),
		chromedp.WaitVisible(id("chat-input")),
		testenv.Until(`document.getElementById("ws-status").textContent === "connected"`, 60*time.Second),
	)
	testenv.Screenshot(t, ctx, "install-sandbox-origin")
	if loc := testenv.Get(t, ctx, "location", chromedp.Location()); loc != origin("carol")+"/" {
		t.Fatalf("landed on %s, want %s/", loc, origin("carol"))
	}
	if js := testenv.Get(t, ctx, "document.cookie", chromedp.Evaluate[string]("document.cookie")); js != "" {
		t.Fatalf("a script on the sandbox origin reads cookies: %q", js)
	}
	cookies := func(url string) []*network.Cookie {
		res, err := chromedp.Call(ctx, network.GetCookies, network.GetCookiesParams{URLs: []string{url}})
		if err != nil {
			t.Fatal(err)
		}
		return res.Cookies
	}
	sb := cookies(origin("carol") + "/")
	if len(sb) != 1 || sb[0].Name != "__Host-aaas-sandbox" || sb[0].Domain != "carol."+sandboxDomain || sb[0].Path != "/" || !sb[0].Secure || !sb[0].HTTPOnly || sb[0].SameSite != network.CookieSameSiteLax {
		t.Fatalf("the sandbox origin's cookies: %s", describe(sb))
	}
	// Positive control: the browser holds the gateway's session and the
	// cookie naming its user, for the gateway only.
	gw := cookies("https://" + domain + "/")
	slices.SortFunc(gw, func(a, b *network.Cookie) int { return strings.Compare(a.Name, b.Name) })
	if len(gw) != 2 || gw[0].Name != "__Host-dsh_gw_session" || gw[1].Name != auth.UserCookie("__Host-dsh_gw_session") {
		t.Fatalf("the gateway's cookies: %s", describe(gw))
	}
	for _, c := range gw {
		if c.Domain != domain || !c.Secure || !c.HTTPOnly {
			t.Fatalf("the gateway's cookies: %s", describe(gw))
		}
	}
	t.Logf("sandbox origin: %s; gateway: %s", describe(sb), describe(gw))
}

// describe lists cookies with their scope and flags (never their values).
func describe(cs []*network.Cookie) string {
	var out []string
	for _, c := range cs {
		out = append(out, fmt.Sprintf("%s domain=%s path=%s secure=%v httponly=%v samesite=%s", c.Name, c.Domain, c.Path, c.Secure, c.HTTPOnly, c.SameSite))
	}
	return "[" + strings.Join(out, "; ") + "]"
}
