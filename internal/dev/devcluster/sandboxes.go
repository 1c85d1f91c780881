package devcluster

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	sandboxclient "sigs.k8s.io/agent-sandbox/clients/k8s/clientset/versioned"
	extclient "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/manifests"
)

// SandboxClients returns admin clients for the agent-sandbox API groups.
func (c *Cluster) SandboxClients() (sandboxclient.Interface, extclient.Interface, error) {
	sc, err := sandboxclient.NewForConfig(c.Config)
	if err != nil {
		return nil, nil, fmt.Errorf("sandbox client: %w", err)
	}
	ec, err := extclient.NewForConfig(c.Config)
	if err != nil {
		return nil, nil, fmt.Errorf("extensions client: %w", err)
	}
	return sc, ec, nil
}

// SandboxManifests renders the SandboxTemplate and SandboxWarmPool that
// operators deploy (manifests/sandbox) and puts them in namespace.
func SandboxManifests(namespace string) (*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool, error) {
	objs, err := manifests.Render("manifests/sandbox")
	if err != nil {
		return nil, nil, err
	}
	tmpl := &extv1beta1.SandboxTemplate{}
	pool := &extv1beta1.SandboxWarmPool{}
	for kind, into := range map[string]any{"SandboxTemplate": tmpl, "SandboxWarmPool": pool} {
		found := manifests.Pick(objs, kind)
		if len(found) != 1 {
			return nil, nil, fmt.Errorf("manifests/sandbox has %d %s objects, want 1", len(found), kind)
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(found[0].Object, into, true); err != nil {
			return nil, nil, fmt.Errorf("decode %s: %w", kind, err)
		}
	}
	tmpl.Namespace, pool.Namespace = namespace, namespace
	return tmpl, pool, nil
}

// InstallSandboxes creates the namespace's SandboxTemplate and warm pool
// from manifests/sandbox (after mutate, if given, adjusts them) and waits
// until the pool's sandboxes are Ready.
func (c *Cluster) InstallSandboxes(ctx context.Context, namespace string, mutate func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool)) error {
	tmpl, pool, err := SandboxManifests(namespace)
	if err != nil {
		return err
	}
	if mutate != nil {
		mutate(tmpl, pool)
	}
	_, ext, err := c.SandboxClients()
	if err != nil {
		return err
	}
	if _, err := ext.ExtensionsV1beta1().SandboxTemplates(namespace).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create SandboxTemplate: %w", err)
	}
	if _, err := ext.ExtensionsV1beta1().SandboxWarmPools(namespace).Create(ctx, pool, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create SandboxWarmPool: %w", err)
	}
	want := int32(0)
	if pool.Spec.Replicas != nil {
		want = *pool.Spec.Replicas
	}
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := ext.ExtensionsV1beta1().SandboxWarmPools(namespace).Get(ctx, pool.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		return p.Status.ReadyReplicas >= want, nil
	})
}

// CreateNamespace creates a namespace and waits for its default
// ServiceAccount (pods cannot be admitted before it exists).
func (c *Cluster) CreateNamespace(ctx context.Context, name string) error {
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().ServiceAccounts(name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
}

// DeleteNamespace deletes a namespace without waiting for it to go.
func (c *Cluster) DeleteNamespace(ctx context.Context, name string) error {
	err := c.Client.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete namespace %s: %w", name, err)
	}
	return nil
}
