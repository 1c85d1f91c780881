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
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/embednats/natstest"
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
