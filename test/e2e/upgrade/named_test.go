package upgrade

import (
	"net/http"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/sandbox"
)

// TestAnAccountOfThePreviousReleaseKeepsItsSandbox: an account made on
// the previous release, with a file in its sandbox, is upgraded to this
// commit with MAX_SANDBOXES_PER_USER=2. Its sandbox becomes its first
// without moving a byte: the same claim, the same pod (never restarted),
// the file at the same URL, through the session it had. Then it makes a
// named sandbox beside it.
func TestAnAccountOfThePreviousReleaseKeepsItsSandbox(t *testing.T) {
	old := previousRelease(t)
	st := old.NewStack(t, testenv.StackOptions{})
	lc := st.Lifecycle("lc-a")
	edge := st.Edge("edge-a", nil)
	ann := testenv.NewClient(t, edge.URL)
	ann.Signup("ann", "")
	if r := ann.Do(http.MethodPut, "/u/ann/api/files/kept.txt", strings.NewReader("kept on "+previous)); r.StatusCode != http.StatusCreated {
		t.Fatalf("upload on %s: %d %.300s", previous, r.StatusCode, r.Body)
	}
	_, ext, _ := pkg.Cluster.SandboxClients()
	claimUID := func() string {
		t.Helper()
		c, err := ext.ExtensionsV1beta1().SandboxClaims(st.NS.Name).Get(testenv.Context(t, time.Minute), sandbox.ClaimName("ann"), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return string(c.UID)
	}
	claim, pod := claimUID(), st.Box("ann").PodUID

	st.Use(&pkg)
	st.Setup()
	for _, p := range []*testenv.Proc{lc, edge.Proc} {
		p.Env["MAX_SANDBOXES_PER_USER"] = "2"
		p.Replace(t, &pkg)
	}
	isRelease(t, "", lc, edge.Proc)

	r := ann.Do(http.MethodGet, "/u/ann/api/files/kept.txt", nil)
	if r.StatusCode != http.StatusOK || string(r.Body) != "kept on "+previous {
		t.Fatalf("ann's file after the upgrade: %d %q", r.StatusCode, r.Body)
	}
	if c, p := claimUID(), st.Box("ann").PodUID; c != claim || p != pod {
		t.Fatalf("ann's claim %s and pod %s after the upgrade, were %s and %s", c, p, claim, pod)
	}
	list := ann.Do(http.MethodGet, "/_/sandboxes", nil).JSON()
	boxes, _ := list["sandboxes"].([]any)
	if len(boxes) != 1 || boxes[0].(map[string]any)["url"] != "/u/ann/" || boxes[0].(map[string]any)["name"] != "" {
		t.Fatalf("ann's sandboxes after the upgrade: %v", list)
	}
	if r := ann.Form("/_/sandboxes", "name", "work"); r.StatusCode != http.StatusCreated {
		t.Fatalf("a named sandbox after the upgrade: %d %.300s", r.StatusCode, r.Body)
	}
	get(t, ann, "ann--work", http.StatusOK)
	get(t, ann, "ann", http.StatusOK)
}
