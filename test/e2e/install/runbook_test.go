package install_test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/sandbox"
)

// TestRunbookQuestions runs docs/RUNBOOK.md's answers to the operators'
// questions, each shell block as written, against this install, as an
// operator with an administrator's token: why a user's sandbox is not
// starting, who uses the most, the audit trail, draining a node and
// sizing the pool and quota. What the test changes in the blocks: the
// user and node names (the blocks' own variables), and `--dry-run=server`
// on the commands that would cordon, drain or resize the one node under a
// running suite; the API server still checks every object and field they
// name. curl reaches the gateway's host at the front door, as README's
// DNS records would have it, trusting the test's CA.
func TestRunbookQuestions(t *testing.T) {
	ctx := testenv.Context(t, 15*time.Minute)
	gw := client(t, ingress(t)).WithTimeout(30 * time.Second)
	adminToken := gw.Signup("ops", invite)
	const user = "rue"
	// The first administrator, as README's Administration says.
	sum := sha256.Sum256([]byte(adminToken))
	helm, err := helmUpgrade(ctx, t.TempDir(), "--set", "config.ADMIN_USERS=ops:"+hex.EncodeToString(sum[:]), "--wait", "--timeout", "5m")
	if err == nil {
		err = cluster.WaitRollout(ctx, controlNS, 5*time.Minute)
	}
	if err != nil {
		t.Fatalf("helm upgrade with ADMIN_USERS: %v\n%s", err, helm)
	}
	testutil.Eventually(t, 3*time.Minute, func() error {
		if r := gw.Do("GET", "/_/admin/users", nil, append([]string{"Accept", "application/json"}, bearer(adminToken)...)...); r.StatusCode != http.StatusOK {
			return fmt.Errorf("the admin API answers %d", r.StatusCode)
		}
		return nil
	})
	// The user, after the upgrade rolled lifecycle: its log, which the
	// runbook reads, starts with its pods. A rollout is done for the
	// Deployment while its old pods still terminate, and an old pod may
	// yet take the user's claim into a log that goes with it; so the old
	// pods are waited out too.
	oldPodsGone(t, "aaas-lifecycle")
	rue := client(t, front).WithTimeout(30 * time.Second)
	rue.Signup(user, invite)
	// Kept awake past this install's 20 s idle timeout, as a user whose
	// sandbox will not start would be waiting on it.
	keepAwake(t, rue)

	var pod corev1.Pod
	testutil.Eventually(t, 5*time.Minute, func() error {
		pods := userPods(t, user)
		for _, p := range pods {
			// The runbook finds the pod by its user label. A pod adopted
			// from the warm pool is Running before the sandbox controller
			// copies the claim's labels onto it, so both are waited for.
			if p.Status.Phase == corev1.PodRunning {
				pod = p
				if got := p.Labels[sandbox.PodUserLabel]; got != user {
					return fmt.Errorf("%s's pod %s is labelled %s=%q (labels %v)", user, p.Name, sandbox.PodUserLabel, got, p.Labels)
				}
				return nil
			}
		}
		r := gw.Do("GET", "/_/admin/users?q="+user, nil, append([]string{"Accept", "application/json"}, bearer(adminToken)...)...)
		return fmt.Errorf("%s has no running pod yet (%d pods); the admin list says %d %.300s", user, len(pods), r.StatusCode, r.Body)
	})
	nodes, err := cluster.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil || len(nodes.Items) != 1 {
		t.Fatalf("nodes: %v (%d)", err, len(nodes.Items))
	}
	node := nodes.Items[0].Name

	// curl as README's DNS records would resolve the gateway's host.
	bin := t.TempDir()
	host, port, _ := net.SplitHostPort(front)
	curl := fmt.Sprintf("#!/bin/sh\nexec /usr/bin/curl --connect-to %s:443:%s:%s \"$@\"\n", domain, host, port)
	if err := os.WriteFile(filepath.Join(bin, "curl"), []byte(curl), 0o700); err != nil {
		t.Fatal(err)
	}
	env := []string{"GW=https://" + domain, "ADMIN=" + adminToken, "CURL_CA_BUNDLE=" + filepath.Join(installDir, "ca.crt")}
	// Commands that change the cluster, continued lines joined first.
	dryRun := regexp.MustCompile(`(?m)^(kubectl (?:.* )?(?:cordon|drain|patch) .*)$`)
	run := func(heading string, replace ...string) (string, string) {
		t.Helper()
		block := strings.NewReplacer(replace...).Replace(runbookBlock(t, heading))
		block = dryRun.ReplaceAllString(strings.ReplaceAll(block, "\\\n", " "), "$1 --dry-run=server")
		dir := t.TempDir()
		out, err := shell(ctx, dir, "PATH="+bin+":$PATH\n"+block, env...)
		if err != nil {
			t.Fatalf("%s: %v\n%s\n%s", heading, err, block, out)
		}
		t.Cleanup(func() {
			if t.Failed() {
				logs, _ := shell(ctx, dir, "kubectl -n "+controlNS+" logs -l app.kubernetes.io/name=aaas-edge --tail=-1 --prefix | grep -v '\"level\":\"INFO\"' | tail -20")
				t.Logf("after %s, the edges' warnings:\n%s", heading, logs)
			}
		})
		return string(out), dir
	}
	must := func(heading, out string, want ...string) {
		t.Helper()
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("%s: the output lacks %q:\n%s", heading, w, out)
			}
		}
	}

	out, _ := run("### Why is user X's sandbox not starting?", "U=ann\n", "U="+user+"\n")
	must("why", out, `"user":"`+user+`"`, pod.Name, "operatingMode: Running", "Events:", `"kind":"signup"`, `"msg":"command done"`, `"verb":"claim"`)

	out, dir := run("### Who is using the most?")
	must("who", out, `"user":"`+user+`"`, `"user":"ops"`)
	if csv, err := os.ReadFile(filepath.Join(dir, "usage.csv")); err != nil || !strings.HasPrefix(string(csv), "user,month,calls,") {
		t.Errorf("usage.csv is not the export: %v %q", err, csv)
	}

	out, dir = run("### Reading and exporting the audit trail", "user=ann", "user="+user)
	if csv, err := os.ReadFile(filepath.Join(dir, "audit.csv")); err != nil || !strings.HasPrefix(string(csv), "at,kind,user,") || !strings.Contains(string(csv), ",signup,"+user+",") {
		t.Errorf("audit.csv lacks %s's signup: %v\n%s\n%s", user, err, csv, out)
	}

	out, _ = run("### Draining a node", "NODE=node-1\n", "NODE="+node+"\n")
	must("drain", out, "(server dry run)", `"user":"`+user+`"`)
	if n, err := cluster.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); err != nil || n.Spec.Unschedulable {
		t.Fatalf("the dry run cordoned %s: %v", node, err)
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		if r := gw.Do("GET", "/_/admin/users?q="+user, nil, append([]string{"Accept", "application/json"}, bearer(adminToken)...)...); !strings.Contains(string(r.Body), `"phase":"Suspended"`) {
			return fmt.Errorf("%s after the drain's suspend: %s", user, r.Body)
		}
		return nil
	})

	pool := func() string {
		b, err := shell(ctx, t.TempDir(), "kubectl -n "+sandboxNS+" get sandboxwarmpool dsh-pool -o jsonpath='{.spec.replicas}' && kubectl -n "+sandboxNS+" get resourcequota -o jsonpath='{.items[*].spec.hard}'")
		if err != nil {
			t.Fatalf("%v: %s", err, b)
		}
		return string(b)
	}
	sized := pool()
	out, _ = run("### Sizing the warm pool and the quota")
	// kubectl patch does not say "(server dry run)"; that the pool and the
	// quota stay as they were says it.
	must("sizing", out, "resourcequota/aaas patched", "dsh-pool patched")
	if now := pool(); now != sized {
		t.Errorf("the dry run resized the pool or the quota: %s, was %s", now, sized)
	}
}
