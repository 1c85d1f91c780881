package natsconn_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"log/slog"
	"maps"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natsconn"
)

// tlsServer writes a CA and a server certificate for 127.0.0.1 and returns
// the server's TLS config and the CA file.
func tlsServer(t *testing.T) (*tls.Config, string) {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test-ca"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, caKey.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "nats"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, leaf, caCert, key.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, MinVersion: tls.VersionTLS12}, caFile
}

// With the nats-tls component the processes verify the server with
// NATS_CA; without it, or with another CA, they do not connect.
func TestConnectVerifiesTheServerWithNATSCA(t *testing.T) {
	serverTLS, caFile := tlsServer(t)
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := natstest.StartWith(t, embednats.Options{Users: ids.Users(), TLS: serverTLS})
	quiet := slog.New(slog.DiscardHandler)
	connect := func(auth config.NATSAuth) error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		nc, _, err := natsconn.Connect(ctx, natsconn.Options{URL: s.URL(), Name: "test", Auth: auth, InboxPrefix: natsauth.Edge.InboxPrefix()}, quiet)
		if err == nil {
			defer nc.Close()
			if !nc.TLSRequired() {
				t.Error("connected without TLS")
			}
		}
		return err
	}
	if err := connect(config.NATSAuth{NKey: ids.SeedFile(natsauth.Edge), CA: caFile}); err != nil {
		t.Fatalf("with NATS_CA: %v", err)
	}
	if err := connect(config.NATSAuth{NKey: ids.SeedFile(natsauth.Edge)}); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("without NATS_CA: %v", err)
	}
	_, otherCA := tlsServer(t)
	if err := connect(config.NATSAuth{NKey: ids.SeedFile(natsauth.Edge), CA: otherCA}); err == nil {
		t.Fatal("a server signed by another CA was trusted")
	}
}

// TestRotationKeepsEachProcessOnItsIdentity walks an identity rotation
// (docs/RUNBOOK.md) against a real server: NATS admits a role's current
// and staged next keys; the rotation promotes the next key and replaces
// the running process's seed file under it, as the kubelet updates a
// mounted Secret. The process reconnects on the identity it started with
// (nats.go's own option would sign with the new seed for the old key, and
// be refused); a restarted process connects with the new one; and once
// NATS restarts with the rotated Secret, the old identity is refused and
// the new one still admitted.
func TestRotationKeepsEachProcessOnItsIdentity(t *testing.T) {
	data, err := natsauth.SecretData()
	if err != nil {
		t.Fatal(err)
	}
	users := func(d map[string][]byte) []*server.NkeyUser {
		return []*server.NkeyUser{{Nkey: string(d[natsauth.Edge.PublicKey(false)])}, {Nkey: string(d[natsauth.Edge.PublicKey(true)])}}
	}
	seed := filepath.Join(t.TempDir(), "edge.nk")
	if err := os.WriteFile(seed, data[natsauth.Edge.SeedKey(false)], 0o600); err != nil {
		t.Fatal(err)
	}
	s := natstest.StartWith(t, embednats.Options{Dir: t.TempDir(), Users: users(data)})
	quiet := slog.New(slog.DiscardHandler)
	connect := func() (*nats.Conn, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		nc, _, err := natsconn.Connect(ctx, natsconn.Options{URL: s.URL(), Name: "edge", Auth: config.NATSAuth{NKey: seed}}, quiet)
		if err == nil {
			t.Cleanup(nc.Close)
		}
		return nc, err
	}
	old, err := connect()
	if err != nil {
		t.Fatal(err)
	}
	oldKey := string(data[natsauth.Edge.PublicKey(false)])

	rotated, err := natsauth.Rotate(data, natsauth.Edge)
	if err != nil {
		t.Fatal(err)
	}
	maps.Copy(data, rotated)
	if err := os.WriteFile(seed, data[natsauth.Edge.SeedKey(false)], 0o600); err != nil {
		t.Fatal(err)
	}
	// NATS not yet restarted: a reconnect of the running process, and a
	// restarted process on the new seed.
	port := s.Addr().(*net.TCPAddr).Port
	restart := func(u []*server.NkeyUser) {
		s.Stop()
		o := embednats.Options{Dir: s.Dir(), Port: port, Users: u}
		s = natstest.StartWith(t, o)
	}
	restart(users(map[string][]byte{natsauth.Edge.PublicKey(false): []byte(oldKey), natsauth.Edge.PublicKey(true): rotated[natsauth.Edge.PublicKey(false)]}))
	waitConnected(t, old, true)
	if got := connectedKey(t, s, old); got != oldKey {
		t.Fatalf("the running process came back as %s, want its own %s", got, oldKey)
	}
	restarted, err := connect()
	if err != nil {
		t.Fatalf("a restarted process on the promoted key: %v", err)
	}

	// NATS restarts with the rotated Secret: the old key is retired.
	restart(users(data))
	waitConnected(t, restarted, true)
	if got := connectedKey(t, s, restarted); got != string(data[natsauth.Edge.PublicKey(false)]) {
		t.Fatalf("the restarted process is %s", got)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if err := old.LastError(); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
			return fmt.Errorf("the old identity's last error is %v", err)
		}
		return nil
	})
	if old.IsConnected() {
		t.Fatal("the retired identity is still connected")
	}
}

func waitConnected(t *testing.T, nc *nats.Conn, want bool) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, func() error {
		if nc.IsConnected() != want {
			return fmt.Errorf("connected %v (last error %v)", nc.IsConnected(), nc.LastError())
		}
		return nil
	})
}

// connectedKey is the nkey the server says nc authenticated with.
func connectedKey(t *testing.T, s *embednats.Server, nc *nats.Conn) string {
	t.Helper()
	id, err := nc.GetClientID()
	if err != nil {
		t.Fatal(err)
	}
	cz, err := s.Connz(&server.ConnzOptions{CID: id, Username: true})
	if err != nil || len(cz.Conns) != 1 {
		t.Fatalf("connz for %d: %v %v", id, err, cz)
	}
	return cz.Conns[0].AuthorizedUser
}
