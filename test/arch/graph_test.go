// Package arch holds the import rules DESIGN.md and the README state, as
// a test: a change that breaks one fails here, naming the import.
package arch

import (
	"os"
	"os/exec"
	"path"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/aaas-project/aaas/"

// features are the packages that do one process's work; they meet only
// through events and KV, as the processes do.
var features = []string{"accounts", "admin", "proxy", "lifecycle", "sweeper", "broker"}

// processes are the commands operators run; their code is production code.
var processes = []string{"edge", "lifecycle", "sweeper", "broker", "setup"}

// goList runs go list over the module with format f, one line per package.
func goList(t *testing.T, args ...string) []string {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list"}, args...)...)
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list %v: %v", args, err)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}

// imports maps each package of the module (tests excluded) to its direct
// imports, both without the module prefix for our own.
func imports(t *testing.T) map[string][]string {
	g := map[string][]string{}
	for _, line := range goList(t, "-f", "{{.ImportPath}} {{join .Imports \" \"}}", "./...") {
		f := strings.Fields(line)
		var deps []string
		for _, d := range f[1:] {
			deps = append(deps, strings.TrimPrefix(d, module))
		}
		g[strings.TrimPrefix(f[0], module)] = deps
	}
	return g
}

func kind(pkg string) string {
	switch {
	case strings.HasPrefix(pkg, "internal/dev/"):
		return "dev"
	case pkg == "internal/edge":
		return "edge"
	case slices.Contains(features, strings.TrimPrefix(pkg, "internal/")):
		return "feature"
	case strings.HasPrefix(pkg, "internal/"):
		return "shared"
	}
	return "other"
}

// The graph points one way: cmd → edge → features → shared packages. No
// feature package imports another, a shared package imports no feature
// and no production package imports development tooling.
func TestImportGraph(t *testing.T) {
	g := imports(t)
	if len(g) < 40 {
		t.Fatalf("go list saw %d packages; the test reads the wrong tree", len(g))
	}
	for pkg, deps := range g {
		for _, d := range deps {
			switch from, to := kind(pkg), kind(d); {
			case from == "feature" && to == "feature":
				t.Errorf("%s imports %s: feature packages meet only through events and KV", pkg, d)
			case from == "shared" && (to == "feature" || to == "edge"):
				t.Errorf("%s imports %s: shared packages serve the features, not the other way", pkg, d)
			case from != "dev" && to == "dev" && !strings.HasPrefix(pkg, "hack/"):
				t.Errorf("%s imports %s: production code never imports development tooling", pkg, d)
			}
		}
	}
	for _, d := range g["internal/ident"] {
		if strings.HasPrefix(d, "internal/") || strings.Contains(d, "fiber") || strings.Contains(d, "fasthttp") {
			t.Errorf("internal/ident imports %s: it is the leaf every process shares", d)
		}
	}
	// A positive control: the rules see an import that exists.
	if !slices.Contains(g["internal/edge"], "internal/proxy") {
		t.Error("internal/edge does not import internal/proxy; the graph read is not the module's")
	}
}

// Fiber and fasthttp are the edge's server: no other process links them.
func TestOnlyTheEdgeLinksItsServer(t *testing.T) {
	for _, p := range processes {
		var server []string
		for _, d := range goList(t, "-deps", "./cmd/"+p) {
			if strings.Contains(d, "gofiber/fiber") || strings.Contains(d, "valyala/fasthttp") {
				server = append(server, d)
			}
		}
		switch {
		case p == "edge" && len(server) == 0:
			t.Error("cmd/edge links no fiber: the check looks for the wrong modules")
		case p != "edge" && len(server) > 0:
			t.Errorf("cmd/%s links %s", p, strings.Join(server, ", "))
		}
	}
}

// A process's main only wires: the edge's is no longer than the sweeper's.
func TestMainsOnlyWire(t *testing.T) {
	lines := func(cmd string) int {
		b, err := os.ReadFile(path.Join("../../cmd", cmd, "main.go"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(string(b), "\n")
	}
	if e, s := lines("edge"), lines("sweeper"); e > s {
		t.Errorf("cmd/edge/main.go is %d lines, cmd/sweeper's %d: build the edge in internal/edge", e, s)
	}
}
