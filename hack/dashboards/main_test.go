package main

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// root is the repository root, from this package's directory.
const root = "../.."

// The files in Dir are what this program writes: a changed panel was
// regenerated.
func TestDashboardsAreCurrent(t *testing.T) {
	for _, d := range Dashboards {
		want, err := d.JSON()
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(root, Dir, d.file))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s is stale (%v): go run ./hack/dashboards", d.file, err)
		}
		if !json.Valid(got) {
			t.Errorf("%s is not JSON", d.file)
		}
	}
}

// Every aaas_ metric a panel queries is one the processes define (the
// name as a string in their code; a histogram's _bucket, _sum and _count
// are its own), so no panel stays empty for a typo or a renamed metric.
func TestDashboardMetricsExist(t *testing.T) {
	defined := map[string]bool{}
	literal := regexp.MustCompile(`"(aaas_[a-z_]+)"`)
	for _, dir := range []string{"internal", "cmd"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, e fs.DirEntry, err error) error {
			if err != nil || e.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			for _, m := range literal.FindAllSubmatch(b, -1) {
				defined[string(m[1])] = true
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	used := regexp.MustCompile(`\baaas_[a-z_]+`)
	n := 0
	for _, d := range Dashboards {
		for _, p := range d.panels {
			for _, q := range p.queries {
				for _, name := range used.FindAllString(q.expr, -1) {
					n++
					base := name
					for _, suffix := range []string{"_bucket", "_sum", "_count"} {
						base = strings.TrimSuffix(base, suffix)
					}
					if !defined[name] && !defined[base] {
						t.Errorf("%s, %q: %s is defined nowhere in the processes' code", d.file, p.title, name)
					}
				}
			}
		}
	}
	if n < 30 {
		t.Fatalf("only %d metric names in the dashboards", n)
	}
}
