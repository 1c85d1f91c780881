// Package installsecrets creates the generated Secrets of a chart install
// (`setup secrets`, a pre-install and pre-upgrade hook): the handshake key
// and invite code, the NATS identities and route password, and the NATS
// nodes' CA and certificate. Each is created only when absent, with a
// Create that fails on an existing one, so no run ever replaces a
// credential: an upgrade, a re-run or two concurrent runs keep the first.
// What it creates carries no Helm ownership, so uninstalling the chart
// keeps it too.
package installsecrets

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natstls"
)

// Outcome is what Ensure did with one Secret.
type Outcome struct {
	Name string
	// Created is false when the Secret existed and was kept as it was.
	Created bool
}

// generator makes one Secret's data.
type generator func(namespace string) (map[string][]byte, error)

// Ensure creates each Secret cfg names that does not exist yet and reports
// what it did, in the order app, NATS, NATS TLS.
func Ensure(ctx context.Context, client kubernetes.Interface, cfg config.Secrets) ([]Outcome, error) {
	var out []Outcome
	for _, s := range []struct {
		name string
		gen  generator
	}{
		{cfg.App, appData},
		{cfg.NATS, func(string) (map[string][]byte, error) { return natsauth.SecretData() }},
		{cfg.NATSTLS, natstls.SecretData},
	} {
		if s.name == "" {
			continue
		}
		created, err := ensure(ctx, client, cfg, s.name, s.gen)
		if err != nil {
			return out, err
		}
		out = append(out, Outcome{Name: s.name, Created: created})
	}
	return out, nil
}

func ensure(ctx context.Context, client kubernetes.Interface, cfg config.Secrets, name string, gen generator) (bool, error) {
	secrets := client.CoreV1().Secrets(cfg.Namespace)
	cctx, cancel := context.WithTimeout(ctx, cfg.CallTimeout)
	defer cancel()
	// A Get first spares generating keys for a Secret that exists; the
	// Create below still decides, as another run may create it meanwhile.
	if _, err := secrets.Get(cctx, name, metav1.GetOptions{}); err == nil {
		return false, nil
	} else if !apierrors.IsNotFound(err) {
		return false, fmt.Errorf("secret %s/%s: %w", cfg.Namespace, name, err)
	}
	data, err := gen(cfg.Namespace)
	if err != nil {
		return false, fmt.Errorf("secret %s/%s: %w", cfg.Namespace, name, err)
	}
	_, err = secrets.Create(cctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cfg.Namespace, Labels: map[string]string{
			"app.kubernetes.io/part-of": "aaas",
			// Says who made it; deliberately not Helm's managed-by, so
			// the release never owns (or deletes) a credential.
			"app.kubernetes.io/created-by": "aaas-setup-secrets",
		}},
		Type: corev1.SecretTypeOpaque,
		Data: data,
	}, metav1.CreateOptions{})
	switch {
	case apierrors.IsAlreadyExists(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("secret %s/%s: %w", cfg.Namespace, name, err)
	}
	return true, nil
}

// appData is the handshake key ring's first key (AES-256, as
// HANDSHAKE_KEYS reads it) and an invite code.
func appData(string) (map[string][]byte, error) {
	key := make([]byte, 32)
	code := make([]byte, 8)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	if _, err := rand.Read(code); err != nil {
		return nil, err
	}
	return map[string][]byte{
		"handshake-keys": []byte(base64.StdEncoding.EncodeToString(key)),
		"invite-code":    []byte(hex.EncodeToString(code)),
	}, nil
}
