package natsauth_test

import (
	"os"
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
		if user := "{nkey: $NATS_" + up + "_NKEY, permissions: $" + up + "_PERMISSIONS}"; !strings.Contains(string(conf), user) {
			t.Errorf("nats.conf lacks %s", user)
		}
		if env := "- name: NATS_" + up + "_NKEY\n              valueFrom: {secretKeyRef: {name: aaas-nats, key: " + string(r) + ".pub}}"; !strings.Contains(string(pod), env) {
			t.Errorf("nats.yaml lacks %s", env)
		}
	}
}
