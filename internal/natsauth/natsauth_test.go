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
