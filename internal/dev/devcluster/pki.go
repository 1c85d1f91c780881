package devcluster

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki is the throwaway certificate authority of one cluster: serving certs
// for the API server and the simulated kubelet, client certs for the admin
// and for the API server's calls to the kubelet, and the service-account
// signing key.
type pki struct {
	dir    string
	caCert *x509.Certificate
	caKey  crypto.Signer
}

func newPKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("pki dir: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("ca key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "devcluster-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("ca cert: %w", err)
	}
	cert, _ := x509.ParseCertificate(der)
	p := &pki{dir: dir, caCert: cert, caKey: key}
	if err := p.write("ca.crt", "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

func (p *pki) write(name, typ string, der []byte) error {
	b := pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
	if err := os.WriteFile(p.path(name), b, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

func (p *pki) caPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.caCert.Raw})
}

// issue writes <name>.crt and <name>.key signed by the CA.
func (p *pki) issue(name, cn string, orgs []string, ips []net.IP, dns []string, usage x509.ExtKeyUsage) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("%s key: %w", name, err)
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  ips,
		DNSNames:     dns,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, key.Public(), p.caKey)
	if err != nil {
		return fmt.Errorf("%s cert: %w", name, err)
	}
	if err := p.write(name+".crt", "CERTIFICATE", der); err != nil {
		return err
	}
	return p.writeKey(name+".key", key)
}

func (p *pki) writeKey(name string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return p.write(name, "PRIVATE KEY", der)
}

// serviceAccountKey writes sa.key and sa.pub for token signing.
func (p *pki) serviceAccountKey() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("service account key: %w", err)
	}
	if err := p.writeKey("sa.key", key); err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return fmt.Errorf("service account public key: %w", err)
	}
	return p.write("sa.pub", "PUBLIC KEY", pub)
}

// all issues every certificate the control plane uses. apiIPs are the
// addresses the API server is reached at besides loopback (its Service IP,
// and the real node's gateway).
func (p *pki) all(apiIPs ...string) error {
	loopback := []net.IP{net.ParseIP("127.0.0.1")}
	serving := append([]net.IP{}, loopback...)
	for _, ip := range apiIPs {
		serving = append(serving, net.ParseIP(ip))
	}
	steps := []func() error{
		func() error {
			return p.issue("apiserver", "kube-apiserver", nil, serving,
				[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
				x509.ExtKeyUsageServerAuth)
		},
		func() error {
			return p.issue("admin", "devcluster-admin", []string{"system:masters"}, nil, nil, x509.ExtKeyUsageClientAuth)
		},
		func() error {
			return p.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil, nil, x509.ExtKeyUsageClientAuth)
		},
		func() error {
			return p.issue("kubelet", "system:node:"+nodeName, []string{"system:nodes"}, loopback, []string{"localhost"}, x509.ExtKeyUsageServerAuth)
		},
		p.serviceAccountKey,
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return err
		}
	}
	return nil
}

// realNode issues what a real node's components authenticate with: the
// kubelet's client and serving certificates (NodeRestriction keys on
// system:node:<name>), kube-proxy, the scheduler and the controller
// manager, each with its own identity and RBAC.
func (p *pki) realNode(node, ip string) error {
	steps := [][]string{
		{"kubelet-client", "system:node:" + node, "system:nodes"},
		{"kube-proxy", "system:kube-proxy", ""},
		{"kube-scheduler", "system:kube-scheduler", ""},
		{"kube-controller-manager", "system:kube-controller-manager", ""},
	}
	for _, s := range steps {
		var orgs []string
		if s[2] != "" {
			orgs = []string{s[2]}
		}
		if err := p.issue(s[0], s[1], orgs, nil, nil, x509.ExtKeyUsageClientAuth); err != nil {
			return err
		}
	}
	return p.issue("kubelet-serving", "system:node:"+node, []string{"system:nodes"},
		[]net.IP{net.ParseIP(ip), net.ParseIP("127.0.0.1")}, []string{node, "localhost"}, x509.ExtKeyUsageServerAuth)
}
