package sandbox

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"maps"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"
)

// Rollouts: a sandbox keeps the pod template it was adopted with.
// Rolling a sleeping sandbox forward writes its profile's current pod
// template over its own, so that the pod its next wake starts runs the
// new image on the same volume; the previous template is kept on the
// Sandbox (one revision back): a pod of the new revision that fails soon
// after is rolled back to it, and the revision halted.
//
// A revision is the gateway's own name for a pod spec: eight hex digits
// of FNV-1a over its JSON. agent-sandbox marks warm-pool spares with a
// hash of its own, but its controllers drop that mark from the pod
// template as a claim adopts a spare, and a sandbox made without a spare
// never has it; the spec itself is always there, the same for a
// template and a sandbox made from it.

const (
	// RolledAtAnnotation, on a rolled Sandbox, is when it was rolled
	// (RFC 3339): a pod of its new revision that ends within
	// ROLLOUT_PROBATION of it rolls it back.
	RolledAtAnnotation = "aaas.example.com/rolled-at"
	// HaltedAnnotation, on a Sandbox rolled back, is the revision whose
	// pod failed it: no sandbox is rolled to that revision again (until
	// the annotation is removed).
	HaltedAnnotation = "aaas.example.com/halted-revision"
	// PreviousAnnotation, on a rolled Sandbox, is the pod template it had
	// before (JSON of sandboxv1beta1.PodTemplate), what a rollback puts
	// back; PreviousRevisionAnnotation is that template's revision.
	PreviousAnnotation         = "aaas.example.com/previous-pod-template"
	PreviousRevisionAnnotation = "aaas.example.com/previous-revision"
)

// Revision is the revision of sb's pod template: what its next pod runs,
// in state.ValidRevision's shape.
func Revision(sb *sandboxv1beta1.Sandbox) string { return revision(sb.Spec.PodTemplate.Spec) }

func revision(spec corev1.PodSpec) string {
	b, err := json.Marshal(spec)
	if err != nil {
		return "" // a typed PodSpec always marshals
	}
	h := fnv.New32a()
	h.Write(b)
	return fmt.Sprintf("%08x", h.Sum32())
}

// Template is the SandboxTemplate warm pool pool makes spares of, and its
// revision: what a sandbox of that pool's profile is rolled to.
func (c *Cluster) Template(ctx context.Context, pool string) (*extv1beta1.SandboxTemplate, string, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	wp, err := c.ext.ExtensionsV1beta1().SandboxWarmPools(c.cfg.Namespace).Get(ctx, pool, metav1.GetOptions{})
	if err != nil {
		return nil, "", fmt.Errorf("get warm pool %s: %w", pool, err)
	}
	t, err := c.ext.ExtensionsV1beta1().SandboxTemplates(c.cfg.Namespace).Get(ctx, wp.Spec.TemplateRef.Name, metav1.GetOptions{})
	if err != nil {
		return nil, "", fmt.Errorf("get template %s: %w", wp.Spec.TemplateRef.Name, err)
	}
	return t, revision(t.Spec.PodTemplate.Spec), nil
}

// Roll writes t's pod template over sleeping sandbox sb's, keeping sb's
// own labels and annotations on it (the pool's, the claim's) beside t's,
// and its current template as the one to roll back to. It applies only
// while sb sleeps: one woken meanwhile is left alone.
func (c *Cluster) Roll(ctx context.Context, sb *sandboxv1beta1.Sandbox, t *extv1beta1.SandboxTemplate) error {
	next := *t.Spec.PodTemplate.DeepCopy()
	next.ObjectMeta.Labels = merged(sb.Spec.PodTemplate.ObjectMeta.Labels, t.Spec.PodTemplate.ObjectMeta.Labels)
	next.ObjectMeta.Annotations = merged(sb.Spec.PodTemplate.ObjectMeta.Annotations, t.Spec.PodTemplate.ObjectMeta.Annotations)
	return c.replaceTemplate(ctx, sb, next, map[string]string{
		PreviousAnnotation: string(prev(sb)), PreviousRevisionAnnotation: Revision(sb), RolledAtAnnotation: time.Now().UTC().Format(time.RFC3339),
	}, true)
}

// prev is sb's pod template as the one to roll back to.
func prev(sb *sandboxv1beta1.Sandbox) []byte {
	b, _ := json.Marshal(sb.Spec.PodTemplate) // a typed PodTemplate always marshals
	return b
}

// RolledAt is when sb was last rolled forward, if it has not been rolled
// back since.
func RolledAt(sb *sandboxv1beta1.Sandbox) (time.Time, bool) {
	at, err := time.Parse(time.RFC3339, sb.Annotations[RolledAtAnnotation])
	return at, err == nil && sb.Annotations[PreviousAnnotation] != ""
}

// Unroll puts back the pod template sb had before its last rollout and
// marks the revision it leaves halted, whatever mode sb is in (its pod of
// that revision has just ended); false when it keeps no previous one.
func (c *Cluster) Unroll(ctx context.Context, sb *sandboxv1beta1.Sandbox) (bool, error) {
	raw, ok := sb.Annotations[PreviousAnnotation]
	if !ok {
		return false, nil
	}
	var back sandboxv1beta1.PodTemplate
	if err := json.Unmarshal([]byte(raw), &back); err != nil {
		return false, fmt.Errorf("sandbox %s: %s unreadable: %w", sb.Name, PreviousAnnotation, err)
	}
	return true, c.replaceTemplate(ctx, sb, back, map[string]string{
		HaltedAnnotation: Revision(sb), PreviousAnnotation: "", PreviousRevisionAnnotation: "", RolledAtAnnotation: "",
	}, false)
}

// Halted reports whether a rollout to rev failed some sandbox (the
// informer's view: every replica sees the same objects).
func (c *Cluster) Halted(rev string) bool {
	objs, _ := c.sandboxes.GetIndexer().ByIndex(byHalted, rev)
	return len(objs) > 0
}

// merged is a's entries and b's over them; nil when both are empty.
func merged(a, b map[string]string) map[string]string {
	if len(a)+len(b) == 0 {
		return nil
	}
	out := maps.Clone(a)
	if out == nil {
		out = map[string]string{}
	}
	maps.Copy(out, b)
	return out
}

// replaceTemplate writes next as sb's pod template and sets the given
// annotations ("" removes one) in one JSON patch; asleep, it applies only
// while sb is still Suspended: a sandbox woken meanwhile is left alone
// (the patch is refused as invalid). Not the resourceVersion: the
// controller's status writes change it all the time.
func (c *Cluster) replaceTemplate(ctx context.Context, sb *sandboxv1beta1.Sandbox, next sandboxv1beta1.PodTemplate, set map[string]string, asleep bool) error {
	annotations := maps.Clone(sb.Annotations)
	if annotations == nil {
		annotations = map[string]string{}
	}
	for k, v := range set {
		if v == "" {
			delete(annotations, k)
		} else {
			annotations[k] = v
		}
	}
	ops := []map[string]any{
		{"op": "replace", "path": "/spec/podTemplate", "value": next},
		{"op": "add", "path": "/metadata/annotations", "value": annotations},
	}
	if asleep {
		ops = append([]map[string]any{{"op": "test", "path": "/spec/operatingMode", "value": sandboxv1beta1.SandboxOperatingModeSuspended}}, ops...)
	}
	patch, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	ctx, cancel := c.call(ctx)
	defer cancel()
	if _, err := c.sandbox.AgentsV1beta1().Sandboxes(c.cfg.Namespace).Patch(ctx, sb.Name, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("patch sandbox %s: %w", sb.Name, err)
	}
	return nil
}
