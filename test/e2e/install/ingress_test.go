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
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/testenv"
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
// sandboxes' wildcard. It writes each as <name>.crt and <name>.key in dir
// and returns the command lines that put them in the Secrets, as README
// says to without cert-manager.
func certificates(dir string) ([]string, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "aaas install test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		return nil, err
	}
	roots.AddCert(ca)
	var commands []string
	for i, leaf := range []struct{ secret, host string }{
		{"aaas-tls", domain},
		{"aaas-sandboxes-tls", "*." + sandboxDomain},
	} {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, err
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: leaf.host}, DNSNames: []string{leaf.host},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return nil, err
		}
		cert, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, err
		}
		sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
		spkis = append(spkis, base64.StdEncoding.EncodeToString(sum[:]))
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return nil, err
		}
		crt, k := filepath.Join(dir, leaf.secret+".crt"), filepath.Join(dir, leaf.secret+".key")
		if err := os.WriteFile(crt, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
			return nil, err
		}
		if err := os.WriteFile(k, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
			return nil, err
		}
		commands = append(commands, fmt.Sprintf("kubectl -n %s create secret tls %s --cert=%s --key=%s", controlNS, leaf.secret, crt, k))
	}
	return commands, nil
}

// ingressConf is an ingress controller's data plane for one Ingress: one
// TLS server per rule, picked by SNI and Host, passing Host unchanged and
// the scheme as X-Forwarded-Proto (the edge believes it from the private
// ranges, TRUSTED_PROXIES), streaming both ways, WebSockets upgraded.
const ingressConf = `worker_processes 1;
daemon off;
master_process off;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  map $http_upgrade $connection_upgrade {
    default upgrade;
    ''      '';
  }
%[2]s}
`

const ingressServer = `  server {
    listen %[1]s ssl;
    server_name %[2]s;
    ssl_certificate %[3]s.crt;
    ssl_certificate_key %[3]s.key;
    client_max_body_size 0;
    location / {
      proxy_pass http://%[4]s;
      proxy_http_version 1.1;
      proxy_set_header Host $http_host;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_request_buffering off;
      proxy_buffering off;
      proxy_read_timeout 1h;
    }
  }
`

// ingress serves the install's Ingress as an ingress controller would:
// it reads Ingress aaas as README's kustomization made it, and for each
// of its rules a TLS server for the rule's host with the certificate of
// the Secret its tls entry names, proxying to the rule's Service. It
// returns the address it listens on (the test's stand-in for the DNS
// records README asks for: every name resolves to it).
func ingress(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	ing, err := cluster.Client.NetworkingV1().Ingresses(controlNS).Get(ctx, "aaas", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir, addr := t.TempDir(), testenv.FreeAddr(t)
	var servers strings.Builder
	for _, rule := range ing.Spec.Rules {
		i := slices.IndexFunc(ing.Spec.TLS, func(tl networkingv1.IngressTLS) bool { return slices.Contains(tl.Hosts, rule.Host) })
		if i < 0 || rule.HTTP == nil || len(rule.HTTP.Paths) != 1 || rule.HTTP.Paths[0].Path != "/" || rule.HTTP.Paths[0].Backend.Service == nil {
			t.Fatalf("Ingress rule %+v: want one path / to a Service, with TLS", rule)
		}
		secret, err := cluster.Client.CoreV1().Secrets(controlNS).Get(ctx, ing.Spec.TLS[i].SecretName, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("Ingress TLS for %s: %v", rule.Host, err)
		}
		files := filepath.Join(dir, secret.Name)
		if err := os.WriteFile(files+".crt", secret.Data["tls.crt"], 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(files+".key", secret.Data["tls.key"], 0o600); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&servers, ingressServer, addr, rule.Host, files, backend(t, rule.HTTP.Paths[0].Backend.Service))
	}
	testenv.Nginx(t, addr, func(d string) string { return fmt.Sprintf(ingressConf, d, servers.String()) })
	return addr
}

// backend is the ClusterIP address of an Ingress backend's Service port.
func backend(t *testing.T, b *networkingv1.IngressServiceBackend) string {
	t.Helper()
	svc, err := cluster.Client.CoreV1().Services(controlNS).Get(context.Background(), b.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range svc.Spec.Ports {
		if p.Name == b.Port.Name && b.Port.Name != "" || b.Port.Number != 0 && p.Port == b.Port.Number {
			return net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(int(p.Port)))
		}
	}
	t.Fatalf("Service %s has no port %+v", b.Name, b.Port)
	return ""
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
	// Positive control: the browser holds the gateway's session, for the
	// gateway only.
	gw := cookies("https://" + domain + "/")
	if len(gw) != 1 || gw[0].Name != "__Host-dsh_gw_session" || gw[0].Domain != domain || !gw[0].Secure || !gw[0].HTTPOnly {
		t.Fatalf("the gateway's cookies: %s", describe(gw))
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
