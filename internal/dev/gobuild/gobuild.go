// Package gobuild compiles Go commands for tests and tools: the project's
// own (dshsim for the simulated node, the aaas processes for images, and
// race-enabled aaas processes for the integration tests) and the ones the
// real node's images need (pause, nats-server).
package gobuild

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
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
	return out, build("CGO_ENABLED=0", "-trimpath", "-o", out, pkg)
}

// Static compiles the main packages pkgs into dir as static binaries,
// each named after its package's last element.
func Static(dir string, pkgs ...string) error {
	return build("CGO_ENABLED=0", append([]string{"-trimpath", "-o", dir + string(filepath.Separator)}, pkgs...)...)
}

// Race is Static with the race detector, which needs cgo (so a C
// compiler): a data race in such a process prints "WARNING: DATA RACE"
// to its stderr and, with RaceEnv, makes it exit with status 66. It
// keeps full paths (no -trimpath), so it shares compiled packages with
// `go test -race`.
func Race(dir string, pkgs ...string) error {
	return RaceFrom("", dir, nil, pkgs...)
}

// RaceFrom is Race run in the module at src (another checkout of this
// repository: an earlier release, for the upgrade tests), with extra
// flags (-ldflags) before the packages, which are relative to src.
func RaceFrom(src, dir string, flags []string, pkgs ...string) error {
	args := append([]string{"-race", "-o", dir + string(filepath.Separator)}, flags...)
	return buildIn(src, "CGO_ENABLED=1", append(args, pkgs...)...)
}

// RaceEnv is the GORACE setting for a race-enabled process: report every
// race and keep running (a test then sees all of them, not only the first),
// exit with 66 at the end if there was one, and do not sleep a second at
// exit as the default does (tests stop hundreds of processes).
const RaceEnv = "halt_on_error=0 exitcode=66 atexit_sleep_ms=0"

func build(cgo string, args ...string) error { return buildIn("", cgo, args...) }

// buildIn runs go build in src ("": the current directory).
func buildIn(src, cgo string, args ...string) error {
	cmd := exec.Command("go", append([]string{"build"}, args...)...)
	cmd.Dir = src
	cmd.Env = append(os.Environ(), cgo)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", strings.Join(args, " "), err, b)
	}
	return nil
}
