package natstls

import (
	"crypto/tls"
	"crypto/x509"
	"testing"
)

// TestCertificateServesEveryNameAndBothRouteEnds: the certificate verifies
// against the CA for every name the processes and the routes use, as a
// server and as a route's client, and for no name of another namespace.
func TestCertificateServesEveryNameAndBothRouteEnds(t *testing.T) {
	data, err := SecretData("aaas")
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(data["tls.crt"], data["tls.key"])
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(data["ca.crt"]) {
		t.Fatal("ca.crt holds no certificate")
	}
	for _, name := range []string{"nats-0.nats-headless", "nats-2.nats-headless.aaas.svc.cluster.local", "nats", "nats.aaas.svc"} {
		for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
			if _, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
				t.Errorf("%s (usage %v): %v", name, usage, err)
			}
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "nats-0.nats-headless.other.svc.cluster.local", Roots: roots}); err == nil {
		t.Error("the certificate is valid for another namespace's NATS")
	}
	other, err := SecretData("aaas")
	if err != nil {
		t.Fatal(err)
	}
	otherRoots := x509.NewCertPool()
	otherRoots.AppendCertsFromPEM(other["ca.crt"])
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "nats", Roots: otherRoots}); err == nil {
		t.Error("a second install's CA accepts this install's certificate")
	}
}
