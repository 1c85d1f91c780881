package install_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/state"
)

// TestModelCallsThroughTheInstall: on the real node, through the
// documented install, a sandbox holds no provider key (not in its pod's
// environment, files or API access). An agent in mia's pod (modelprobe:
// the pod's network and its restricted security context) reaches the
// broker through its Service, and the broker the provider stand-in with
// the key README's install stored; the call is metered to mia. Forging
// every identity a request can carry, it is still charged as mia; it
// cannot send from another pod's address (no address of its own
// choosing, no raw socket) and finds no API token; a warm-pool spare, a Ready pod no user owns, is
// refused (403) with nothing forwarded.
func TestModelCallsThroughTheInstall(t *testing.T) {
	ctx := testenv.Context(t, 5*time.Minute)
	front := ingress(t)
	c := client(t, front).WithTimeout(2 * time.Minute)
	// Kept awake: the probes below go around the gateway, and this
	// install suspends a sandbox after 20 s without traffic through it.
	tok := awakeUser(t, c, "mia")
	noaTok := client(t, front).WithTimeout(2*time.Minute).Signup("noa", invite)
	mia := client(t, front).At(origin("mia")).WithTimeout(2 * time.Minute)
	usageOf := func(user, token string) state.Usage {
		t.Helper()
		r := client(t, front).Do("GET", "/_/usage", nil, append(bearer(token), "Accept", "application/json")...)
		var u state.Usage
		if err := json.Unmarshal(r.Body, &u); r.StatusCode != http.StatusOK || err != nil {
			t.Fatalf("%s's usage: %d %v %s", user, r.StatusCode, err, r.Body)
		}
		return u
	}
	// mia's sandbox is Ready before her agent makes its calls.
	testutil.Eventually(t, 3*time.Minute, func() error {
		if r := mia.Do("GET", "/api/files", nil, bearer(tok)...); r.StatusCode != http.StatusOK {
			return fmt.Errorf("mia's sandbox: %d %.200s", r.StatusCode, r.Body)
		}
		return nil
	})

	// The pod: no Secret, the placeholder keys, the broker's Service as
	// every base URL, no API token.
	pods := userPods(t, "mia")
	if len(pods) != 1 {
		t.Fatalf("mia has %d pods", len(pods))
	}
	pod := pods[0]
	base := ""
	for _, ctr := range pod.Spec.Containers {
		for _, f := range ctr.EnvFrom {
			if f.SecretRef != nil {
				t.Errorf("mia's pod takes Secret %s into its environment", f.SecretRef.Name)
			}
		}
		for _, e := range ctr.Env {
			switch {
			case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
				t.Errorf("mia's pod takes %s from Secret %s", e.Name, e.ValueFrom.SecretKeyRef.Name)
			case strings.HasSuffix(e.Name, "_API_KEY") && e.Value != "aaas-broker":
				t.Errorf("mia's pod has %s=%q", e.Name, e.Value)
			case e.Name == "DEEPSEEK_BASE_URL":
				base = e.Value
			}
		}
	}
	for _, v := range pod.Spec.Volumes {
		if v.Secret != nil || v.Projected != nil {
			t.Errorf("mia's pod mounts volume %s from a Secret or projection", v.Name)
		}
	}
	if base != "http://aaas-broker."+controlNS+".svc:8090/deepseek" {
		t.Fatalf("mia's pod has DEEPSEEK_BASE_URL=%q", base)
	}
	// This test bed runs CoreDNS on the host, outside the pods the
	// sandbox policy admits DNS to (k8s-app: kube-dns), so a pod here
	// resolves no cluster name: the agent calls the broker's Service by
	// its address instead of that name.
	svc, err := cluster.Client.CoreV1().Services(controlNS).Get(ctx, "aaas-broker", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	base = "http://" + svc.Spec.ClusterIP + ":8090/deepseek"

	// A warm-pool spare: Ready, no user.
	var spare *corev1.Pod
	testutil.Eventually(t, 2*time.Minute, func() error {
		list, err := cluster.Client.CoreV1().Pods(sandboxNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=dsh-web", FieldSelector: "status.phase=Running"})
		if err != nil {
			return err
		}
		for i := range list.Items {
			p := &list.Items[i]
			if p.Status.PodIP != "" && p.DeletionTimestamp == nil && owner(t, p) == "" {
				spare = p
				return nil
			}
		}
		return fmt.Errorf("no warm-pool spare running")
	})

	hint := providerKey[len(providerKey)-4:]
	before := len(models.Calls())
	out := ephemeral(t, &pod, modelProbeRef, base, "deepseek-chat", spare.Status.PodIP)
	t.Logf("the hostile agent in mia's pod:\n%s", out)
	lines := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		name, rest, _ := strings.Cut(l, " ")
		lines[name] = rest
	}
	for name, want := range map[string]string{
		"as-itself":             "200 ",
		"forged-identity":       "200 ",
		"source-another-pod":    "error ",
		"raw-socket":            "refused ",
		"add-address":           "refused ",
		"service-account-token": "absent",
	} {
		if !strings.HasPrefix(lines[name], want) {
			t.Errorf("%s: %q, want %q…", name, lines[name], want)
		}
	}
	if !strings.Contains(lines["source-another-pod"], "assign requested address") {
		t.Errorf("sending from the spare's address: %q, want the kernel's refusal", lines["source-another-pod"])
	}
	// Both calls that went through are mia's, made with the install's
	// key; noa's month is untouched.
	testutil.Eventually(t, time.Minute, func() error {
		if u := usageOf("mia", tok); u.Calls != 2 || u.OutputTokens == 0 {
			return fmt.Errorf("mia's month after the hostile agent: %+v, want 2 calls", u)
		}
		return nil
	})
	calls := models.Calls()[before:]
	if len(calls) != 2 || calls[0].KeyHint != hint || calls[1].KeyHint != hint || calls[0].Status != http.StatusOK {
		t.Fatalf("the stand-in saw %+v from the hostile agent, want its 2 calls with the install's key (…%s)", calls, hint)
	}
	if u := usageOf("noa", noaTok); u.Calls != 0 {
		t.Fatalf("noa was charged: %+v", u)
	}

	// The spare, which no user owns: refused, nothing forwarded.
	before = len(models.Calls())
	out = ephemeral(t, spare, modelProbeRef, base, "deepseek-chat", pod.Status.PodIP)
	first, _, _ := strings.Cut(strings.TrimSpace(out), "\n")
	if !strings.HasPrefix(first, "as-itself 403 ") {
		t.Fatalf("a call from a warm-pool spare: %q, want 403", first)
	}
	if n := len(models.Calls()) - before; n != 0 {
		t.Fatalf("the stand-in saw %d calls from the spare", n)
	}
}
