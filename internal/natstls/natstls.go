// Package natstls makes the certificates NATS's TLS needs in an install
// that brings none of its own (no cert-manager): a CA for the install and
// one certificate, signed by it, that every NATS node presents to clients
// (port 4222) and to the other nodes (routes, port 6222, where both ends
// verify each other). It is written into Secret aaas-nats-tls in the
// layout cert-manager uses (tls.crt, tls.key, ca.crt), so either source
// fills the same Secret and the manifests need no change.
package natstls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"time"
)

// SecretName is the Secret the NATS StatefulSet and the aaas processes
// mount (manifests/base).
const SecretName = "aaas-nats-tls"

// Validity is how long the generated CA and certificate are valid;
// rotate them earlier by generating a new Secret (README, Operations).
const Validity = 5 * 365 * 24 * time.Hour

// DNSNames are the names a NATS node is reached by in namespace: the
// client Service, each node through the headless Service (the processes'
// NATS_URL and the routes), in short and in full form.
func DNSNames(namespace string) []string {
	var names []string
	for _, n := range []string{"nats", "nats-headless", "*.nats-headless"} {
		names = append(names, n, n+"."+namespace, n+"."+namespace+".svc", n+"."+namespace+".svc.cluster.local")
	}
	return names
}

// SecretData is a fresh CA and NATS certificate for namespace: ca.crt
// (what NATS_CA points to), tls.crt and tls.key (the nodes' own, valid
// for serving clients and, on routes, for both ends).
func SecretData(namespace string) (map[string][]byte, error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	ca := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "aaas NATS CA (" + namespace + ")"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(Validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, caKey.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("natstls: CA: %w", err)
	}
	ca, _ = x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	leaf := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "nats." + namespace},
		DNSNames:     DNSNames(namespace),
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(Validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		// Routes verify both ends: each node is the other's client.
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, key.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("natstls: certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return map[string][]byte{
		"ca.crt":  pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		"tls.crt": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		"tls.key": pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}
