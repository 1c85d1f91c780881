package install_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// TestLifecycleHoldsNothingInTheControlPlane asks the API server what
// lifecycle's ServiceAccount may do: in the tenants' namespace exactly the
// verbs of its Role, on exactly its resources; in the control plane's
// namespace, where NATS's and the gateway's Secrets are, nothing at all.
func TestLifecycleHoldsNothingInTheControlPlane(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	role, err := cluster.Client.RbacV1().Roles(sandboxNS).Get(ctx, "aaas-lifecycle", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	user := "system:serviceaccount:" + controlNS + ":aaas-lifecycle"
	groups := []string{"system:serviceaccounts", "system:serviceaccounts:" + controlNS, "system:authenticated"}
	can := func(ns, group, res, sub, verb string) bool {
		t.Helper()
		r, err := cluster.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User: user, Groups: groups,
			ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: ns, Group: group, Resource: res, Subresource: sub, Verb: verb},
		}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return r.Status.Allowed
	}
	verbs := []string{"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
	granted := 0
	for _, rule := range role.Rules {
		for _, full := range rule.Resources {
			res, sub, _ := strings.Cut(full, "/")
			for _, verb := range verbs {
				want := slices.Contains(rule.Verbs, verb)
				if got := can(sandboxNS, rule.APIGroups[0], res, sub, verb); got != want {
					t.Errorf("in %s: %s %s: allowed %v, the Role says %v", sandboxNS, verb, full, got, want)
				}
				if want {
					granted++
				}
				if can(controlNS, rule.APIGroups[0], res, sub, verb) {
					t.Errorf("in the control plane's namespace %s lifecycle may %s %s", controlNS, verb, full)
				}
			}
		}
	}
	if granted < 10 {
		t.Fatalf("only %d verbs granted: the review did not see lifecycle's Role", granted)
	}
	for _, ns := range []string{controlNS, sandboxNS} {
		for _, res := range []string{"secrets", "configmaps", "serviceaccounts"} {
			for _, verb := range []string{"get", "list", "create"} {
				if can(ns, "", res, "", verb) {
					t.Errorf("lifecycle may %s %s in %s", verb, res, ns)
				}
			}
		}
		if can(ns, "", "pods", "exec", "create") {
			t.Errorf("lifecycle may exec into pods in %s", ns)
		}
	}
}

// TestAFullSandboxQuotaAdmitsTheControlPlane fills the tenants' quota (its
// pod limit lowered to what the sandboxes use), shows a tenant's pod is
// then refused, and deletes an edge pod: it is recreated and ready. As a
// control, the same full quota placed in the control plane's namespace (as
// when tenants and control plane shared one) does keep the replacement
// out, until it is lifted.
func TestAFullSandboxQuotaAdmitsTheControlPlane(t *testing.T) {
	ctx := testenv.Context(t, 6*time.Minute)
	core := cluster.Client.CoreV1()
	quotas := core.ResourceQuotas(sandboxNS)
	q, err := quotas.Get(ctx, "aaas", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	orig := q.Spec.Hard[corev1.ResourcePods]
	t.Cleanup(func() {
		_, _ = quotas.Patch(context.Background(), "aaas", types.MergePatchType, fmt.Appendf(nil, `{"spec":{"hard":{"pods":%q}}}`, orig.String()), metav1.PatchOptions{})
	})
	used := fill(t, ctx, sandboxNS, "aaas", 0)
	tenant := restrictedPod("tenant-" + randomHex(3))
	_, err = core.Pods(sandboxNS).Create(ctx, tenant, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "exceeded quota") {
		t.Fatalf("the tenants' quota is full (%d pods), yet a pod there was not refused: %v", used, err)
	}
	t.Logf("tenants' quota full at %d pods; a tenant's pod is refused: %v", used, err)

	replaced := deleteEdgePod(t, ctx)
	waitEdgesReady(t, ctx, replaced, 3*time.Minute)
	t.Logf("edge pod %s deleted with the tenants' quota full: replaced and ready", replaced)

	// Control: the same quota over the control plane's namespace.
	cq := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "shared-with-tenants"}, Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("10000")}}}
	if _, err := core.ResourceQuotas(controlNS).Create(ctx, cq, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	lift := func() {
		_ = core.ResourceQuotas(controlNS).Delete(context.Background(), cq.Name, metav1.DeleteOptions{})
	}
	t.Cleanup(lift)
	// One below what is used: the pod being deleted still counts while it
	// terminates, its replacement must not fit after it has gone either.
	fill(t, ctx, controlNS, cq.Name, 1)
	blocked := deleteEdgePod(t, ctx)
	testutil.Eventually(t, 2*time.Minute, func() error {
		evs, err := core.Events(controlNS).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreate"})
		if err != nil {
			return err
		}
		for _, e := range evs.Items {
			if e.InvolvedObject.Kind == "ReplicaSet" && strings.HasPrefix(e.InvolvedObject.Name, "aaas-edge-") && strings.Contains(e.Message, "exceeded quota") {
				return nil
			}
		}
		return fmt.Errorf("no FailedCreate for the edge's ReplicaSet yet")
	})
	t.Logf("control: with a full quota over the control plane, edge pod %s is not replaced (exceeded quota)", blocked)
	lift()
	waitEdgesReady(t, ctx, blocked, 3*time.Minute)
}

// fill lowers quota name's pod limit in ns to what ns uses now less below,
// once the quota controller's count agrees with the pods that count (not
// finished ones, such as helm test's: the count lags them), and waits
// until admission enforces the limit. A pod that ends meanwhile frees a
// place, so each try counts again.
func fill(t *testing.T, ctx context.Context, ns, name string, below int64) int64 {
	t.Helper()
	quotas := cluster.Client.CoreV1().ResourceQuotas(ns)
	var used int64
	testutil.Eventually(t, 2*time.Minute, func() error {
		q, err := quotas.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		u, ok := q.Status.Used[corev1.ResourcePods]
		if !ok {
			return fmt.Errorf("quota %s/%s not counted yet", ns, name)
		}
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		var counted int64
		for _, p := range pods.Items {
			if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
				counted++
			}
		}
		if u.Value() != counted {
			return fmt.Errorf("quota %s/%s counts %d pods, %d count", ns, name, u.Value(), counted)
		}
		used = max(counted-below, 0)
		if h := q.Spec.Hard[corev1.ResourcePods]; h.Value() != used {
			if _, err := quotas.Patch(ctx, name, types.MergePatchType, fmt.Appendf(nil, `{"spec":{"hard":{"pods":"%d"}}}`, used), metav1.PatchOptions{}); err != nil {
				return err
			}
		}
		if h := q.Status.Hard[corev1.ResourcePods]; h.Value() != used {
			return fmt.Errorf("quota %s/%s enforces %s pods, not yet %d", ns, name, h.String(), used)
		}
		// In force is what admission enforces: the API server's quota
		// admission reads its own informer's copy, which may lag the read
		// above by a moment. A pod asked for without being made (a dry
		// run) says when it has caught up.
		_, err = cluster.Client.CoreV1().Pods(ns).Create(ctx, restrictedPod("probe-"+randomHex(3)), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if apierrors.IsForbidden(err) && strings.Contains(err.Error(), "exceeded quota") {
			return nil
		}
		return fmt.Errorf("quota %s/%s at %d pods, yet admission let a pod in: %v", ns, name, used, err)
	})
	return used
}

// deleteEdgePod deletes one ready edge pod (not one already terminating,
// whose replacement exists) and returns its name.
func deleteEdgePod(t *testing.T, ctx context.Context) string {
	t.Helper()
	pods, err := cluster.Client.CoreV1().Pods(controlNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=aaas-edge"})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && podReady(&p) {
			if err := cluster.Client.CoreV1().Pods(controlNS).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			return p.Name
		}
	}
	t.Fatalf("no ready edge pod among %d", len(pods.Items))
	return ""
}

// waitEdgesReady waits until three edge pods other than gone are ready.
func waitEdgesReady(t *testing.T, ctx context.Context, gone string, timeout time.Duration) {
	t.Helper()
	testutil.Eventually(t, timeout, func() error {
		pods, err := cluster.Client.CoreV1().Pods(controlNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=aaas-edge"})
		if err != nil {
			return err
		}
		ready := 0
		for _, p := range pods.Items {
			if p.Name != gone && p.DeletionTimestamp == nil && podReady(&p) {
				ready++
			}
		}
		if ready < 3 {
			return fmt.Errorf("%d of 3 edges ready after %s was deleted", ready, gone)
		}
		return nil
	})
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// restrictedPod is a pod that passes Pod Security restricted, running pause.
func restrictedPod(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": "stranger"}},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr(false),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: ptr(true), RunAsUser: ptr(int64(65532)), RunAsGroup: ptr(int64(65532)),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			// pause keeps the pod running; its image is on every node.
			Containers: []corev1.Container{{
				Name: "idle", Image: image.PauseRef, ImagePullPolicy: corev1.PullNever,
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: ptr(false), Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
			}},
		},
	}
}

// TestSandboxesGetNoServiceVariablesAndCappedScratch reads a sandbox's
// process environment on the node. A Service with a cluster IP is added to
// the tenants' namespace first (agent-sandbox's own per-sandbox Services
// are headless, which Kubernetes never advertises) and a spare sandbox is
// restarted after it: the template's own variables are in its process's
// environment, and Kubernetes's API server variables (every pod gets
// them), but not the Service's; a pod of the same namespace without
// enableServiceLinks: false, started as late, does see it (control). The
// sandbox's container is limited in ephemeral storage, as the kubelet
// reports it.
func TestSandboxesGetNoServiceVariablesAndCappedScratch(t *testing.T) {
	ctx := testenv.Context(t, 4*time.Minute)
	core := cluster.Client.CoreV1()
	decoy := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "tenant-decoy"},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 80}}},
	}
	if _, err := core.Services(sandboxNS).Create(ctx, decoy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = core.Services(sandboxNS).Delete(context.Background(), decoy.Name, metav1.DeleteOptions{}) })
	const variable = "TENANT_DECOY_SERVICE_HOST"

	// A spare (no claim owns it), restarted: its new pod starts after the
	// Service exists.
	var spare corev1.Pod
	testutil.Eventually(t, 2*time.Minute, func() error {
		pods, err := core.Pods(sandboxNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=dsh-web", FieldSelector: "status.phase=Running"})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if podReady(&p) && owner(t, &p) == "" {
				spare = p
				return nil
			}
		}
		return fmt.Errorf("no ready spare among %d sandboxes", len(pods.Items))
	})
	if err := core.Pods(sandboxNS).Delete(ctx, spare.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil {
		t.Fatal(err)
	}
	var sandbox *corev1.Pod
	testutil.Eventually(t, 2*time.Minute, func() error {
		p, err := core.Pods(sandboxNS).Get(ctx, spare.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.UID == spare.UID || !podReady(p) {
			return fmt.Errorf("spare %s not restarted and ready yet", spare.Name)
		}
		sandbox = p
		return nil
	})
	serviceVars := func(env []string) []string {
		var out []string
		for _, kv := range env {
			name, _, _ := strings.Cut(kv, "=")
			if strings.HasSuffix(name, "_SERVICE_HOST") && name != "KUBERNETES_SERVICE_HOST" {
				out = append(out, name)
			}
		}
		return out
	}
	env := containerEnv(t, ctx, sandbox, "dsh")
	for _, want := range []string{"HOME=/workspace", "DSH_HOME=/home/node/.dsh", "KUBERNETES_SERVICE_HOST="} {
		if !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, want) }) {
			t.Fatalf("the sandbox's environment lacks %s: not the DSH process's? %v", want, env)
		}
	}
	if vars := serviceVars(env); len(vars) > 0 {
		t.Errorf("sandbox %s gets Service variables: %v", sandbox.Name, vars)
	}
	control, err := core.Pods(sandboxNS).Create(ctx, restrictedPod("links-"+randomHex(3)), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = core.Pods(sandboxNS).Delete(context.Background(), control.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
	})
	testutil.Eventually(t, time.Minute, func() error {
		p, err := core.Pods(sandboxNS).Get(ctx, control.Name, metav1.GetOptions{})
		if err != nil || p.Status.Phase != corev1.PodRunning {
			return fmt.Errorf("control pod: %v", err)
		}
		control = p
		return nil
	})
	if vars := serviceVars(containerEnv(t, ctx, control, "idle")); !slices.Contains(vars, variable) {
		t.Fatalf("control: a pod with Service links lacks %s (has %v): the check cannot see Service variables", variable, vars)
	}
	t.Logf("control: a pod with Service links gets %s; the sandbox, restarted after the Service, none", variable)

	var limit resource.Quantity
	for _, c := range sandbox.Spec.Containers {
		if c.Name == "dsh" {
			limit = c.Resources.Limits[corev1.ResourceEphemeralStorage]
		}
	}
	if limit.IsZero() || limit.Cmp(resource.MustParse("2Gi")) > 0 {
		t.Fatalf("sandbox scratch space limit %q, want at most 2Gi", limit.String())
	}
	for _, cs := range sandbox.Status.ContainerStatuses {
		if cs.Name == "dsh" && cs.Resources != nil {
			if got := cs.Resources.Limits[corev1.ResourceEphemeralStorage]; got.Cmp(limit) != 0 {
				t.Fatalf("the kubelet runs the sandbox with ephemeral-storage limit %q, the spec says %q", got.String(), limit.String())
			}
		}
	}
	t.Logf("sandbox %s: scratch space limited to %s", sandbox.Name, limit.String())
}

// containerEnv is the environment of container name's process in pod, read
// from the node (the real node runs on this machine).
func containerEnv(t *testing.T, ctx context.Context, pod *corev1.Pod, name string) []string {
	t.Helper()
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == name {
			env, err := cluster.Real.ContainerEnv(ctx, cs.ContainerID)
			if err != nil {
				t.Fatal(err)
			}
			return env
		}
	}
	t.Fatalf("pod %s has no container %s", pod.Name, name)
	return nil
}
