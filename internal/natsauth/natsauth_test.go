package natsauth_test

import (
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/natsauth"
)

// The server configuration in the manifests and the README's table are
// the table in the code; regenerate them with go run ./hack/natsauth.
func TestManifestsAndREADMEShowThisTable(t *testing.T) {
	conf, err := os.ReadFile("../../manifests/base/nats/permissions.conf")
	if err != nil {
		t.Fatal(err)
	}
	if string(conf) != natsauth.ServerConfig() {
		t.Error("manifests/base/nats/permissions.conf is stale: go run ./hack/natsauth -permissions > manifests/base/nats/permissions.conf")
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), natsauth.Table()) {
		t.Errorf("README.md lacks the current permission table:\n%s", natsauth.Table())
	}
}

// Every identity in the table is a user of the manifests' NATS servers,
// its public key coming from the aaas-nats Secret: one left out could not
// connect to a real install at all.
func TestEveryIdentityIsAUserOfTheNATSServers(t *testing.T) {
	conf, err := os.ReadFile("../../manifests/base/nats/nats.conf")
	if err != nil {
		t.Fatal(err)
	}
	pod, err := os.ReadFile("../../manifests/base/nats.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range natsauth.Roles {
		up := strings.ToUpper(string(r))
		for _, next := range []bool{false, true} {
			if user := "{nkey: $" + r.NKeyVar(next) + ", permissions: $" + up + "_PERMISSIONS}"; !strings.Contains(string(conf), user) {
				t.Errorf("nats.conf lacks %s", user)
			}
			if env := "- name: " + r.NKeyVar(next) + "\n              valueFrom: {secretKeyRef: {name: aaas-nats, key: " + r.PublicKey(next) + "}}"; !strings.Contains(string(pod), env) {
				t.Errorf("nats.yaml lacks %s", env)
			}
		}
	}
}

// A fresh Secret holds a current and a staged next identity per role,
// each seed matching its public key, all distinct.
func TestSecretDataHoldsCurrentAndNextIdentities(t *testing.T) {
	data, err := natsauth.SecretData()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range natsauth.Roles {
		for _, next := range []bool{false, true} {
			pub := identity(t, data, r, next)
			if seen[pub] {
				t.Errorf("%s (next %v) repeats a key", r, next)
			}
			seen[pub] = true
		}
	}
	if len(data) != 4*len(natsauth.Roles)+1 || len(data["route-password"]) == 0 {
		t.Errorf("keys %v", slices.Sorted(maps.Keys(data)))
	}
}

// identity is r's (next) public key in data, its seed checked.
func identity(t *testing.T, data map[string][]byte, r natsauth.Role, next bool) string {
	t.Helper()
	pub, err := r.Identity(data, next)
	if err != nil {
		t.Fatal(err)
	}
	return pub
}

// An install from before the next identities gains exactly them; one
// holding half an identity is refused and nothing is made.
func TestMissingSecretDataAddsOnlyWhatIsAbsent(t *testing.T) {
	full, err := natsauth.SecretData()
	if err != nil {
		t.Fatal(err)
	}
	old := maps.Clone(full)
	for _, r := range natsauth.Roles {
		delete(old, r.SeedKey(true))
		delete(old, r.PublicKey(true))
	}
	more, err := natsauth.MissingSecretData(old)
	if err != nil {
		t.Fatal(err)
	}
	if len(more) != 2*len(natsauth.Roles) {
		t.Fatalf("added %v", slices.Sorted(maps.Keys(more)))
	}
	for _, r := range natsauth.Roles {
		identity(t, more, r, true)
	}
	if more, err := natsauth.MissingSecretData(full); err != nil || len(more) != 0 {
		t.Fatalf("a complete Secret gains %v, %v", slices.Sorted(maps.Keys(more)), err)
	}
	half := maps.Clone(full)
	delete(half, natsauth.Edge.PublicKey(true))
	if more, err := natsauth.MissingSecretData(half); err == nil || !strings.Contains(err.Error(), "edge.next.pub") || more != nil {
		t.Fatalf("half an identity: %v, %v", slices.Sorted(maps.Keys(more)), err)
	}
}

// Rotating promotes the staged identity (which NATS already accepts) and
// stages a fresh one; the other roles are untouched; a staged key that is
// absent or not its seed's is refused.
func TestRotatePromotesTheStagedIdentity(t *testing.T) {
	data, err := natsauth.SecretData()
	if err != nil {
		t.Fatal(err)
	}
	staged := identity(t, data, natsauth.Edge, true)
	was := identity(t, data, natsauth.Edge, false)
	changed, err := natsauth.Rotate(data, natsauth.Edge)
	if err != nil {
		t.Fatal(err)
	}
	if len(changed) != 4 {
		t.Fatalf("changed %v", slices.Sorted(maps.Keys(changed)))
	}
	if got := identity(t, changed, natsauth.Edge, false); got != staged {
		t.Errorf("current is %s, want the staged %s", got, staged)
	}
	if fresh := identity(t, changed, natsauth.Edge, true); fresh == staged || fresh == was {
		t.Errorf("the new staged key %s is not fresh", fresh)
	}

	for name, mutate := range map[string]func(map[string][]byte){
		"no staged seed":    func(d map[string][]byte) { delete(d, natsauth.Edge.SeedKey(true)) },
		"no staged key":     func(d map[string][]byte) { delete(d, natsauth.Edge.PublicKey(true)) },
		"another's key":     func(d map[string][]byte) { d[natsauth.Edge.PublicKey(true)] = d[natsauth.Broker.PublicKey(true)] },
		"not a seed":        func(d map[string][]byte) { d[natsauth.Edge.SeedKey(true)] = []byte("SUAnotaseed") },
		"a public for seed": func(d map[string][]byte) { d[natsauth.Edge.SeedKey(true)] = d[natsauth.Edge.PublicKey(true)] },
	} {
		d := maps.Clone(data)
		mutate(d)
		if changed, err := natsauth.Rotate(d, natsauth.Edge); err == nil || changed != nil {
			t.Errorf("%s: rotated (%v)", name, slices.Sorted(maps.Keys(changed)))
		} else if strings.Contains(err.Error(), string(d[natsauth.Edge.SeedKey(true)])) && len(d[natsauth.Edge.SeedKey(true)]) > 0 {
			t.Errorf("%s: the error shows the seed", name)
		}
	}
}
