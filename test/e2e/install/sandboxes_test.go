package install_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/sandbox"
)

// dshNextTag is DSH's next image (the same stand-in under another tag,
// which it reports as its version), and dshMissingTag a tag the registry
// does not have: an image that cannot be pulled, the new revision that
// fails.
const (
	dshNextTag    = "1.0.1"
	dshMissingTag = "1.0.2-missing"
)

// TestProfilesSandboxesAndRollouts takes the install from one kind of
// sandbox to what README's Profiles, Named sandboxes and Rollouts
// describe, by helm upgrade as an operator would: two profiles of the
// chart's values (the first keeping the install's warm pool and
// template), two sandboxes per user, ROLLOUT=next-wake. A user has
// one sandbox of each profile, each at its own origin; a new DSH image
// reaches the sleeping one at its next wake, on the same volume (the new
// image's version is seen through the edge) and the running one only
// after it sleeps; an image that cannot be pulled is rolled back by
// itself and its revision halted. Everything is put back at the end, for
// the tests that follow.
func TestProfilesSandboxesAndRollouts(t *testing.T) {
	ctx := testenv.Context(t, 20*time.Minute)
	dir := t.TempDir()
	upgrade := func(ctx context.Context, args ...string) error {
		out, err := helmUpgrade(ctx, dir, append(args, "--wait", "--timeout", "5m")...)
		if err != nil {
			return fmt.Errorf("helm upgrade: %v\n%s", err, out)
		}
		return cluster.WaitRollout(ctx, controlNS, 5*time.Minute)
	}
	// The first profile keeps the install's warm pool and template (README,
	// Profiles): what was made of them stays.
	const profiles = `[{"name":"small","description":"the usual","replicas":1,"warmPool":"dsh-pool","template":"dsh-web"},` +
		`{"name":"large","description":"more memory","replicas":1,"resources":{"requests":{"cpu":"100m","memory":"512Mi","ephemeral-storage":"256Mi"},"limits":{"memory":"3Gi","ephemeral-storage":"2Gi"}}}]`
	kept := defaultObjects(t)
	if err := upgrade(ctx, "--set-json", "sandbox.profiles="+profiles, "--set", "config.MAX_SANDBOXES_PER_USER=2", "--set", "config.ROLLOUT=next-wake"); err != nil {
		t.Fatal(err)
	}
	if now := defaultObjects(t); now != kept {
		t.Fatalf("turning profiles on replaced the install's warm pool and template: %v, then %v", kept, now)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		err := upgrade(ctx, "--set-json", "sandbox.profiles=[]", "--set", "config.MAX_SANDBOXES_PER_USER=1", "--set", "config.ROLLOUT=manual", "--set", "sandbox.image.tag=1.0.0")
		if err == nil {
			err = waitPool(ctx, 3*time.Minute, "dsh-pool")
		}
		if err != nil {
			t.Errorf("putting the install back: %v", err)
		}
	})
	if err := waitPool(ctx, 3*time.Minute, "dsh-pool", "dsh-large"); err != nil {
		t.Fatal(err)
	}
	oldPodsGone(t, "aaas-lifecycle")
	oldPodsGone(t, "aaas-edge")

	const user, named = "nia", "nia--work"
	gw := client(t, front).WithTimeout(2 * time.Minute)
	gw.Signup(user, invite)
	// The first sandbox stays up through what follows.
	keepAwake(t, gw)
	if r := gw.Form("/_/sandboxes", "name", "work", "profile", "large"); r.StatusCode != http.StatusCreated {
		t.Fatalf("a large sandbox named work: %d %s", r.StatusCode, r.Body)
	}
	// A third is past the cap, and changes nothing.
	if r := gw.Form("/_/sandboxes", "name", "play", "profile", "small"); r.StatusCode != http.StatusConflict {
		t.Fatalf("a third sandbox: %d %s, want 409", r.StatusCode, r.Body)
	}
	list := gw.Do("GET", "/_/sandboxes", nil)
	var mine struct {
		Sandboxes []struct{ Name, Profile, URL string }
		Max       int
	}
	if err := json.Unmarshal(list.Body, &mine); err != nil || len(mine.Sandboxes) != 2 || mine.Max != 2 ||
		mine.Sandboxes[0].Profile != "small" || mine.Sandboxes[1].Name != "work" || mine.Sandboxes[1].Profile != "large" || mine.Sandboxes[1].URL != origin(named)+"/" {
		t.Fatalf("%s's sandboxes: %v %s", user, err, list.Body)
	}

	first, work := signIn(t, gw, user, "/"), signIn(t, gw, named, "/")
	version := func(s *testenv.Client) string {
		r := s.Do("GET", "/api/echo", nil)
		var e struct{ Version string }
		if err := json.Unmarshal(r.Body, &e); r.StatusCode != http.StatusOK || err != nil {
			return fmt.Sprintf("(echo: %d %v)", r.StatusCode, err)
		}
		return e.Version
	}
	waitVersion := func(s *testenv.Client, who, want string) time.Duration {
		t.Helper()
		start := time.Now()
		testutil.Eventually(t, 4*time.Minute, func() error {
			if v := version(s); v != want {
				return fmt.Errorf("%s runs %s, want %s", who, v, want)
			}
			return nil
		})
		return time.Since(start)
	}
	waitVersion(first, user, "1.0.0")
	waitVersion(work, named, "1.0.0")
	// Each profile's pod is of its own template.
	if m := podOf(t, named).Spec.Containers[0].Resources.Requests.Memory().String(); m != "512Mi" {
		t.Fatalf("the large sandbox's pod asks for %s memory", m)
	}
	if m := podOf(t, user).Spec.Containers[0].Resources.Requests.Memory().String(); m != "256Mi" {
		t.Fatalf("the small sandbox's pod asks for %s memory", m)
	}
	body := []byte("written before the new image")
	if r := work.Do("PUT", "/api/files/kept.txt", bytes.NewReader(body)); r.StatusCode/100 != 2 {
		t.Fatalf("upload: %d %s", r.StatusCode, r.Body)
	}
	volume := volumeClaims(t, named)
	firstPod := podOf(t, user).UID

	// The new image, in every profile's SandboxTemplate.
	if err := upgrade(ctx, "--set", "sandbox.image.tag="+dshNextTag); err != nil {
		t.Fatal(err)
	}
	suspend := func(path, key string) {
		t.Helper()
		if r := gw.Form(path); r.StatusCode != http.StatusAccepted {
			t.Fatalf("suspend %s: %d %s", key, r.StatusCode, r.Body)
		}
		testutil.Eventually(t, 2*time.Minute, func() error {
			if pods := userPods(t, key); len(pods) != 0 {
				return fmt.Errorf("%s suspended, but %d pods remain", key, len(pods))
			}
			return nil
		})
	}
	suspend("/_/sandboxes/work/suspend", named)
	took := waitVersion(work, named, dshNextTag)
	t.Logf("%s woke on %s in %s", named, dshNextTag, took.Round(time.Millisecond))
	if r := work.Do("GET", "/api/files/kept.txt", nil); r.StatusCode != http.StatusOK || !bytes.Equal(r.Body, body) {
		t.Fatalf("the file after the rollout: %d %q", r.StatusCode, r.Body)
	}
	if now := volumeClaims(t, named); len(now) != 1 || len(volume) != 1 || now[0].UID != volume[0].UID {
		t.Fatalf("%s's volume was %v, is %v", named, uids(volume), uids(now))
	}
	// The running sandbox, meanwhile, is the pod it was: not rolled.
	if v := version(first); v != "1.0.0" || podOf(t, user).UID != firstPod {
		t.Fatalf("%s, running, was touched: version %s", user, v)
	}
	suspend("/_/suspend", user)
	took = waitVersion(first, user, dshNextTag)
	t.Logf("%s, once asleep, woke on %s in %s", user, dshNextTag, took.Round(time.Millisecond))
	rolled := sandboxOf(t, named)
	if rolled.Annotations[sandbox.PreviousRevisionAnnotation] == "" || rolled.Annotations[sandbox.HaltedAnnotation] != "" {
		t.Fatalf("%s's Sandbox after its rollout: annotations %v", named, rolled.Annotations)
	}
	good := sandbox.Revision(rolled)

	// An image that cannot be pulled: the next wake rolls to it, its pod
	// waits on the pull, and lifecycle puts the previous template back.
	if err := upgrade(ctx, "--set", "sandbox.image.tag="+dshMissingTag); err != nil {
		t.Fatal(err)
	}
	suspend("/_/sandboxes/work/suspend", named)
	took = waitVersion(work, named, dshNextTag)
	t.Logf("%s back on %s, the missing image rolled back, %s after its wake", named, dshNextTag, took.Round(time.Millisecond))
	back := sandboxOf(t, named)
	halted := back.Annotations[sandbox.HaltedAnnotation]
	if sandbox.Revision(back) != good || halted == "" || halted == good {
		t.Fatalf("%s's Sandbox after the rollback: revision %s (good %s), annotations %v", named, sandbox.Revision(back), good, back.Annotations)
	}
	// The fault happened: the kubelet tried the missing image for it.
	testutil.Eventually(t, time.Minute, func() error {
		evs, err := cluster.Client.CoreV1().Events(sandboxNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Pod"})
		if err != nil {
			return err
		}
		for _, e := range evs.Items {
			if strings.Contains(e.Message, ":"+dshMissingTag) && (e.Reason == "Failed" || e.Reason == "BackOff") {
				return nil
			}
		}
		return fmt.Errorf("no pod event names the missing image (%d events)", len(evs.Items))
	})
	if r := work.Do("GET", "/api/files/kept.txt", nil); r.StatusCode != http.StatusOK || !bytes.Equal(r.Body, body) {
		t.Fatalf("the file after the rollback: %d %q", r.StatusCode, r.Body)
	}

	if r := gw.Do("DELETE", "/_/sandboxes/work", nil); r.StatusCode != http.StatusNoContent {
		t.Fatalf("delete work: %d %s", r.StatusCode, r.Body)
	}
	if r := gw.Do("DELETE", "/users/"+user, nil, "Accept", "application/json"); r.StatusCode/100 != 2 {
		t.Fatalf("delete %s: %d %s", user, r.StatusCode, r.Body)
	}
}

// defaultObjects are the UIDs of the install's own warm pool and template
// (dsh-pool, dsh-web): the same UIDs, the same objects.
func defaultObjects(t *testing.T) [2]string {
	t.Helper()
	_, ext, err := cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	pool, err := ext.ExtensionsV1beta1().SandboxWarmPools(sandboxNS).Get(context.Background(), "dsh-pool", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := ext.ExtensionsV1beta1().SandboxTemplates(sandboxNS).Get(context.Background(), "dsh-web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return [2]string{string(pool.UID), string(tmpl.UID)}
}

// podOf is the running pod of the sandbox of key.
func podOf(t *testing.T, key string) corev1.Pod {
	t.Helper()
	for _, p := range userPods(t, key) {
		if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
			return p
		}
	}
	t.Fatalf("%s has no running pod", key)
	return corev1.Pod{}
}

// sandboxOf is the Sandbox of key's claim, as the API server has it.
func sandboxOf(t *testing.T, key string) *sandboxv1beta1.Sandbox {
	t.Helper()
	sc, ext, err := cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	claim, err := ext.ExtensionsV1beta1().SandboxClaims(sandboxNS).Get(context.Background(), sandbox.ClaimName(key), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := sc.AgentsV1beta1().Sandboxes(sandboxNS).Get(context.Background(), claim.Status.SandboxStatus.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func uids(pvcs []*corev1.PersistentVolumeClaim) []string {
	var out []string
	for _, p := range pvcs {
		out = append(out, string(p.UID))
	}
	return out
}

// keepAwake keeps the signed-in user's sandbox awake past this install's
// 20 s idle timeout, once it is up.
func keepAwake(t *testing.T, c *testenv.Client) {
	t.Helper()
	testutil.Eventually(t, 3*time.Minute, func() error {
		if r := c.Form("/_/keepawake", "for", "30m"); r.StatusCode != http.StatusOK {
			return fmt.Errorf("keep-awake: %d %s", r.StatusCode, r.Body)
		}
		return nil
	})
}

// oldPodsGone waits until no pod of the Deployment name is terminating: a
// rollout is done while its old pods still are, and an old pod may yet
// serve (or, lifecycle's, take a command into a log that goes with it).
func oldPodsGone(t *testing.T, name string) {
	t.Helper()
	testutil.Eventually(t, 2*time.Minute, func() error {
		pods, err := cluster.Client.CoreV1().Pods(controlNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + name})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp != nil {
				return fmt.Errorf("%s pod %s is still terminating", name, p.Name)
			}
		}
		return nil
	})
}
