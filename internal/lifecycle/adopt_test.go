package lifecycle_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	extclient "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned"
	claimsv1beta1 "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned/typed/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testutil"
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

// changedAfterListing is the API server's claims, with someone else
// changing one claim right after Adopt listed them: between its plan and
// its patch.
type changedAfterListing struct {
	claimsv1beta1.SandboxClaimInterface
	once   sync.Once
	change func()
}

func (c *changedAfterListing) List(ctx context.Context, o metav1.ListOptions) (*extv1beta1.SandboxClaimList, error) {
	l, err := c.SandboxClaimInterface.List(ctx, o)
	if err == nil {
		c.once.Do(c.change)
	}
	return l, err
}

// TestAdoptPatchesOnlyCandidates runs Adopt against the API server, as the
// lifecycle ServiceAccount: a dry run lists and changes nothing; --apply
// adopts each candidate with a patch carrying the resourceVersion it
// decided on, so a claim changed between plan and patch gets the API
// server's 409, is reported, fails the run, and does not stop the others.
func TestAdoptPatchesOnlyCandidates(t *testing.T) {
	f := setup(t, nil)
	_, admin, err := pkg.Cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	adminClaims := admin.ExtensionsV1beta1().SandboxClaims(f.NS.Name)
	mk := func(name string, mutate func(*extv1beta1.SandboxClaim)) {
		c := seedClaim(name)
		c.Namespace, c.ResourceVersion = "", ""
		c.Spec = extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: "dsh-pool"}}
		if mutate != nil {
			mutate(&c)
		}
		if _, err := adminClaims.Create(ctx(t), &c, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mk("dsh-alice", nil)
	mk("dsh-carol", func(c *extv1beta1.SandboxClaim) { delete(c.Annotations, sandbox.TokenHashAnnotation) })
	mk("dsh-dave", nil)
	mk("dsh-bob", func(c *extv1beta1.SandboxClaim) {
		c.Labels = map[string]string{"aaas.example.com/managed-by": "dsh-gateway"}
	})
	mk("notebook", nil)
	// The controller binds each claim to a sandbox, writes its status and,
	// its last write to metadata, stamps when it was first Ready.
	testutil.Eventually(t, 2*time.Minute, func() error {
		l, err := adminClaims.List(ctx(t), metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, c := range l.Items {
			if !meta.IsStatusConditionTrue(c.Status.Conditions, "Ready") || c.Annotations["agents.x-k8s.io/claim-first-ready-at"] == "" {
				return fmt.Errorf("claim %s not settled yet", c.Name)
			}
		}
		return nil
	})
	// What adopt may write: labels, annotations and spec. Not the resource
	// version: the controller still rewrites a claim's status now and then.
	versions := func() map[string]string {
		l, err := adminClaims.List(ctx(t), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		v := map[string]string{}
		for _, c := range l.Items {
			b, err := json.Marshal([]any{c.Labels, c.Annotations, c.Spec})
			if err != nil {
				t.Fatal(err)
			}
			v[c.Name] = string(b)
		}
		return v
	}
	rc, err := clientcmd.BuildConfigFromFlags("", f.NS.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	asLifecycle, err := extclient.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	claims := asLifecycle.ExtensionsV1beta1().SandboxClaims(f.NS.Name)
	o := adoptOptions()
	o.Namespace = f.NS.Name

	before := versions()
	var out bytes.Buffer
	sum, err := lifecycle.Adopt(ctx(t), claims, o, &out)
	if err != nil || sum[lifecycle.ActionAdopt] != 2 || sum[lifecycle.ActionSkipped] != 2 || sum[lifecycle.ActionManaged] != 1 {
		t.Fatalf("dry run: %v, %v\n%s", err, sum, out.String())
	}
	for _, want := range []string{"in namespace " + f.NS.Name + " (dry run: nothing is changed)", "dsh-alice  alice  adopt\n", "dsh-bob    bob    already managed\n", "dsh-carol  carol  skipped: no token hash", "notebook   -      skipped: not a user's claim", "run again with --apply"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("dry run output lacks %q:\n%s", want, out.String())
		}
	}
	if after := versions(); !maps.Equal(after, before) {
		t.Fatalf("the dry run changed claims: %v, before %v", after, before)
	}

	out.Reset()
	o.Apply = true
	changed := &changedAfterListing{SandboxClaimInterface: claims, change: func() {
		// An operator labels dave while adopt is deciding.
		patch := []byte(`{"metadata":{"labels":{"team":"blue"}}}`)
		if _, err := adminClaims.Patch(ctx(t), "dsh-dave", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Error(err)
		}
	}}
	sum, err = lifecycle.Adopt(ctx(t), changed, o, &out)
	if err == nil || !strings.Contains(err.Error(), "1 of 2 claims could not be adopted") {
		t.Fatalf("apply with a conflict: err %v\n%s", err, out.String())
	}
	if sum[lifecycle.ActionAdopted] != 1 || sum[lifecycle.ActionFailed] != 1 || !strings.Contains(out.String(), "dsh-dave   dave   failed: the claim changed while adopt ran; run adopt again") {
		t.Fatalf("apply: %v\n%s", sum, out.String())
	}
	if strings.Contains(out.String(), seedHash[:16]) {
		t.Fatalf("the output shows a token hash:\n%s", out.String())
	}
	got, err := adminClaims.Get(ctx(t), "dsh-alice", metav1.GetOptions{})
	if err != nil || got.Labels["aaas.example.com/managed-by"] != "dsh-gateway" || got.Labels[sandbox.UserLabel] != "alice" ||
		got.Annotations["aaas.example.com/managed-by"] != "dsh-gateway" || got.Annotations[sandbox.TokenHashAnnotation] != seedHash {
		t.Fatalf("alice after adoption: %v %+v", err, got.ObjectMeta)
	}
	dave, err := adminClaims.Get(ctx(t), "dsh-dave", metav1.GetOptions{})
	if err != nil || len(dave.Labels) != 1 || dave.Labels["team"] != "blue" {
		t.Fatalf("dave after the conflict: %v, labels %v (want only the operator's)", err, dave.Labels)
	}
	after := versions()
	for _, name := range []string{"dsh-carol", "notebook", "dsh-bob"} {
		if after[name] != before[name] {
			t.Errorf("%s was changed: %s, was %s", name, after[name], before[name])
		}
	}
}
