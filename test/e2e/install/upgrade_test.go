package install_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// nextTag is the aaas image under another tag: the same build, standing
// in for the next release (this tier has one build), so that `helm
// upgrade` replaces every aaas pod as an upgrade does.
const nextTag = "next"

// podUIDs are the UIDs of the running pods in the control plane's
// namespace with the given app.kubernetes.io/name.
func podUIDs(t *testing.T, ctx context.Context, names ...string) map[types.UID]string {
	t.Helper()
	out := map[types.UID]string{}
	for _, n := range names {
		pods, err := cluster.Client.CoreV1().Pods(controlNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + n})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil {
				out[p.UID] = p.Name
			}
		}
	}
	return out
}

// TestHelmUpgradeUnderTrafficKeepsSessions is `helm upgrade` to a new
// release while a signed-in browser keeps using the gateway through the
// front door (Traefik): every aaas pod is replaced, edges one at a time
// behind their drain, NATS (whose configuration did not change) not at
// all, and the browser's session and its bearer token work throughout and
// after: no answer says it is signed out.
func TestHelmUpgradeUnderTrafficKeepsSessions(t *testing.T) {
	ctx := testenv.Context(t, 10*time.Minute)
	c := client(t, ingress(t)).WithTimeout(30 * time.Second)
	tok := c.Signup("upgrader", invite)
	aaasPods := []string{"aaas-edge", "aaas-lifecycle", "aaas-sweeper", "aaas-broker"}
	before, natsBefore := podUIDs(t, ctx, aaasPods...), podUIDs(t, ctx, "nats")

	// The browser: its session cookie and, alternately, its token, as
	// fast as the gateway answers, until the upgrade has rolled out.
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		wg     sync.WaitGroup
	)
	poll, stop := context.WithCancel(ctx)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; poll.Err() == nil; i++ {
			req, _ := http.NewRequestWithContext(poll, http.MethodGet, c.Base+"/_/status", nil)
			req.Header.Set("Accept", "application/json")
			how := "cookie"
			if i%2 == 1 {
				how = "bearer"
				req.Header.Set("Authorization", "Bearer "+tok)
			}
			var outcome string
			resp, err := c.HTTP.Do(req)
			switch {
			case poll.Err() != nil:
				return
			case err != nil:
				outcome = "transport error"
			default:
				var body struct{ User string }
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
				resp.Body.Close()
				_ = json.Unmarshal(b, &body)
				outcome = fmt.Sprint(resp.StatusCode)
				if resp.StatusCode == http.StatusOK && body.User != "upgrader" {
					outcome = "200 for " + body.User
				}
			}
			mu.Lock()
			counts[how+" "+outcome]++
			mu.Unlock()
			time.Sleep(50 * time.Millisecond)
		}
	}()
	out, err := helmUpgrade(ctx, t.TempDir(), "--set", "image.tag="+nextTag, "--wait", "--timeout", "5m")
	if err == nil {
		err = cluster.WaitRollout(ctx, controlNS, 5*time.Minute)
	}
	stop()
	wg.Wait()
	if err != nil {
		t.Fatalf("helm upgrade: %v\n%s", err, out)
	}

	after := podUIDs(t, ctx, aaasPods...)
	for uid, name := range before {
		if _, kept := after[uid]; kept {
			t.Errorf("pod %s was not replaced by the upgrade", name)
		}
	}
	for uid, name := range natsBefore {
		if _, kept := podUIDs(t, ctx, "nats")[uid]; !kept {
			t.Errorf("NATS pod %s was replaced, though its configuration did not change", name)
		}
	}
	var keys []string
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var report []string
	total := 0
	for _, k := range keys {
		report = append(report, fmt.Sprintf("%s: %d", k, counts[k]))
		total += counts[k]
		if !strings.HasSuffix(k, " 200") && !strings.HasSuffix(k, " transport error") && !strings.HasPrefix(strings.Fields(k)[1], "5") {
			t.Errorf("during the upgrade the gateway answered %q %d times: a session or token lost", k, counts[k])
		}
	}
	if counts["cookie 200"] == 0 || counts["bearer 200"] == 0 {
		t.Fatalf("no successful request during the upgrade (%v): the traffic never ran", report)
	}
	t.Logf("%d requests while %d aaas pods were replaced: %s", total, len(before), strings.Join(report, ", "))
	// And after it: the same session, the same token.
	if r := c.Do("GET", "/_/status", nil, "Accept", "application/json"); r.StatusCode != http.StatusOK || r.JSON()["user"] != "upgrader" {
		t.Fatalf("after the upgrade the session answers %d %s", r.StatusCode, r.Body)
	}
	if r := c.Do("GET", "/_/status", nil, append([]string{"Accept", "application/json"}, bearer(tok)...)...); r.StatusCode != http.StatusOK {
		t.Fatalf("after the upgrade the token answers %d", r.StatusCode)
	}
}
