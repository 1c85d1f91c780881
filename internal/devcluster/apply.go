package devcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/aaas-project/aaas"
)

// Manifest decodes every object of a YAML file under manifests/.
func Manifest(path string) ([]*unstructured.Unstructured, error) {
	b, err := fs.ReadFile(aaas.Manifests, path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return DecodeObjects(b)
}

// DecodeObjects splits multi-document YAML into objects.
func DecodeObjects(b []byte) ([]*unstructured.Unstructured, error) {
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	var objs []*unstructured.Unstructured
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, fmt.Errorf("decode manifest: %w", err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
}

// ApplyOptions adjust Apply.
type ApplyOptions struct {
	// DryRun asks the API server to validate and admit without storing.
	DryRun bool
}

// Apply server-side-applies objs; namespaced objects without a namespace
// go to namespace.
func (c *Cluster) Apply(ctx context.Context, namespace string, objs ...*unstructured.Unstructured) error {
	return c.ApplyWith(ctx, namespace, ApplyOptions{}, objs...)
}

// ApplyWith is Apply with options.
func (c *Cluster) ApplyWith(ctx context.Context, namespace string, o ApplyOptions, objs ...*unstructured.Unstructured) error {
	dc, err := discovery.NewDiscoveryClientForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("discovery: %w", err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("dynamic client: %w", err)
	}
	opts := metav1.ApplyOptions{FieldManager: "devcluster", Force: true}
	if o.DryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	for _, obj := range objs {
		gvk := obj.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return fmt.Errorf("%s %s: %w", gvk.Kind, obj.GetName(), err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ns := obj.GetNamespace()
			if ns == "" {
				ns = namespace
				obj.SetNamespace(ns)
			}
			ri = dyn.Resource(m.Resource).Namespace(ns)
		}
		if _, err := ri.Apply(ctx, obj.GetName(), obj, opts); err != nil {
			return fmt.Errorf("apply %s %s: %w", gvk.Kind, obj.GetName(), err)
		}
	}
	return nil
}
