package lifecycle_test

import (
	"maps"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// twoProfiles is a stack with PROFILES small (the default, of the
// stack's pool dsh-pool) and large (a pool dsh-large like it), and env.
func twoProfiles(t *testing.T, env map[string]string) *fixture {
	t.Helper()
	all := map[string]string{
		"PROFILES": `[{"name":"small","warm_pool":"dsh-pool"},{"name":"large","description":"more of everything","warm_pool":"dsh-large"}]`,
	}
	maps.Copy(all, env)
	st := pkg.NewStack(t, testenv.StackOptions{Env: all})
	_, ext, _ := pkg.Cluster.SandboxClients()
	pools := ext.ExtensionsV1beta1().SandboxWarmPools(st.NS.Name)
	small, err := pools.Get(ctx(t), "dsh-pool", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	large := &extv1beta1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Name: "dsh-large", Namespace: st.NS.Name}, Spec: small.Spec}
	if _, err := pools.Create(ctx(t), large, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return setup(t, nil, st)
}

// claimOf is the live claim of key (a sandbox key).
func (f *fixture) claimOf(key string) extv1beta1.SandboxClaim {
	f.t.Helper()
	for _, c := range f.claims() {
		if c.Name == sandbox.ClaimName(key) && c.DeletionTimestamp == nil {
			return c
		}
	}
	f.t.Fatalf("no claim of %s", key)
	return extv1beta1.SandboxClaim{}
}

// expectProfile: key's claim is of profile, from pool, and its record
// comes to say so, Ready.
func (f *fixture) expectProfile(key, profile, pool string) {
	f.t.Helper()
	c := f.claimOf(key)
	if c.Spec.WarmPoolRef.Name != pool || c.Annotations[sandbox.ProfileAnnotation] != profile {
		f.t.Fatalf("%s's claim: pool %q, profile %q; want %q, %q", key, c.Spec.WarmPoolRef.Name, c.Annotations[sandbox.ProfileAnnotation], pool, profile)
	}
	// The record comes from the mirror: after a recreate it may say
	// the old sandbox's profile a moment longer.
	e, _, err := f.boxes.Wait(testenv.Context(f.t, 90*time.Second), key, func(e kv.Entry[state.Sandbox], ok bool) bool {
		return ok && e.Value.Phase == state.PhaseReady && e.Value.Claim == c.Name && e.Value.Profile == profile
	})
	if err != nil {
		f.t.Fatalf("%s's record never Ready of profile %q: %+v", key, profile, e.Value)
	}
}

// TestAProfileIsTheWarmPoolAClaimDrawsFrom: with two profiles, each of
// its own warm pool, a claim is made from the pool of the profile its
// command names (the default's when it names none), the sandbox's record
// says which, a recreate keeps the profile unless it names another, and a
// profile this worker's PROFILES does not list is answered failed with
// nothing made.
func TestAProfileIsTheWarmPoolAClaimDrawsFrom(t *testing.T) {
	f := twoProfiles(t, nil)
	f.lifecycle("lc-a")

	claimOf, expect := f.claimOf, f.expectProfile
	ann := tokenHash()
	if res := f.command(events.NewClaim("ann", "req-ann", ann, "large")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("claim of large: %+v", res)
	}
	expect("ann", "large", "dsh-large")
	f.signup("bob")
	expect("bob", "small", "dsh-pool")

	if res := f.command(events.NewRecreate("ann", "req-ann-re", "")); res.Outcome != state.OutcomeRecreated {
		t.Fatalf("recreate: %+v", res)
	}
	expect("ann", "large", "dsh-large")
	if res := f.command(events.NewRecreate("ann", "req-ann-small", "small")); res.Outcome != state.OutcomeRecreated {
		t.Fatalf("recreate into small: %+v", res)
	}
	expect("ann", "small", "dsh-pool")

	// A profile an edge knows and this worker does not (PROFILES rolling
	// out): failed, nothing made; and a recreate into one changes nothing.
	res := f.command(events.NewClaim("cat", "req-cat", tokenHash(), "huge"))
	if res.Outcome != state.OutcomeFailed || !strings.Contains(res.Error, `no profile "huge"`) {
		t.Fatalf("claim of an unknown profile: %+v", res)
	}
	res = f.command(events.NewRecreate("bob", "req-bob-huge", "huge"))
	if res.Outcome != state.OutcomeFailed {
		t.Fatalf("recreate into an unknown profile: %+v", res)
	}
	for _, c := range f.claims() {
		if c.Name == sandbox.ClaimName("cat") {
			t.Fatalf("a claim was made for an unknown profile: %+v", c.Spec)
		}
	}
	if c := claimOf("bob"); c.Annotations[sandbox.ProfileAnnotation] != "small" {
		t.Fatalf("bob's claim after a refused recreate: %+v", c.Annotations)
	}
	if _, err := f.users.Get(ctx(t), "cat"); err == nil {
		t.Fatal("an account was made for an unknown profile")
	}
	if u, err := f.users.Get(ctx(t), "bob"); err != nil || !u.Value.RecreatingSince.IsZero() {
		t.Fatalf("bob's account after a refused recreate: %+v %v", u.Value, err)
	}
}
