// Package manifests renders the kustomize overlays under manifests/ (from
// the copy embedded in the binary), so tests, devcluster and `make run`
// apply exactly what operators deploy.
package manifests

import (
	"fmt"
	"io/fs"
	"path"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/aaas-project/aaas"
)

// Overlays lists every kustomization under manifests/.
func Overlays() ([]string, error) {
	var dirs []string
	err := fs.WalkDir(aaas.Manifests, "manifests", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && path.Base(p) == "kustomization.yaml" {
			dirs = append(dirs, path.Dir(p))
		}
		return err
	})
	return dirs, err
}

// Render builds the overlay at dir (e.g. "manifests/base") and returns its
// objects.
func Render(dir string) ([]*unstructured.Unstructured, error) {
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
	resmap, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(mem, "/"+dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	var objs []*unstructured.Unstructured
	for _, r := range resmap.Resources() {
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
