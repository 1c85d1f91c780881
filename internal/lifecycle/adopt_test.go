package lifecycle_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stesting "k8s.io/client-go/testing"
	extfake "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned/fake"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/lifecycle"
	"github.com/aaas-project/aaas/internal/sandbox"
)

const seedHash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

func adoptOptions() lifecycle.AdoptOptions {
	return lifecycle.AdoptOptions{
		Namespace:  "ns",
		ManagedKey: "aaas.example.com/managed-by", ManagedValue: "dsh-gateway",
		Owner: lifecycle.SeedOwner, TokenAnnotation: sandbox.TokenHashAnnotation,
	}
}

// seedClaim is a claim as the seed created it: the marker and the token
// hash as annotations, no labels.
func seedClaim(name string) extv1beta1.SandboxClaim {
	return extv1beta1.SandboxClaim{ObjectMeta: metav1.ObjectMeta{
		Name: name, Namespace: "ns", ResourceVersion: "41",
		Annotations: map[string]string{"aaas.example.com/managed-by": "dsh-gateway", sandbox.TokenHashAnnotation: seedHash},
	}}
}

func TestPlanAdoption(t *testing.T) {
	now := metav1.NewTime(time.Now())
	cases := []struct {
		name   string
		claim  func(c *extv1beta1.SandboxClaim)
		opts   func(o *lifecycle.AdoptOptions)
		action lifecycle.AdoptAction
		reason string
	}{
		{name: "seed claim", action: lifecycle.ActionAdopt},
		// With the defaults, the marker as a label is our label: managed.
		{name: "default marker as a label", action: lifecycle.ActionManaged, claim: func(c *extv1beta1.SandboxClaim) {
			delete(c.Annotations, "aaas.example.com/managed-by")
			c.Labels = map[string]string{"aaas.example.com/managed-by": "dsh-gateway"}
		}},
		{name: "marker as a label", action: lifecycle.ActionAdopt, claim: func(c *extv1beta1.SandboxClaim) {
			delete(c.Annotations, "aaas.example.com/managed-by")
			c.Labels = map[string]string{"seed.example/owner": "py"}
		}, opts: func(o *lifecycle.AdoptOptions) { o.Owner = "seed.example/owner=py" }},
		{name: "ours already", action: lifecycle.ActionManaged, claim: func(c *extv1beta1.SandboxClaim) {
			c.Labels = map[string]string{"aaas.example.com/managed-by": "dsh-gateway", sandbox.UserLabel: "alice"}
		}, opts: func(o *lifecycle.AdoptOptions) { o.Owner = "seed.example/owner=py" }},
		{name: "another gateway's label", action: lifecycle.ActionSkipped, reason: "another gateway's claim", claim: func(c *extv1beta1.SandboxClaim) {
			c.Labels = map[string]string{"aaas.example.com/managed-by": "other"}
		}},
		{name: "seed marker on our key with another value", action: lifecycle.ActionAdopt, claim: func(c *extv1beta1.SandboxClaim) {
			c.Labels = map[string]string{"aaas.example.com/managed-by": "dsh-gateway"}
		}, opts: func(o *lifecycle.AdoptOptions) { o.ManagedValue = "aaas" }},
		{name: "no marker", action: lifecycle.ActionSkipped, reason: "not the seed's; name the user with --user", claim: func(c *extv1beta1.SandboxClaim) {
			delete(c.Annotations, "aaas.example.com/managed-by")
		}},
		{name: "no marker, named with --user", action: lifecycle.ActionAdopt, claim: func(c *extv1beta1.SandboxClaim) {
			delete(c.Annotations, "aaas.example.com/managed-by")
		}, opts: func(o *lifecycle.AdoptOptions) { o.Users = []string{"alice"} }},
		{name: "marker with another value", action: lifecycle.ActionSkipped, reason: "not the seed's", claim: func(c *extv1beta1.SandboxClaim) {
			c.Annotations["aaas.example.com/managed-by"] = "someone-else"
		}},
		{name: "no token hash", action: lifecycle.ActionSkipped, reason: "no token hash in annotation aaas.example.com/token-sha256: the user could never sign in", claim: func(c *extv1beta1.SandboxClaim) {
			delete(c.Annotations, sandbox.TokenHashAnnotation)
		}},
		{name: "no token hash, named with --user", action: lifecycle.ActionSkipped, reason: "no token hash", claim: func(c *extv1beta1.SandboxClaim) {
			c.Annotations = nil
		}, opts: func(o *lifecycle.AdoptOptions) { o.Users = []string{"alice"} }},
		{name: "uppercase hash", action: lifecycle.ActionSkipped, reason: "not a SHA-256 in lowercase hex", claim: func(c *extv1beta1.SandboxClaim) {
			c.Annotations[sandbox.TokenHashAnnotation] = strings.ToUpper(seedHash)
		}},
		{name: "short hash", action: lifecycle.ActionSkipped, reason: "not a SHA-256", claim: func(c *extv1beta1.SandboxClaim) {
			c.Annotations[sandbox.TokenHashAnnotation] = seedHash[:63]
		}},
		{name: "hash under the seed's own key", action: lifecycle.ActionAdopt, claim: func(c *extv1beta1.SandboxClaim) {
			delete(c.Annotations, sandbox.TokenHashAnnotation)
			c.Annotations["seed.example/token-sha256"] = seedHash
		}, opts: func(o *lifecycle.AdoptOptions) { o.TokenAnnotation = "seed.example/token-sha256" }},
		{name: "two different hashes", action: lifecycle.ActionSkipped, reason: "hold different token hashes", claim: func(c *extv1beta1.SandboxClaim) {
			c.Annotations["seed.example/token-sha256"] = strings.Repeat("0", 64)
		}, opts: func(o *lifecycle.AdoptOptions) { o.TokenAnnotation = "seed.example/token-sha256" }},
		{name: "user label of another user", action: lifecycle.ActionSkipped, reason: "names another user", claim: func(c *extv1beta1.SandboxClaim) {
			c.Labels = map[string]string{sandbox.UserLabel: "mallory"}
		}},
		{name: "being deleted", action: lifecycle.ActionSkipped, reason: "being deleted", claim: func(c *extv1beta1.SandboxClaim) {
			c.DeletionTimestamp = &now
		}},
		{name: "not dsh-", action: lifecycle.ActionSkipped, reason: "not a user's claim", claim: func(c *extv1beta1.SandboxClaim) { c.Name = "notebook" }},
		{name: "invalid user name", action: lifecycle.ActionSkipped, reason: "not a user's claim", claim: func(c *extv1beta1.SandboxClaim) { c.Name = "dsh-Alice" }},
		{name: "reserved user name", action: lifecycle.ActionSkipped, reason: "not a user's claim", claim: func(c *extv1beta1.SandboxClaim) { c.Name = "dsh-admin" }},
		{name: "bare prefix", action: lifecycle.ActionSkipped, reason: "not a user's claim", claim: func(c *extv1beta1.SandboxClaim) { c.Name = "dsh-" }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := seedClaim("dsh-alice")
			if tc.claim != nil {
				tc.claim(&c)
			}
			o := adoptOptions()
			if tc.opts != nil {
				tc.opts(&o)
			}
			plan := lifecycle.PlanAdoption([]extv1beta1.SandboxClaim{c}, o)
			if len(plan) != 1 {
				t.Fatalf("plan %+v, want one line", plan)
			}
			d := plan[0]
			if d.Claim != c.Name || d.Action != tc.action || !strings.Contains(d.Reason, tc.reason) {
				t.Fatalf("got %s %q %s: %q; want %s: %q", d.Claim, d.User, d.Action, d.Reason, tc.action, tc.reason)
			}
			if (tc.reason == "") != (d.Reason == "") {
				t.Fatalf("reason %q, want one only when skipped", d.Reason)
			}
			if strings.Contains(d.Reason, seedHash) || strings.Contains(d.Reason, seedHash[:16]) {
				t.Fatalf("reason shows the hash: %q", d.Reason)
			}
		})
	}
}

func TestPlanAdoptionReportsUsersWithoutClaims(t *testing.T) {
	o := adoptOptions()
	o.Users = []string{"alice", "bob", "bob"}
	plan := lifecycle.PlanAdoption([]extv1beta1.SandboxClaim{seedClaim("dsh-alice")}, o)
	if len(plan) != 2 || plan[0].Action != lifecycle.ActionAdopt || plan[1].Claim != "dsh-bob" || plan[1].Action != lifecycle.ActionSkipped || !strings.Contains(plan[1].Reason, "no such claim") {
		t.Fatalf("plan %+v", plan)
	}
}

func TestAdoptOptionsValidate(t *testing.T) {
	cases := map[string]struct {
		mutate func(o *lifecycle.AdoptOptions)
		want   string
	}{
		"defaults":                 {func(*lifecycle.AdoptOptions) {}, ""},
		"users":                    {func(o *lifecycle.AdoptOptions) { o.Users = []string{"alice", "bob-2"} }, ""},
		"owner without value":      {func(o *lifecycle.AdoptOptions) { o.Owner = "aaas.example.com/managed-by" }, "--owner-annotation"},
		"owner with empty value":   {func(o *lifecycle.AdoptOptions) { o.Owner = "aaas.example.com/managed-by=" }, "want key=value"},
		"owner with a bad key":     {func(o *lifecycle.AdoptOptions) { o.Owner = "not a key=x" }, "--owner-annotation"},
		"bad token annotation":     {func(o *lifecycle.AdoptOptions) { o.TokenAnnotation = "/nope" }, "--token-annotation"},
		"empty token annotation":   {func(o *lifecycle.AdoptOptions) { o.TokenAnnotation = "" }, "--token-annotation"},
		"invalid user":             {func(o *lifecycle.AdoptOptions) { o.Users = []string{"Alice"} }, `--user "Alice": user names are`},
		"claim name given as user": {func(o *lifecycle.AdoptOptions) { o.Users = []string{"dsh-alice"} }, `give the user, "alice"`},
		"no managed label":         {func(o *lifecycle.AdoptOptions) { o.ManagedValue = "" }, "MANAGED_BY_LABEL"},
	}
	for name, tc := range cases {
		o := adoptOptions()
		tc.mutate(&o)
		err := o.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: err %v, want %q", name, err, tc.want)
		}
	}
}

// TestAdoptPatchesOnlyCandidates runs Adopt against a fake API: a dry run
// sends nothing but lists; --apply sends exactly one merge patch per
// candidate, carrying the resourceVersion it decided on; a conflict is
// reported, fails the run, and does not stop the other claims.
func TestAdoptPatchesOnlyCandidates(t *testing.T) {
	alice, carol, dave := seedClaim("dsh-alice"), seedClaim("dsh-carol"), seedClaim("dsh-dave")
	delete(carol.Annotations, sandbox.TokenHashAnnotation)
	dave.ResourceVersion = "7"
	managed := seedClaim("dsh-bob")
	managed.Labels = map[string]string{"aaas.example.com/managed-by": "dsh-gateway"}
	other := seedClaim("notebook")
	fake := extfake.NewSimpleClientset(&alice, &carol, &dave, &managed, &other)
	var patches []k8stesting.PatchAction
	fake.PrependReactor("patch", "sandboxclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
		p := a.(k8stesting.PatchAction)
		patches = append(patches, p)
		if p.GetName() == "dsh-dave" {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Group: "extensions.agents.x-k8s.io", Resource: "sandboxclaims"}, "dsh-dave", nil)
		}
		return false, nil, nil
	})
	claims := fake.ExtensionsV1beta1().SandboxClaims("ns")

	var out bytes.Buffer
	sum, err := lifecycle.Adopt(t.Context(), claims, adoptOptions(), &out)
	if err != nil || len(patches) != 0 || sum[lifecycle.ActionAdopt] != 2 || sum[lifecycle.ActionSkipped] != 2 || sum[lifecycle.ActionManaged] != 1 {
		t.Fatalf("dry run: %v, %d patches, %v\n%s", err, len(patches), sum, out.String())
	}
	for _, want := range []string{"in namespace ns (dry run: nothing is changed)", "dsh-alice  alice  adopt\n", "dsh-bob    bob    already managed\n", "dsh-carol  carol  skipped: no token hash", "notebook   -      skipped: not a user's claim", "run again with --apply"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("dry run output lacks %q:\n%s", want, out.String())
		}
	}

	out.Reset()
	o := adoptOptions()
	o.Apply = true
	sum, err = lifecycle.Adopt(t.Context(), claims, o, &out)
	if err == nil || !strings.Contains(err.Error(), "1 of 2 claims could not be adopted") {
		t.Fatalf("apply with a conflict: err %v\n%s", err, out.String())
	}
	if sum[lifecycle.ActionAdopted] != 1 || sum[lifecycle.ActionFailed] != 1 || !strings.Contains(out.String(), "dsh-dave   dave   failed: the claim changed while adopt ran; run adopt again") {
		t.Fatalf("apply: %v\n%s", sum, out.String())
	}
	if strings.Contains(out.String(), seedHash[:16]) {
		t.Fatalf("the output shows a token hash:\n%s", out.String())
	}
	if len(patches) != 2 {
		t.Fatalf("%d patches, want alice's and dave's", len(patches))
	}
	for _, p := range patches {
		var body struct {
			Metadata struct {
				ResourceVersion string            `json:"resourceVersion"`
				Labels          map[string]string `json:"labels"`
				Annotations     map[string]string `json:"annotations"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(p.GetPatch(), &body); err != nil {
			t.Fatal(err)
		}
		user, _ := sandbox.UserOf(p.GetName())
		wantRV := map[string]string{"alice": "41", "dave": "7"}[user]
		m := body.Metadata
		if p.GetPatchType() != "application/merge-patch+json" || m.ResourceVersion != wantRV ||
			len(m.Labels) != 2 || m.Labels["aaas.example.com/managed-by"] != "dsh-gateway" || m.Labels[sandbox.UserLabel] != user ||
			len(m.Annotations) != 1 || m.Annotations[sandbox.TokenHashAnnotation] != seedHash {
			t.Errorf("patch of %s (%s): %s", p.GetName(), p.GetPatchType(), p.GetPatch())
		}
	}
	got, err := claims.Get(t.Context(), "dsh-alice", metav1.GetOptions{})
	if err != nil || got.Labels["aaas.example.com/managed-by"] != "dsh-gateway" || got.Labels[sandbox.UserLabel] != "alice" || got.Annotations["aaas.example.com/managed-by"] != "dsh-gateway" {
		t.Fatalf("alice after adoption: %v %+v", err, got.ObjectMeta)
	}
	for _, name := range []string{"dsh-carol", "notebook", "dsh-dave"} {
		if c, _ := claims.Get(t.Context(), name, metav1.GetOptions{}); len(c.Labels) != 0 {
			t.Errorf("%s was changed: %v", name, c.Labels)
		}
	}
}
