// Package gobuild compiles Go commands for tests and tools: the project's
// own (dshsim for the simulated node, the aaas processes for images) and
// the ones the real node's images need (pause, nats-server).
package gobuild

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
)

// Binary compiles the main package pkg into dir as a static binary named
// after the package's last element and returns its path.
func Binary(dir, pkg string) (string, error) {
	return BinaryNamed(dir, pkg, path.Base(pkg))
}

// BinaryNamed is Binary with an explicit output name (for packages whose
// last element is a major version, like github.com/nats-io/nats-server/v2).
func BinaryNamed(dir, pkg, name string) (string, error) {
	out := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build %s: %w\n%s", pkg, err, b)
	}
	return out, nil
}
