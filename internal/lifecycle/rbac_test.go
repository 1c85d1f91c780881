package lifecycle_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	extclient "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/lifecycle"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// TestLifecycleRoleIsMinimal removes each verb of the manifests' Role in
// turn and shows that some flow breaks without it. Together with the flow
// tests, which pass under the full Role, this makes the Role exactly what
// lifecycle needs.
func TestLifecycleRoleIsMinimal(t *testing.T) {
	f := setup(t, nil)
	full := f.NS.Role.DeepCopy()
	// next-wake reads templates as sandboxes wake (the last probes).
	f.Env["ROLLOUT"] = "next-wake"
	lc := f.lifecycle("lc-full")
	f.signup("mo")
	// The control for the informer probes: the same probe, under the full
	// Role, becomes ready, and how long it took bounds how long the others
	// are watched.
	start := time.Now()
	control := f.probe(t)
	control.WaitReady(t, time.Minute)
	f.readyIn = time.Since(start)
	if v := metric(control, "aaas_lifecycle_kubernetes_watch_refusals_total"); v != 0 {
		t.Fatalf("the probe was refused %v lists or watches under the full Role", v)
	}
	control.Stop()

	n := 0
	probes := map[string]func(t *testing.T, verb string){
		// Informers: without list or watch a fresh worker never reports ready.
		"sandboxclaims/list": f.notReady, "sandboxclaims/watch": f.notReady,
		"sandboxes/list": f.notReady, "sandboxes/watch": f.notReady,
		"pods/list": f.notReady, "pods/watch": f.notReady,
		"sandboxclaims/create": func(t *testing.T, _ string) {
			n++
			if res := f.command(events.NewClaim(fmt.Sprintf("new%d", n), fmt.Sprintf("req-new-%d", n), tokenHash(), "")); res.Outcome != state.OutcomeFailed {
				t.Fatalf("signup without create: %+v", res)
			}
		},
		"sandboxclaims/get": func(t *testing.T, _ string) {
			if res := f.command(events.NewDelete("mo", "req-del-get")); res.Outcome != state.OutcomeFailed {
				t.Fatalf("delete without get: %+v", res)
			}
		},
		"sandboxclaims/delete": func(t *testing.T, _ string) {
			if res := f.command(events.NewDelete("mo", "req-del-delete")); res.Outcome != state.OutcomeFailed {
				t.Fatalf("delete without delete: %+v", res)
			}
		},
		// A pod that goes while its sandbox runs is a restart or a suspend
		// the sandbox informer has not brought yet: the mirror asks the API
		// server which. Refused, it counts the refusal and goes by its
		// caches, so the sandbox still wakes on its new pod.
		"sandboxes/get": func(t *testing.T, _ string) {
			old := f.Box("mo")
			refused := metric(lc, `aaas_lifecycle_kubernetes_errors_total{op="get sandbox"}`)
			if err := pkg.Cluster.Client.CoreV1().Pods(f.NS.Name).Delete(ctx(t), old.PodName, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			testutil.Eventually(t, 30*time.Second, func() error {
				if v := metric(lc, `aaas_lifecycle_kubernetes_errors_total{op="get sandbox"}`); v <= refused {
					return errors.New("no refused sandbox read counted")
				}
				return nil
			})
			testutil.Eventually(t, time.Minute, func() error {
				if b := f.Box("mo"); b.Phase != state.PhaseReady || b.PodUID == "" || b.PodUID == old.PodUID {
					return fmt.Errorf("mo's sandbox after its pod was deleted: %s, pod %s", b.Phase, b.PodUID)
				}
				return nil
			})
		},
		"sandboxes/patch": func(t *testing.T, _ string) {
			box, _ := f.boxes.Get("mo")
			f.command(events.NewSuspend("mo", f.lastActivitySeq("mo"), box.Revision, time.Now(), "idle", ""))
			testutil.Eventually(t, 30*time.Second, func() error {
				for _, e := range f.auditEvents(events.AuditCommandFailed) {
					if e.User == "mo" && strings.Contains(e.Detail, "suspend command") {
						return nil
					}
				}
				return errors.New("no failure recorded")
			})
			if b, _ := f.boxes.Get("mo"); b.Value.Phase != state.PhaseReady {
				t.Fatalf("phase %s after a refused suspend", b.Value.Phase)
			}
		},
		// Recovering a pod that ended for good: without delete the mirror
		// is refused, says so, and retries.
		"pods/delete": func(t *testing.T, _ string) {
			f.signup("po")
			pod := f.Box("po").PodName
			refused := metric(lc, `aaas_lifecycle_kubernetes_errors_total{op="delete pod"}`)
			f.EndPod("po", "Evicted", "The node was low on resource: memory.")
			testutil.Eventually(t, 30*time.Second, func() error {
				if v := metric(lc, `aaas_lifecycle_kubernetes_errors_total{op="delete pod"}`); v <= refused {
					return errors.New("no refused pod deletion counted")
				}
				return nil
			})
			if _, err := pkg.Cluster.Client.CoreV1().Pods(f.NS.Name).Get(ctx(t), pod, metav1.GetOptions{}); err != nil {
				t.Fatalf("the ended pod was deleted without the verb: %v", err)
			}
		},
		// Adopting the seed gateway's claims (lifecycle adopt) patches them.
		"sandboxclaims/patch": func(t *testing.T, _ string) {
			f.adoptRefused(t)
		},
		// ROLLOUT=next-wake reads the waking sandbox's pool and template:
		// refused, the wake fails and the sandbox sleeps on. (The last
		// rules: mo is left asleep.)
		"sandboxwarmpools/get": f.rolloutRefused(lc), "sandboxtemplates/get": f.rolloutRefused(lc),
		"pods/log/get": func(t *testing.T, _ string) {
			_, failure := f.handshake("mo", "localhost", f.handshakeRev("mo"))
			if !strings.Contains(failure, "forbidden") {
				t.Fatalf("handshake without pods/log: %q", failure)
			}
		},
	}

	for i, rule := range full.Rules {
		for _, verb := range rule.Verbs {
			name := rule.Resources[0] + "/" + verb
			probe, ok := probes[name]
			if !ok {
				t.Fatalf("the Role grants %s but no test shows it is needed", name)
			}
			delete(probes, name)
			t.Run(strings.ReplaceAll(name, "/", "_"), func(t *testing.T) {
				reduced := full.DeepCopy()
				if reduced.Rules[i].Verbs = without(rule.Verbs, verb); len(reduced.Rules[i].Verbs) == 0 {
					reduced.Rules = append(reduced.Rules[:i], reduced.Rules[i+1:]...)
				}
				f.setRole(t, reduced, rule, verb, false)
				defer f.setRole(t, full, rule, verb, true)
				probe(t, verb)
			})
		}
	}
	for name := range probes {
		t.Errorf("probe %s has no verb in the Role", name)
	}
}

// rolloutRefused is the probe of a verb a rollout needs: mo, put to
// sleep, is woken, and the wake's read of the template is refused.
func (f *fixture) rolloutRefused(lc *testenv.Proc) func(t *testing.T, verb string) {
	return func(t *testing.T, _ string) {
		if box, _ := f.boxes.Get("mo"); box.Value.Phase != state.PhaseSuspended {
			f.command(events.NewAdminSuspend("mo", box.Revision, "test"))
			f.waitPhase("mo", state.PhaseSuspended)
		}
		refused := metric(lc, `aaas_lifecycle_kubernetes_errors_total{op="get template"}`)
		asleep, _ := f.boxes.Get("mo")
		// One wake per probe: the record, and so the derived id, is the
		// same for both.
		wake := events.NewWake("mo", asleep.Revision)
		wake.ID += "." + t.Name()
		f.command(wake)
		testutil.Eventually(t, 30*time.Second, func() error {
			if v := metric(lc, `aaas_lifecycle_kubernetes_errors_total{op="get template"}`); v <= refused {
				return errors.New("no refused template read counted")
			}
			return nil
		})
		if b := f.Box("mo"); b.Phase != state.PhaseSuspended {
			t.Fatalf("mo is %s after a wake whose rollout was refused", b.Phase)
		}
	}
}

func without(verbs []string, v string) []string {
	var out []string
	for _, x := range verbs {
		if x != v {
			out = append(out, x)
		}
	}
	return out
}

// setRole writes the Role and waits until the API server's authorizer
// agrees that verb on rule's resource is allowed (or not).
func (f *fixture) setRole(t *testing.T, role *rbacv1.Role, rule rbacv1.PolicyRule, verb string, allowed bool) {
	t.Helper()
	c := pkg.Cluster.Client
	cur, err := c.RbacV1().Roles(f.NS.Name).Get(ctx(t), role.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Rules = role.Rules
	if _, err := c.RbacV1().Roles(f.NS.Name).Update(ctx(t), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	res, sub, _ := strings.Cut(rule.Resources[0], "/")
	testutil.Eventually(t, 10*time.Second, func() error {
		r, err := c.AuthorizationV1().SubjectAccessReviews().Create(ctx(t), &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:               "system:serviceaccount:" + f.NS.Name + ":aaas-lifecycle",
			ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: f.NS.Name, Verb: verb, Group: rule.APIGroups[0], Resource: res, Subresource: sub},
		}}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		if r.Status.Allowed != allowed {
			return fmt.Errorf("%s %s allowed=%v", verb, rule.Resources[0], r.Status.Allowed)
		}
		return nil
	})
}

// probe starts a fresh lifecycle worker with the environment of every
// other (its own NATS identity, the namespace's kubeconfig, the stack's
// settings) without waiting for it.
func (f *fixture) probe(t *testing.T) *testenv.Proc {
	env := map[string]string{
		"NATS_URL": f.NATSURLs(), "NATS_NKEY": f.IDs.SeedFile(natsauth.Lifecycle), "HANDSHAKE_KEYS": f.Key,
		"KUBECONFIG": f.NS.Kubeconfig, "SANDBOX_NAMESPACE": f.NS.Name, "INSTANCE_ID": "lc-probe",
	}
	for k, v := range f.Env {
		env[k] = v
	}
	return pkg.Start(t, "lifecycle", env)
}

// notReady starts a probe and expects it to be refused a list or watch,
// and to stay alive and unready for three times as long as the control
// took to become ready under the full Role.
func (f *fixture) notReady(t *testing.T, verb string) {
	p := f.probe(t)
	defer p.Stop()
	testutil.Eventually(t, time.Minute, func() error {
		if p.Exited() {
			t.Fatalf("the probe exited without %s:\n%s", verb, p.Logs())
		}
		if metric(p, "aaas_lifecycle_kubernetes_watch_refusals_total") == 0 {
			return errors.New("no list or watch refused yet")
		}
		return nil
	})
	for deadline := time.Now().Add(3 * f.readyIn); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		switch {
		case p.Exited():
			t.Fatalf("the probe exited without %s:\n%s", verb, p.Logs())
		case p.IsReady():
			t.Fatalf("lifecycle became ready without %s", verb)
		}
	}
}

// adoptRefused creates a claim as the seed gateway did and expects
// `lifecycle adopt --apply`, run as the lifecycle ServiceAccount, to be
// refused and to say why, leaving the claim as it was.
func (f *fixture) adoptRefused(t *testing.T) {
	_, admin, err := pkg.Cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	seed := &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{Name: sandbox.ClaimName("seedling"), Annotations: map[string]string{
			"aaas.example.com/managed-by": "dsh-gateway", sandbox.TokenHashAnnotation: tokenHash(),
		}},
		Spec: extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}},
	}
	if _, err := admin.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Create(ctx(t), seed, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", f.NS.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	asLifecycle, err := extclient.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	_, err = lifecycle.Adopt(ctx(t), asLifecycle.ExtensionsV1beta1().SandboxClaims(f.NS.Name), lifecycle.AdoptOptions{
		ManagedKey: "aaas.example.com/managed-by", ManagedValue: "dsh-gateway",
		Owner: lifecycle.SeedOwner, TokenAnnotation: sandbox.TokenHashAnnotation, Apply: true,
	}, &out)
	if err == nil || !strings.Contains(out.String(), "failed: forbidden: the lifecycle Role needs patch on sandboxclaims") {
		t.Fatalf("adopt without patch: err %v\n%s", err, out.String())
	}
	got, err := admin.ExtensionsV1beta1().SandboxClaims(f.NS.Name).Get(ctx(t), seed.Name, metav1.GetOptions{})
	if err != nil || len(got.Labels) != 0 {
		t.Fatalf("claim after a refused adoption: %v, labels %v", err, got.Labels)
	}
}

func (f *fixture) handshakeRev(user string) uint64 {
	box, _ := f.boxes.Get(user)
	e, err := f.handshakes.Get(ctx(f.t), state.HandshakeKey(user, box.Value.PodUID, "localhost"))
	if err != nil {
		return 0
	}
	return e.Revision
}
