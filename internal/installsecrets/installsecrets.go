// Package installsecrets creates the generated Secrets of a chart install
// (`setup secrets`, a pre-install and pre-upgrade hook): the handshake key
// and invite code, the NATS identities and route password, and the NATS
// nodes' CA and certificate. Each is created only when absent, with a
// Create that fails on an existing one, so no run ever replaces a
// credential: an upgrade, a re-run or two concurrent runs keep the first.
// The one addition: an existing NATS Secret gains the identities of
// process kinds a newer release brings (their keys only, by a patch that
// fails if the key appeared meanwhile), as the NATS servers of that
// release need every identity's public key to start. What it creates
// carries no Helm ownership, so uninstalling the chart keeps it too.
// RotateNATS is the one replacement, and only when an operator asks:
// `setup rotate-nats ROLE...`.
package installsecrets

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natstls"
)

// Outcome is what Ensure did with one Secret.
type Outcome struct {
	Name string
	// Created is false when the Secret existed and was kept as it was
	// (but for Added).
	Created bool
	// Added are the keys an existing Secret gained.
	Added []string
}

// generator makes one Secret's data.
type generator func(namespace string) (map[string][]byte, error)

// completer makes the keys an existing Secret lacks (nil: never added to).
type completer func(existing map[string][]byte) (map[string][]byte, error)

// Ensure creates each Secret cfg names that does not exist yet and reports
// what it did, in the order app, NATS, NATS TLS.
func Ensure(ctx context.Context, client kubernetes.Interface, cfg config.Secrets) ([]Outcome, error) {
	var out []Outcome
	for _, s := range []struct {
		name     string
		gen      generator
		complete completer
	}{
		{cfg.App, appData, nil},
		{cfg.NATS, func(string) (map[string][]byte, error) { return natsauth.SecretData() }, natsauth.MissingSecretData},
		{cfg.NATSTLS, natstls.SecretData, nil},
	} {
		if s.name == "" {
			continue
		}
		o, err := ensure(ctx, client, cfg, s.name, s.gen, s.complete)
		if err != nil {
			return out, err
		}
		out = append(out, o)
	}
	return out, nil
}

func ensure(ctx context.Context, client kubernetes.Interface, cfg config.Secrets, name string, gen generator, complete completer) (Outcome, error) {
	secrets := client.CoreV1().Secrets(cfg.Namespace)
	cctx, cancel := context.WithTimeout(ctx, cfg.CallTimeout)
	defer cancel()
	// A Get first spares generating keys for a Secret that exists; the
	// Create below still decides, as another run may create it meanwhile.
	if cur, err := secrets.Get(cctx, name, metav1.GetOptions{}); err == nil {
		return add(cctx, client, cfg.Namespace, cur, complete)
	} else if !apierrors.IsNotFound(err) {
		return Outcome{Name: name}, fmt.Errorf("secret %s/%s: %w", cfg.Namespace, name, err)
	}
	data, err := gen(cfg.Namespace)
	if err != nil {
		return Outcome{Name: name}, fmt.Errorf("secret %s/%s: %w", cfg.Namespace, name, err)
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
		return Outcome{Name: name}, nil
	case err != nil:
		return Outcome{Name: name}, fmt.Errorf("secret %s/%s: %w", cfg.Namespace, name, err)
	}
	return Outcome{Name: name, Created: true}, nil
}

// add gives the existing Secret cur the keys complete makes for it, by a
// JSON patch that tests each key absent first: a key another run added
// meanwhile is kept, and this run's patch fails whole (and says so).
func add(ctx context.Context, client kubernetes.Interface, namespace string, cur *corev1.Secret, complete completer) (Outcome, error) {
	o := Outcome{Name: cur.Name}
	if complete == nil {
		return o, nil
	}
	more, err := complete(cur.Data)
	if err != nil || len(more) == 0 {
		return o, err
	}
	var ops []map[string]any
	if cur.Data == nil {
		ops = append(ops, map[string]any{"op": "add", "path": "/data", "value": map[string]any{}})
	}
	patch, keys, err := guardedPatch(cur, "add", more, ops...)
	if err != nil {
		return o, err
	}
	o.Added = keys
	if _, err := client.CoreV1().Secrets(namespace).Patch(ctx, cur.Name, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		return Outcome{Name: cur.Name}, fmt.Errorf("secret %s/%s: add %s: %w", namespace, cur.Name, strings.Join(o.Added, ", "), err)
	}
	return o, nil
}

// RotateNATS rotates the NATS identities of roles in the Secret cfg.NATS
// names (natsauth.Rotate: each role's staged next identity becomes its
// current one, and a fresh one is staged), all in one patch that fails
// whole if the Secret changed since it was read. What to restart, and in
// which order, is the operator's (docs/RUNBOOK.md, "Rotating secrets").
func RotateNATS(ctx context.Context, client kubernetes.Interface, cfg config.Secrets, roles []natsauth.Role) error {
	if cfg.NATS == "" {
		return errors.New("no NATS Secret is configured (GENERATE_NATS_SECRET)")
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.CallTimeout)
	defer cancel()
	secrets := client.CoreV1().Secrets(cfg.Namespace)
	cur, err := secrets.Get(ctx, cfg.NATS, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("secret %s/%s: %w", cfg.Namespace, cfg.NATS, err)
	}
	changed := map[string][]byte{}
	for _, r := range roles {
		more, err := natsauth.Rotate(cur.Data, r)
		if err != nil {
			return fmt.Errorf("secret %s/%s: %w", cfg.Namespace, cfg.NATS, err)
		}
		maps.Copy(changed, more)
	}
	patch, _, err := guardedPatch(cur, "replace", changed)
	if err != nil {
		return err
	}
	if _, err := secrets.Patch(ctx, cfg.NATS, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("secret %s/%s: rotate: %w", cfg.Namespace, cfg.NATS, err)
	}
	return nil
}

// guardedPatch is a JSON patch that does op ("add" or "replace") with
// each of data's keys, in key order, after first, and fails whole if the
// Secret changed since cur was read (the resourceVersion test). It
// returns the keys, sorted.
func guardedPatch(cur *corev1.Secret, op string, data map[string][]byte, first ...map[string]any) ([]byte, []string, error) {
	ops := append([]map[string]any{{"op": "test", "path": "/metadata/resourceVersion", "value": cur.ResourceVersion}}, first...)
	keys := slices.Sorted(maps.Keys(data))
	for _, k := range keys {
		// "~1" is "/" in a JSON pointer; keys here are <role>.nk and .pub.
		path := "/data/" + strings.ReplaceAll(strings.ReplaceAll(k, "~", "~0"), "/", "~1")
		ops = append(ops, map[string]any{"op": op, "path": path, "value": base64.StdEncoding.EncodeToString(data[k])})
	}
	patch, err := json.Marshal(ops)
	return patch, keys, err
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
