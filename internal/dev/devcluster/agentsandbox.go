package devcluster

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/manifests"
)

// AgentSandboxNamespace is where the agent-sandbox release runs its
// controller.
const AgentSandboxNamespace = "agent-sandbox-system"

// AgentSandboxRelease renders the pinned agent-sandbox release the way its
// sandbox-with-extensions.yaml asset is made: the module's k8s/
// kustomization (core and extensions, the controller declared once) with
// the published controller image in place of the ko:// placeholder. It is
// what operators apply, conversion webhook and all.
func AgentSandboxRelease() ([]*unstructured.Unstructured, error) {
	dir, err := ModuleDir("sigs.k8s.io/agent-sandbox", aaas.Version("AGENT_SANDBOX_VERSION"))
	if err != nil {
		return nil, err
	}
	objs, err := manifests.RenderDir(filepath.Join(dir, "k8s"))
	if err != nil {
		return nil, err
	}
	replaced := 0
	for _, o := range manifests.Pick(objs, "Deployment") {
		containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
		for _, c := range containers {
			m := c.(map[string]any)
			if img, _ := m["image"].(string); strings.HasPrefix(img, "ko://") {
				m["image"] = image.AgentSandboxRef()
				replaced++
			}
		}
		if err := unstructured.SetNestedSlice(o.Object, containers, "spec", "template", "spec", "containers"); err != nil {
			return nil, err
		}
	}
	if replaced != 1 {
		return nil, fmt.Errorf("agent-sandbox release: %d ko:// images, want the controller's only", replaced)
	}
	return objs, nil
}

// InstallAgentSandbox applies the agent-sandbox release (its image must be
// on the node: image.AgentSandbox) and waits until the controller is
// available and its CRDs are served.
func (c *Cluster) InstallAgentSandbox(ctx context.Context) error {
	objs, err := AgentSandboxRelease()
	if err != nil {
		return err
	}
	if err := c.Apply(ctx, AgentSandboxNamespace, objs...); err != nil {
		return err
	}
	if err := c.WaitRollout(ctx, AgentSandboxNamespace, 3*time.Minute); err != nil {
		return err
	}
	// The controller patches the conversion webhook's CA into the CRDs at
	// start; a list through the webhook-backed CRD proves they serve.
	_, ext, err := c.SandboxClients()
	if err != nil {
		return err
	}
	return waitFor(ctx, nil, "agent-sandbox CRDs", time.Minute, func() error {
		_, err := ext.ExtensionsV1beta1().SandboxTemplates("default").List(ctx, metav1.ListOptions{})
		return err
	})
}

// WaitRollout waits until every Deployment and StatefulSet in namespace has
// all its replicas updated and ready, as `kubectl rollout status` does.
func (c *Cluster) WaitRollout(ctx context.Context, namespace string, timeout time.Duration) error {
	return waitFor(ctx, nil, "rollout in "+namespace, timeout, func() error {
		var pending []string
		deps, err := c.Client.AppsV1().Deployments(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, d := range deps.Items {
			if !deploymentDone(&d) {
				pending = append(pending, fmt.Sprintf("deployment/%s %d/%d", d.Name, d.Status.AvailableReplicas, replicas(d.Spec.Replicas)))
			}
		}
		sets, err := c.Client.AppsV1().StatefulSets(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, s := range sets.Items {
			if s.Status.ObservedGeneration < s.Generation || s.Status.ReadyReplicas < replicas(s.Spec.Replicas) || s.Status.UpdatedReplicas < replicas(s.Spec.Replicas) {
				pending = append(pending, fmt.Sprintf("statefulset/%s %d/%d", s.Name, s.Status.ReadyReplicas, replicas(s.Spec.Replicas)))
			}
		}
		if len(pending) > 0 {
			return errors.New(strings.Join(pending, ", "))
		}
		return nil
	})
}

func replicas(r *int32) int32 {
	if r == nil {
		return 1
	}
	return *r
}

func deploymentDone(d *appsv1.Deployment) bool {
	want := replicas(d.Spec.Replicas)
	return d.Status.ObservedGeneration >= d.Generation && d.Status.UpdatedReplicas == want &&
		d.Status.AvailableReplicas == want && d.Status.Replicas == want
}
