// Package manifests renders the kustomizations under manifests/ (from the
// copy embedded in the binary), operators' own kustomizations that compose
// them, and the Helm chart (charts/aaas), so tests, devcluster and `make
// run` apply exactly what operators deploy.
package manifests

import (
	"bytes"
	"fmt"
	"io/fs"
	"os/exec"
	"path"
	"regexp"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/resmap"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/aaas-project/aaas"
)

// Source is how operators' kustomizations refer to this repository's
// manifests (README, "Deploying to Kubernetes"); RenderKustomization maps
// it onto the embedded copy.
const Source = "https://github.com/aaas-project/aaas//manifests/"

// Overlays lists every kustomization (kind Kustomization) under manifests/.
func Overlays() ([]string, error) { return dirsOfKind("Kustomization") }

// Components lists every kustomize Component under manifests/: the
// exposures and hardening, which an install composes with base and sandbox.
func Components() ([]string, error) { return dirsOfKind("Component") }

func dirsOfKind(kind string) ([]string, error) {
	var dirs []string
	err := fs.WalkDir(aaas.Manifests, "manifests", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || path.Base(p) != "kustomization.yaml" {
			return err
		}
		b, err := fs.ReadFile(aaas.Manifests, p)
		if err != nil {
			return err
		}
		var k struct{ Kind string }
		if err := yaml.Unmarshal(b, &k); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if k.Kind == kind || (k.Kind == "" && kind == "Kustomization") {
			dirs = append(dirs, path.Dir(p))
		}
		return nil
	})
	return dirs, err
}

// Render builds the kustomization at dir (e.g. "manifests/base") and
// returns its objects.
func Render(dir string) ([]*unstructured.Unstructured, error) {
	mem, err := embedded()
	if err != nil {
		return nil, err
	}
	return run(mem, "/"+dir)
}

// RenderKustomization builds an operator's kustomization.yaml, whose
// resources and components name this repository's manifests by Source
// (any ?ref= is the embedded version).
func RenderKustomization(kustomization string) ([]*unstructured.Unstructured, error) {
	mem, err := embedded()
	if err != nil {
		return nil, err
	}
	if err := mem.WriteFile("/install/kustomization.yaml", []byte(Localize(kustomization, "../manifests"))); err != nil {
		return nil, err
	}
	return run(mem, "/install")
}

// Localize rewrites an operator's kustomization so that what it takes from
// this repository by Source (any ?ref=) comes from dir instead, a copy of
// manifests/ given relative to the kustomization's own directory
// (kustomize refuses absolute paths to bases): kubectl apply -k then
// builds it without the network.
func Localize(kustomization, dir string) string {
	var lines []string
	for _, l := range strings.Split(kustomization, "\n") {
		if i := strings.Index(l, Source); i >= 0 {
			ref := l[i+len(Source):]
			if j := strings.IndexAny(ref, "? \t#"); j >= 0 {
				ref = ref[:j]
			}
			l = l[:i] + strings.TrimSuffix(dir, "/") + "/" + ref
		}
		lines = append(lines, l)
	}
	return strings.Join(lines, "\n")
}

// embedded is an in-memory file system with manifests/ at its root.
func embedded() (filesys.FileSystem, error) {
	mem := filesys.MakeFsInMemory()
	err := fs.WalkDir(aaas.Manifests, "manifests", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(aaas.Manifests, p)
		if err != nil {
			return err
		}
		return mem.WriteFile("/"+p, b)
	})
	if err != nil {
		return nil, fmt.Errorf("load manifests: %w", err)
	}
	return mem, nil
}

// RenderDir builds a kustomization on disk (such as a Go module's own
// manifests).
func RenderDir(dir string) ([]*unstructured.Unstructured, error) {
	return run(filesys.MakeFsOnDisk(), dir)
}

func run(fsys filesys.FileSystem, dir string) ([]*unstructured.Unstructured, error) {
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	return objects(m, dir)
}

func objects(m resmap.ResMap, dir string) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, r := range m.Resources() {
		// Through JSON, so numbers are the int64s and float64s the
		// Kubernetes libraries expect.
		b, err := r.MarshalJSON()
		if err != nil {
			return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(b); err != nil {
			return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
		}
		objs = append(objs, u)
	}
	return objs, nil
}

// Pick returns the objects of one kind.
func Pick(objs []*unstructured.Unstructured, kind string) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind {
			out = append(out, o)
		}
	}
	return out
}

// Chart is the Helm chart's directory in the repository (charts/aaas).
const Chart = "charts/aaas"

// RenderChart renders the chart in dir with helm (the CLI at path helm)
// as `helm template release dir -n namespace args...` does, test hooks
// and install hooks included, and returns its objects and NOTES.txt. A
// render the chart refuses (its schema, its checks) is an error carrying
// helm's message.
func RenderChart(helm, dir, release, namespace string, args ...string) ([]*unstructured.Unstructured, error) {
	cmd := exec.Command(helm, append([]string{"template", release, dir, "-n", namespace}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("helm template %s: %w: %s", strings.Join(args, " "), err, chartError(stderr.String()))
	}
	var objs []*unstructured.Unstructured
	for _, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(out), -1) {
		j, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			return nil, fmt.Errorf("helm template: %w in\n%s", err, doc)
		}
		if string(j) == "null" {
			continue
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(j); err != nil {
			return nil, fmt.Errorf("helm template: %w in\n%s", err, doc)
		}
		objs = append(objs, u)
	}
	return objs, nil
}

// chartError is helm's message without its informational lines (the
// chart's symbolic links to manifests/ are expected).
func chartError(stderr string) string {
	var keep []string
	for _, l := range strings.Split(strings.TrimSpace(stderr), "\n") {
		if !strings.Contains(l, "level=INFO") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}
