package install_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natstls"
)

// runbookBlock is the shell block of docs/RUNBOOK.md under the heading
// that starts with heading.
func runbookBlock(t *testing.T, heading string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testenv.Root(), "docs", "RUNBOOK.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(b), "\n"+heading)
	m := regexp.MustCompile("(?s)```sh\n(.*?)```").FindStringSubmatch(after)
	if !ok || m == nil {
		t.Fatalf("docs/RUNBOOK.md has no shell block under %q", heading)
	}
	return m[1]
}

// TestNATSIdentityRotationWithoutOutage runs docs/RUNBOOK.md's rotation
// of the edge's NATS identity, as written, while a user signs in through
// the front door again and again (each sign-in writes its session and
// its rate-limit count through the edge's NATS connection). It checks
// that the rotation happened (the Secret's current key is the one staged
// before; the edges came back on it while the NATS nodes still ran with
// the old configuration, admitting it as the staged key; after NATS's
// restart the old key is refused and the new one admitted), and that no
// edge was ever refused by NATS: no node lists a closed edge connection
// for an authorization violation, a check this test's own connection on
// the retired key proves able to see one.
func TestNATSIdentityRotationWithoutOutage(t *testing.T) {
	ctx := testenv.Context(t, 20*time.Minute)
	block := runbookBlock(t, "#### Rotating a NATS identity")
	edges, natsRestart, ok := strings.Cut(block, "kubectl -n aaas rollout restart statefulset/nats")
	if !ok || !strings.Contains(block, `ROLES="edge"`) {
		t.Fatalf("the runbook's block no longer rotates the edge, then restarts NATS:\n%s", block)
	}
	natsRestart = "kubectl -n aaas rollout restart statefulset/nats" + natsRestart

	secrets := cluster.Client.CoreV1().Secrets(controlNS)
	before, err := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	oldKey, staged := string(before.Data[natsauth.Edge.PublicKey(false)]), string(before.Data[natsauth.Edge.PublicKey(true)])
	if oldKey == "" || staged == "" || oldKey == staged {
		t.Fatalf("the install's edge keys: current %q, staged %q", oldKey, staged)
	}

	c := client(t, ingress(t)).WithTimeout(30 * time.Second)
	tok := c.Signup("rotator", invite)
	phase := "edges"
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		wg     sync.WaitGroup
	)
	poll, stop := context.WithCancel(ctx)
	defer stop()
	wg.Add(1)
	go func() {
		defer wg.Done()
		// One sign-in every 3 s keeps within AUTH_RATE_LIMIT (30 a minute).
		tick := time.NewTicker(3 * time.Second)
		defer tick.Stop()
		for {
			req, _ := http.NewRequestWithContext(poll, http.MethodPost, c.Base+"/login", strings.NewReader(url.Values{"token": {tok}}.Encode()))
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Accept", "application/json")
			req.Header.Set("Origin", c.Base)
			resp, err := c.HTTP.Do(req)
			outcome := "transport error"
			if err == nil {
				resp.Body.Close()
				outcome = fmt.Sprint(resp.StatusCode)
			}
			mu.Lock()
			if poll.Err() == nil {
				counts[phase+" "+outcome]++
			}
			mu.Unlock()
			select {
			case <-poll.Done():
				return
			case <-tick.C:
			}
		}
	}()
	setPhase := func(p string) { mu.Lock(); phase = p; mu.Unlock() }

	// The rotation, and the edges' restart onto the new key.
	if out, err := shell(ctx, installDir, edges); err != nil {
		t.Fatalf("the runbook's rotation and edge restart: %v\n%s", err, out)
	}
	after, err := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	newKey := string(after.Data[natsauth.Edge.PublicKey(false)])
	if newKey != staged || string(after.Data[natsauth.Edge.PublicKey(true)]) == staged || string(after.Data[natsauth.Lifecycle.PublicKey(false)]) != string(before.Data[natsauth.Lifecycle.PublicKey(false)]) {
		t.Fatalf("after setup rotate-nats edge: edge is %s (staged was %s), next %s", newKey, staged, after.Data[natsauth.Edge.PublicKey(true)])
	}
	nodes := natsPods(t, ctx)
	waitEdgesOn(t, nodes, newKey)
	refusedEdges(t, nodes)

	// NATS restarts a node at a time and forgets the old key.
	setPhase("nats")
	if out, err := shell(ctx, installDir, natsRestart); err != nil {
		t.Fatalf("the runbook's NATS restart: %v\n%s", err, out)
	}
	setPhase("after")
	nodes = natsPods(t, ctx)
	waitEdgesOn(t, nodes, newKey)
	refusedEdges(t, nodes)
	// The positive control: the retired key is refused (and the refusal is
	// listed where refusedEdges looks), the current one admitted.
	if err := connectAs(t, nodes[0], after.Data[natsauth.Edge.SeedKey(false)], "edge/rotation-test-new"); err != nil {
		t.Fatalf("the current edge key: %v", err)
	}
	if err := connectAs(t, nodes[0], before.Data[natsauth.Edge.SeedKey(false)], "edge/rotation-test-old"); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("the retired edge key: %v, want an authorization violation", err)
	}
	if got := closedForAuthorization(t, nodes[0]); !got["edge/rotation-test-old"] {
		t.Fatalf("%s does not list the retired key's refusal (it lists %v): the check for refused edges sees nothing", nodes[0].Name, got)
	}

	// Sign-ins went on throughout; none was refused as signed out.
	testutil.Eventually(t, time.Minute, func() error {
		mu.Lock()
		defer mu.Unlock()
		if counts["after 200"] == 0 {
			return fmt.Errorf("no sign-in succeeded after the rotation yet: %v", counts)
		}
		return nil
	})
	stop()
	wg.Wait()
	var report []string
	for k, n := range counts {
		report = append(report, fmt.Sprintf("%s: %d", k, n))
		if code := strings.Fields(k)[1]; code == "401" || code == "403" || code == "429" {
			t.Errorf("a sign-in was answered %s %d times during the rotation", k, n)
		}
	}
	sort.Strings(report)
	for _, p := range []string{"edges", "nats"} {
		if counts[p+" 200"] == 0 {
			t.Errorf("no sign-in succeeded while the %s restarted: %v", p, report)
		}
	}
	t.Logf("sign-ins through the rotation: %s", strings.Join(report, ", "))
}

// natsPods are the running NATS pods, all three.
func natsPods(t *testing.T, ctx context.Context) []corev1.Pod {
	t.Helper()
	var pods []corev1.Pod
	testutil.Eventually(t, 5*time.Minute, func() error {
		l, err := cluster.Client.CoreV1().Pods(controlNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=nats", FieldSelector: "status.phase=Running"})
		if err != nil {
			return err
		}
		if len(l.Items) != 3 {
			return fmt.Errorf("%d NATS pods running", len(l.Items))
		}
		pods = l.Items
		return nil
	})
	return pods
}

// waitEdgesOn waits until every edge connection on the NATS nodes
// authenticated with key, and there are as many as edge pods.
func waitEdgesOn(t *testing.T, nodes []corev1.Pod, key string) {
	t.Helper()
	testutil.Eventually(t, 3*time.Minute, func() error {
		pods, err := cluster.Client.CoreV1().Pods(controlNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=aaas-edge", FieldSelector: "status.phase=Running"})
		if err != nil {
			return err
		}
		want := 0
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil {
				want++
			}
		}
		n := 0
		for _, p := range nodes {
			cz := monitor(t, p, "/connz?auth=true&limit=1024")
			conns, _ := cz["connections"].([]any)
			for _, c := range conns {
				c, _ := c.(map[string]any)
				if name, _ := c["name"].(string); !strings.HasPrefix(name, "edge/") {
					continue
				}
				if c["authorized_user"] != key {
					return fmt.Errorf("%s: edge connection %v is on %v, want %s", p.Name, c["name"], c["authorized_user"], key)
				}
				n++
			}
		}
		if n != want {
			return fmt.Errorf("%d edge connections for %d edge pods", n, want)
		}
		return nil
	})
}

// closedForAuthorization are the names of the connections a NATS node
// closed because it refused their identity (since it started).
func closedForAuthorization(t *testing.T, p corev1.Pod) map[string]bool {
	t.Helper()
	cz := monitor(t, p, "/connz?state=closed&limit=10000")
	conns, _ := cz["connections"].([]any)
	out := map[string]bool{}
	for _, c := range conns {
		c, _ := c.(map[string]any)
		// A refused identity closes as "Authentication Failure".
		if reason, _ := c["reason"].(string); reason == "Authentication Failure" {
			name, _ := c["name"].(string)
			out[name] = true
		}
	}
	return out
}

// refusedEdges fails the test if a node refused an edge process.
func refusedEdges(t *testing.T, nodes []corev1.Pod) {
	t.Helper()
	for _, p := range nodes {
		for name := range closedForAuthorization(t, p) {
			if strings.HasPrefix(name, "edge/") && !strings.HasPrefix(name, "edge/rotation-test-") {
				t.Errorf("%s refused %s: the edge was cut off", p.Name, name)
			}
		}
	}
}

// connectAs connects to the node as the holder of seed would, over the
// install's TLS, and closes again.
func connectAs(t *testing.T, p corev1.Pod, seed []byte, name string) error {
	t.Helper()
	kp, err := nkeys.FromSeed(seed)
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := kp.PublicKey()
	sec, err := cluster.Client.CoreV1().Secrets(controlNS).Get(context.Background(), natstls.SecretName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(sec.Data["ca.crt"])
	nc, err := nats.Connect("tls://"+net.JoinHostPort(p.Status.PodIP, "4222"), nats.Name(name), nats.Nkey(pub, kp.Sign),
		nats.Secure(&tls.Config{RootCAs: roots, ServerName: p.Name + ".nats-headless", MinVersion: tls.VersionTLS12}),
		nats.NoReconnect(), nats.Timeout(10*time.Second))
	if err != nil {
		return err
	}
	nc.Close()
	return nil
}
