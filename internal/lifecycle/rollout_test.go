package lifecycle_test

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	sandboxclient "sigs.k8s.io/agent-sandbox/clients/k8s/clientset/versioned"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// TestARolloutWaitsForTheWake: with ROLLOUT=next-wake, a sandbox woken
// while its template is unchanged is not rolled (so the gateway's
// revision agrees with agent-sandbox's). Once the template changes (an
// env var, the marker of a new image), a sleeping sandbox wakes with the
// new pod template: its record says the new revision, its new pod has
// the marker, the old template is kept to roll back to, and the rollout
// is audited; aaas_sandboxes counts each revision. A sandbox running all the while keeps its pod and its
// template until it sleeps and wakes, when it is rolled too.
func TestARolloutWaitsForTheWake(t *testing.T) {
	st := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"ROLLOUT": "next-wake"}})
	f := setup(t, nil, st)
	lc := f.lifecycle("lc-a")
	// gauge waits for aaas_sandboxes to count want of each revision.
	gauge := func(want map[string]float64) {
		t.Helper()
		testutil.Eventually(t, 30*time.Second, func() error {
			for rev, n := range want {
				if got, err := lc.MetricSum("aaas_sandboxes", "revision", rev); err != nil || got != n {
					return fmt.Errorf("aaas_sandboxes{revision=%q} = %v (%v), want %v", rev, got, err, n)
				}
			}
			return nil
		})
	}
	f.signup("ann")
	f.signup("bob")
	first := f.waitPhase("ann", state.PhaseReady).Revision
	if len(first) != 8 || f.waitPhase("bob", state.PhaseReady).Revision != first {
		t.Fatalf("revisions of fresh sandboxes: ann %q, bob %q", first, f.waitPhase("bob", state.PhaseReady).Revision)
	}
	wake := func(user string) state.Sandbox {
		t.Helper()
		asleep, _ := f.boxes.Get(user)
		start := time.Now()
		f.command(events.NewWake(user, asleep.Revision))
		b := f.waitPhase(user, state.PhaseReady)
		t.Logf("%s woke Ready on revision %s in %s", user, b.Revision, time.Since(start).Round(time.Millisecond))
		return b
	}

	f.rolloutReport(first, map[string]int{first: 2}, nil)

	// Unchanged template: a wake rolls nothing.
	st.Suspend("ann")
	if got := wake("ann").Revision; got != first || len(f.auditEvents(events.AuditRollout)) != 0 {
		t.Fatalf("a wake with the template unchanged: revision %q (was %q), rollouts %v", got, first, f.auditEvents(events.AuditRollout))
	}

	// The template changes while both run; ann sleeps, bob does not.
	sbc := f.markTemplate("v2")
	bobPod := f.waitPhase("bob", state.PhaseReady).PodUID
	st.Suspend("ann")
	ann := wake("ann")
	marked := func(sb *sandboxv1beta1.Sandbox) bool {
		return slices.Contains(sb.Spec.PodTemplate.Spec.Containers[0].Env, corev1.EnvVar{Name: "DSH_MARKER", Value: "v2"})
	}
	sandboxOf := func(user string) *sandboxv1beta1.Sandbox {
		t.Helper()
		box, _ := f.boxes.Get(user)
		sb, err := sbc.AgentsV1beta1().Sandboxes(st.NS.Name).Get(ctx(t), box.Value.Sandbox, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return sb
	}
	sb := sandboxOf("ann")
	if ann.Revision == first || len(ann.Revision) != 8 {
		t.Fatalf("ann woke of revision %q, the old one %q; rollouts %+v; her sandbox's labels %v, env %v", ann.Revision, first, f.auditEvents(events.AuditRollout), sb.Spec.PodTemplate.ObjectMeta.Labels, sb.Spec.PodTemplate.Spec.Containers[0].Env)
	}
	if _, kept := sb.Annotations[sandbox.PreviousRevisionAnnotation]; !marked(sb) || !kept || sb.Annotations[sandbox.PreviousRevisionAnnotation] != first || sb.Annotations[sandbox.PreviousAnnotation] == "" || sandbox.Revision(sb) != ann.Revision {
		t.Fatalf("ann's rolled sandbox: env %v, annotations %v", sb.Spec.PodTemplate.Spec.Containers[0].Env, sb.Annotations)
	}
	pod, err := pkg.Cluster.Client.CoreV1().Pods(st.NS.Name).Get(ctx(t), ann.PodName, metav1.GetOptions{})
	if err != nil || !slices.Contains(pod.Spec.Containers[0].Env, corev1.EnvVar{Name: "DSH_MARKER", Value: "v2"}) {
		t.Fatalf("ann's new pod: %v %v", err, pod.Spec.Containers)
	}
	if rolled := f.auditEvents(events.AuditRollout); len(rolled) != 1 || rolled[0].User != "ann" {
		t.Fatalf("rollouts audited: %+v", rolled)
	}

	gauge(map[string]float64{first: 1, ann.Revision: 1})
	f.rolloutReport(ann.Revision, map[string]int{first: 1, ann.Revision: 1}, nil)

	// bob ran all the while: same pod, old template.
	if b := f.waitPhase("bob", state.PhaseReady); b.PodUID != bobPod || b.Revision != first || marked(sandboxOf("bob")) {
		t.Fatalf("bob, running, was touched: pod %s (was %s), revision %q", b.PodUID, bobPod, b.Revision)
	}
	st.Suspend("bob")
	if b := wake("bob"); b.Revision != ann.Revision || !marked(sandboxOf("bob")) {
		t.Fatalf("bob after his sleep: revision %q", b.Revision)
	}
	gauge(map[string]float64{first: 0, ann.Revision: 2})
	f.rolloutReport(ann.Revision, map[string]int{ann.Revision: 2}, nil)
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := len(f.auditEvents(events.AuditRollout)); n != 2 {
			return fmt.Errorf("%d rollouts audited", n)
		}
		return nil
	})
}

// TestARolloutReachesAGroupsMembers: with ROLLOUT_PERCENT=0 and
// ROLLOUT_GROUPS, a rollout reaches the sandboxes of the groups' members
// alone (their groups as an edge last saw them sign in, matched as the
// edges spell them): ann, in the group, wakes on the new revision; bob,
// in another group only, wakes in the same window on the old one.
func TestARolloutReachesAGroupsMembers(t *testing.T) {
	st := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"ROLLOUT": "next-wake", "ROLLOUT_PERCENT": "0", "ROLLOUT_GROUPS": " Early-Adopters "}})
	f := setup(t, nil, st)
	f.lifecycle("lc-a")
	groups := testutil.Open[state.UserGroups](t, st.JS, state.BucketUserGroups)
	for user, in := range map[string][]string{"ann": {"early-adopters", "staff"}, "bob": {"staff"}} {
		if _, err := groups.Put(ctx(t), user, state.UserGroups{User: user, Groups: in, Seen: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	f.signup("ann")
	f.signup("bob")
	first := f.waitPhase("ann", state.PhaseReady).Revision
	f.waitPhase("bob", state.PhaseReady)
	f.markTemplate("v2")
	for _, user := range []string{"ann", "bob"} {
		st.Suspend(user)
		asleep, _ := f.boxes.Get(user)
		f.command(events.NewWake(user, asleep.Revision))
	}
	ann, bob := f.waitPhase("ann", state.PhaseReady), f.waitPhase("bob", state.PhaseReady)
	if ann.Revision == first || bob.Revision != first {
		t.Fatalf("after the wakes: ann on %s, bob on %s (was %s); want ann alone rolled", ann.Revision, bob.Revision, first)
	}
}

// TestAFailingRevisionHaltsTheRollout: a sandbox rolled to a new
// revision that then fails within ROLLOUT_PROBATION (its pod ends, or its
// container keeps exiting, which the kubelet would go on restarting for
// ever) is rolled back: its old pod template is back, a new pod of the old
// revision starts on the same volume, and the revision is halted, so the
// next sleeping sandbox to wake is not rolled to it; both are audited and
// counted.
func TestAFailingRevisionHaltsTheRollout(t *testing.T) {
	for _, c := range []struct {
		name string
		// env is what the new revision adds to the container; fail, if
		// set, makes its pod fail once it is Ready.
		env  []corev1.EnvVar
		fail func(st *testenv.Stack)
	}{
		{name: "its pod ends", fail: func(st *testenv.Stack) { st.EndPod("ann", "Error", "the new image exits at once") }},
		// dshsim exits 1 ms after it starts: CrashLoopBackOff, never Ready.
		{name: "its container crash-loops", env: []corev1.EnvVar{{Name: "DSHSIM_CRASH_AFTER", Value: "1ms"}}},
	} {
		t.Run(c.name, func(t *testing.T) { haltsTheRollout(t, c.env, c.fail) })
	}
}

func haltsTheRollout(t *testing.T, env []corev1.EnvVar, fail func(*testenv.Stack)) {
	st := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"ROLLOUT": "next-wake"}})
	f := setup(t, nil, st)
	lc := f.lifecycle("lc-a")
	f.signup("ann")
	f.signup("bob")
	ready := f.waitPhase("ann", state.PhaseReady)
	first := ready.Revision
	sbc := f.markTemplate("broken", env...)
	st.Suspend("ann")
	asleep, _ := f.boxes.Get("ann")
	failed := time.Now()
	f.command(events.NewWake("ann", asleep.Revision))
	var rolled state.Sandbox
	if fail != nil {
		if rolled = f.waitPhase("ann", state.PhaseReady); rolled.Revision == first {
			t.Fatalf("ann was not rolled: revision %q", rolled.Revision)
		}
		failed = time.Now()
		fail(st)
	} else {
		// The new revision's pod never comes up: it is seen in the record
		// on its way, and the rollout's audit names it.
		testutil.Eventually(t, time.Minute, func() error {
			if got := f.auditEvents(events.AuditRollout); len(got) == 0 || got[0].Outcome != "rolled" {
				return fmt.Errorf("rollout audit: %+v", got)
			}
			return nil
		})
		sb, err := sbc.AgentsV1beta1().Sandboxes(st.NS.Name).Get(ctx(t), ready.Sandbox, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		rolled.Revision, rolled.PodUID = sandbox.Revision(sb), ready.PodUID
		if rolled.Revision == first && sb.Annotations[sandbox.HaltedAnnotation] == "" {
			t.Fatalf("ann was not rolled: revision %q", rolled.Revision)
		}
	}
	var back state.Sandbox
	testutil.Eventually(t, 2*time.Minute, func() error {
		e, _ := f.boxes.Get("ann")
		if back = e.Value; back.Phase != state.PhaseReady || back.Revision != first || back.PodUID == rolled.PodUID {
			return fmt.Errorf("ann is %s (%s) of revision %s on pod %s", back.Phase, back.Reason, back.Revision, back.PodUID)
		}
		return nil
	})
	t.Logf("rolled back and Ready on the old revision %s after the failure", time.Since(failed).Round(time.Millisecond))
	sb, err := sbc.AgentsV1beta1().Sandboxes(st.NS.Name).Get(ctx(t), back.Sandbox, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Annotations[sandbox.HaltedAnnotation] != rolled.Revision || slices.Contains(sb.Spec.PodTemplate.Spec.Containers[0].Env, corev1.EnvVar{Name: "DSH_MARKER", Value: "broken"}) {
		t.Fatalf("ann's sandbox after the rollback: annotations %v", sb.Annotations)
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if e, _ := f.boxes.Get("ann"); e.Value.Halted != rolled.Revision {
			return fmt.Errorf("ann's record says halted %q", e.Value.Halted)
		}
		return nil
	})
	if got := f.auditEvents(events.AuditRollout); len(got) != 2 || got[0].Outcome != "rolled" || got[1].Outcome != "rolled_back" {
		t.Fatalf("rollout audit: %+v", got)
	} else {
		t.Logf("audited: %s", got[1].Detail)
	}

	// Halted: bob sleeps and wakes on the old revision.
	st.Suspend("bob")
	asleep, _ = f.boxes.Get("bob")
	f.command(events.NewWake("bob", asleep.Revision))
	if b := f.waitPhase("bob", state.PhaseReady); b.Revision != first {
		t.Fatalf("bob was rolled to the halted revision: %q", b.Revision)
	}
	// The admin view's count: the template is at the halted revision, no
	// sandbox is on it, and one was rolled back from it.
	f.rolloutReport(rolled.Revision, map[string]int{first: 2}, map[string]int{rolled.Revision: 1})
	for outcome, want := range map[string]float64{"rolled": 1, "rolled_back": 1, "halted": 1} {
		if n, err := lc.MetricSum("aaas_lifecycle_rollouts_total", "outcome", outcome); err != nil || n != want {
			t.Errorf("rollouts %s: %v (%v), want %v", outcome, n, err, want)
		}
	}
}

// markTemplate adds DSH_MARKER=marker, and env, to the pool's
// SandboxTemplate's container, as a new image would change it, and
// returns a client of the Sandboxes.
func (f *fixture) markTemplate(marker string, env ...corev1.EnvVar) sandboxclient.Interface {
	f.t.Helper()
	sbc, ext, _ := pkg.Cluster.SandboxClients()
	pool, err := ext.ExtensionsV1beta1().SandboxWarmPools(f.NS.Name).Get(ctx(f.t), "dsh-pool", metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	templates := ext.ExtensionsV1beta1().SandboxTemplates(f.NS.Name)
	tmpl, err := templates.Get(ctx(f.t), pool.Spec.TemplateRef.Name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
	c.Env = append(append(c.Env, corev1.EnvVar{Name: "DSH_MARKER", Value: marker}), env...)
	if _, err := templates.Update(ctx(f.t), tmpl, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	return sbc
}

// rolloutReport waits for the one profile's rollout record (the admin
// view's) to say target is its template's revision, with its sandboxes
// by revision and those rolled back from each as want and halted.
func (f *fixture) rolloutReport(target string, want, halted map[string]int) {
	f.t.Helper()
	b := testutil.Open[state.Rollout](f.t, f.JS, state.BucketRollouts)
	testutil.Eventually(f.t, 30*time.Second, func() error {
		keys, err := b.Keys(ctx(f.t), ">")
		if err != nil || len(keys) != 1 {
			return fmt.Errorf("rollout records %v (%v), want one", keys, err)
		}
		e, err := b.Get(ctx(f.t), keys[0])
		if err != nil {
			return err
		}
		if r := e.Value; r.Profile != keys[0] || r.Target != target || !maps.Equal(r.Sandboxes, want) || !maps.Equal(r.Halted, halted) {
			return fmt.Errorf("rollout %+v, want target %s, sandboxes %v, halted %v", r, target, want, halted)
		}
		return nil
	})
}
