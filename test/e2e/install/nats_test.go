package install_test

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/natstls"
)

// TestNATSIsTLSOnly connects to every NATS node of the install as the
// processes do and as an attacker on the pod network would: the client
// port (4222) announces that TLS is required and the route port (6222)
// speaks only TLS; a client that talks plaintext gets no answer, and a
// TLS handshake verified against the install's CA succeeds (on routes
// only with the nodes' client certificate); the nodes' routes, all up,
// are therefore TLS.
func TestNATSIsTLSOnly(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	sec, err := cluster.Client.CoreV1().Secrets(controlNS).Get(ctx, natstls.SecretName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(sec.Data["ca.crt"]) {
		t.Fatal("no CA in the TLS Secret")
	}
	pair, err := tls.X509KeyPair(sec.Data["tls.crt"], sec.Data["tls.key"])
	if err != nil {
		t.Fatal(err)
	}
	pods, err := cluster.Client.CoreV1().Pods(controlNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=nats", FieldSelector: "status.phase=Running"})
	if err != nil {
		t.Fatal(err)
	}
	if len(pods.Items) != 3 {
		t.Fatalf("%d NATS pods running, want 3", len(pods.Items))
	}
	for _, p := range pods.Items {
		name := p.Name + ".nats-headless"
		// Clients: INFO in plaintext says TLS is required, then TLS.
		client := net.JoinHostPort(p.Status.PodIP, "4222")
		if info := natsInfo(t, client); info["tls_required"] != true {
			t.Errorf("%s's client port does not require TLS: %v", p.Name, info)
		}
		// Routes: TLS from the first byte, both ends verified.
		route := net.JoinHostPort(p.Status.PodIP, "6222")
		for _, c := range []struct {
			addr     string
			info     bool
			needCert bool
		}{{client, true, false}, {route, false, true}} {
			if reply := plaintext(t, c.addr, c.info); strings.Contains(reply, "PONG") || strings.Contains(reply, "+OK") || strings.Contains(reply, "INFO") && !c.info {
				t.Errorf("%s (%s) answered a plaintext client: %q", p.Name, c.addr, reply)
			} else {
				t.Logf("%s %s refuses plaintext: %q", p.Name, c.addr, reply)
			}
			cfg := &tls.Config{RootCAs: roots, ServerName: name, MinVersion: tls.VersionTLS12}
			if c.needCert {
				if err := handshake(c.addr, cfg, c.info); err == nil {
					t.Errorf("%s's route port completed TLS without a client certificate", p.Name)
				}
				cfg.Certificates = []tls.Certificate{pair}
			}
			if err := handshake(c.addr, cfg, c.info); err != nil {
				t.Errorf("%s (%s): TLS verified against the install's CA failed: %v", p.Name, c.addr, err)
			}
		}
		routes := monitor(t, p, "/routez")
		if n, _ := routes["num_routes"].(float64); n < 2 {
			t.Errorf("%s has %v routes, want both other nodes", p.Name, routes["num_routes"])
		}
		varz := monitor(t, p, "/varz")
		cl, _ := varz["cluster"].(map[string]any)
		if varz["tls_required"] != true || cl["tls_required"] != true || cl["tls_verify"] != true {
			t.Errorf("%s: tls_required %v, cluster %v", p.Name, varz["tls_required"], cl)
		}
	}
}

// natsInfo reads the INFO line a NATS server sends first.
func natsInfo(t *testing.T, addr string) map[string]any {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "INFO ") {
		t.Fatalf("%s: no INFO: %q %v", addr, line, err)
	}
	var info map[string]any
	if err := json.Unmarshal([]byte(strings.TrimPrefix(strings.TrimSpace(line), "INFO ")), &info); err != nil {
		t.Fatal(err)
	}
	return info
}

// plaintext talks NATS without TLS (after the INFO line, if the port
// sends one first), as a client that ignores tls_required would, and
// returns what the server answers before it closes.
func plaintext(t *testing.T, addr string, info bool) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(c)
	if info {
		if _, err := r.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	_, _ = fmt.Fprint(c, "CONNECT {\"verbose\":true,\"pedantic\":false}\r\nPING\r\n")
	var got strings.Builder
	for {
		line, err := r.ReadString('\n')
		got.WriteString(line)
		if err != nil {
			return strings.TrimSpace(got.String())
		}
	}
}

// handshake completes a TLS handshake, after the INFO line if the port
// sends one first (clients upgrade; routes start with TLS).
func handshake(addr string, cfg *tls.Config, info bool) error {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if info {
		if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
			return err
		}
	}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		return err
	}
	// With verify on, a server that rejects our certificate says so only
	// after the handshake (TLS 1.3): read what it sends next.
	_ = tc.SetReadDeadline(time.Now().Add(3 * time.Second))
	one := make([]byte, 1)
	if _, err := tc.Read(one); err != nil {
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			return nil // silent: the server waits for our CONNECT
		}
		return err
	}
	return nil
}

// monitor reads a JSON page of a NATS node's monitoring port.
func monitor(t *testing.T, p corev1.Pod, path string) map[string]any {
	t.Helper()
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + net.JoinHostPort(p.Status.PodIP, "8222") + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}
