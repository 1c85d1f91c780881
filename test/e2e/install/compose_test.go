package install_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/manifests"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// composeNS is where compose's lifecycle puts its sandboxes: a namespace
// of their own, beside the Helm install's on the same node.
const composeNS = "aaas-compose-sandboxes"

// TestComposeOnTheRealNode runs compose.yaml as README's "Docker compose
// against kind" section does — docker compose (built from its module) on
// a Docker engine (Debian's docker.io, started for the test), the project
// directory holding .kind as `make kind-up` leaves it (the NATS
// credentials `natsauth -compose` writes, a kubeconfig with its
// credentials inline), the dev sandbox template applied, the images
// loaded — with one override, testdata/compose.realnode.yaml, that swaps
// kind's node for the real node. What differs from kind: no registry can
// be reached, so the images are hack/image's (aaas:dev, NATS and
// dshsim:dev, which `make kind-up` would load into kind's node) loaded
// as archives, compose is not asked to build (up --no-build), and the
// node is this machine. Through compose's two edges a user signs up, is
// served by her sandbox (a pod on the real node, claimed by compose's
// lifecycle), suspends it on one edge and wakes it on the other with her
// files kept; every process kind runs with its own NATS identity.
func TestComposeOnTheRealNode(t *testing.T) {
	ctx := testenv.Context(t, 10*time.Minute)
	compose := devcluster.ComposeBinary()
	if _, err := os.Stat(compose); err != nil {
		t.Fatalf("%s not built: run `make tools`", compose)
	}
	root := testenv.Root()
	// Short: the engine's sockets live under it.
	dir, err := os.MkdirTemp("", "compose-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })

	// The project directory: what compose.yaml names relative to itself
	// comes from the checkout, and .kind is made as make kind-up makes it.
	project := filepath.Join(dir, "project")
	kind := filepath.Join(project, ".kind")
	if err := os.MkdirAll(kind, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"hack", "manifests"} {
		if err := os.Symlink(filepath.Join(root, d), filepath.Join(project, d)); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(dir, "bin")
	natsauth, err := gobuild.Binary(bin, "github.com/aaas-project/aaas/hack/natsauth")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.CommandContext(ctx, natsauth, "-compose", filepath.Join(kind, "nats")).CombinedOutput(); err != nil {
		t.Fatalf("natsauth -compose: %v: %s", err, out)
	}
	writeComposeKubeconfig(t, filepath.Join(kind, "kubeconfig"))

	// The images: aaas:dev and NATS for the engine, dshsim:dev for the node.
	if err := image.BuildBinaries(bin); err != nil {
		t.Fatal(err)
	}
	natsBin, err := image.BuildNATS(bin)
	if err != nil {
		t.Fatal(err)
	}
	tars := map[string]image.Spec{
		"aaas.tar":   image.AAAS(bin, "docker.io/library/aaas:dev"),
		"nats.tar":   image.NATS(natsBin),
		"dshsim.tar": image.DSHSim(bin, "docker.io/library/dshsim:dev"),
	}
	for name, spec := range tars {
		if err := spec.Write(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := cluster.Real.ImportImages(ctx, filepath.Join(dir, "dshsim.tar")); err != nil {
		t.Fatal(err)
	}
	applyDevTemplate(t, ctx)

	docker, err := devcluster.StartDocker(ctx, filepath.Join(dir, "docker"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := docker.Stop(); err != nil {
			t.Error(err)
		}
	})
	if err := docker.Load(ctx, filepath.Join(dir, "aaas.tar"), filepath.Join(dir, "nats.tar")); err != nil {
		t.Fatal(err)
	}

	ports := make([]string, 2)
	for i := range ports {
		p, err := embednats.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		ports[i] = strconv.Itoa(p)
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	env := append(os.Environ(), "DOCKER_HOST="+docker.Host, "HANDSHAKE_KEYS="+base64.StdEncoding.EncodeToString(key),
		"EDGE_A_PORT="+ports[0], "EDGE_B_PORT="+ports[1], "COMPOSE_SANDBOX_NAMESPACE="+composeNS)
	run := func(args ...string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, compose, append([]string{"-f", filepath.Join(root, "compose.yaml"),
			"-f", filepath.Join(root, "test", "e2e", "install", "testdata", "compose.realnode.yaml"),
			"--project-directory", project}, args...)...)
		cmd.Env = env
		return cmd.CombinedOutput()
	}
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := run("logs", "--no-color", "--tail", "40")
			t.Logf("compose logs:\n%s", out)
		}
		if out, err := run("down", "--volumes", "--timeout", "10"); err != nil {
			t.Errorf("compose down: %v: %s", err, out)
		}
	})
	start := time.Now()
	if out, err := run("up", "--detach", "--no-build"); err != nil {
		t.Fatalf("compose up: %v: %s", err, out)
	}

	edgeA := composeClient(t, ports[0])
	edgeB := composeClient(t, ports[1])
	// (Polled with a plain client: the edges may not listen yet.)
	testutil.Eventually(t, 2*time.Minute, func() error {
		for _, c := range []*testenv.Client{edgeA, edgeB} {
			r, err := c.HTTP.Get(c.Base + "/")
			if err != nil {
				return err
			}
			r.Body.Close()
			if r.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: %d", c.Base, r.StatusCode)
			}
		}
		return nil
	})
	t.Logf("compose up to both edges answering: %s", time.Since(start).Round(time.Millisecond))
	// Every service runs (setup ran and finished), none restarted.
	out, err := run("ps", "--all", "--format", "json")
	if err != nil {
		t.Fatalf("compose ps: %v: %s", err, out)
	}
	states := map[string]string{}
	for _, line := range bytes.Split(bytes.TrimSpace(out), []byte("\n")) {
		var c struct{ Service, State string }
		if err := json.Unmarshal(line, &c); err != nil {
			t.Fatalf("compose ps: %v: %s", err, line)
		}
		states[c.Service] = c.State
	}
	for _, svc := range []string{"nats", "edge-a", "edge-b", "lifecycle", "sweeper", "broker"} {
		if states[svc] != "running" {
			t.Errorf("%s is %q", svc, states[svc])
		}
	}
	if states["setup"] != "exited" {
		t.Errorf("setup is %q", states["setup"])
	}
	// lifecycle and the broker, with their own identities, are ready (each
	// says so only once its NATS subscriptions are up).
	for name, port := range map[string]string{"lifecycle": "9191", "broker": "9193"} {
		testutil.Eventually(t, time.Minute, func() error {
			r, err := http.Get("http://127.0.0.1:" + port + "/readyz")
			if err != nil {
				return err
			}
			r.Body.Close()
			if r.StatusCode != http.StatusOK {
				return fmt.Errorf("%s not ready: %d", name, r.StatusCode)
			}
			return nil
		})
	}

	signup := time.Now()
	tok := edgeA.Signup("ann", "")
	ann := edgeA.At("http://ann.localhost:" + ports[0])
	testutil.Eventually(t, 3*time.Minute, func() error {
		if r := ann.Do("GET", "/api/files", nil, bearer(tok)...); r.StatusCode != http.StatusOK {
			return fmt.Errorf("ann's sandbox through edge-a: %d %.200s", r.StatusCode, r.Body)
		}
		return nil
	})
	t.Logf("signup to ann's sandbox serving: %s", time.Since(signup).Round(time.Millisecond))
	// Her sandbox is a pod on the real node, in compose's namespace.
	if pods := composePods(t, ctx, "ann"); len(pods) != 1 || pods[0].Spec.Containers[0].Image != "dshsim:dev" {
		t.Fatalf("ann's pods in %s: %d (%v)", composeNS, len(pods), pods)
	}
	notes := bytes.Repeat([]byte("kept across suspend "), 100)
	if r := ann.Do("PUT", "/api/files/notes.txt", bytes.NewReader(notes), bearer(tok)...); r.StatusCode/100 != 2 {
		t.Fatalf("upload: %d %s", r.StatusCode, r.Body)
	}

	// She suspends it on edge-a; edge-b sees it, and the pod goes.
	if r := edgeA.Form("/_/suspend"); r.StatusCode != http.StatusAccepted {
		t.Fatalf("suspend: %d %s", r.StatusCode, r.Body)
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		r := edgeB.Do("GET", "/_/status", nil, append(bearer(tok), "Accept", "application/json")...)
		if p, _ := r.JSON()["phase"].(string); p != "Suspended" {
			return fmt.Errorf("phase on edge-b: %q (%d)", p, r.StatusCode)
		}
		if pods := composePods(t, ctx, "ann"); len(pods) != 0 {
			return fmt.Errorf("suspended, %d pods remain", len(pods))
		}
		return nil
	})
	// Her next request, through edge-b, wakes it with her files.
	wake := time.Now()
	annB := edgeB.At("http://ann.localhost:" + ports[1])
	testutil.Eventually(t, 3*time.Minute, func() error {
		r := annB.Do("GET", "/api/files/notes.txt", nil, bearer(tok)...)
		if r.StatusCode != http.StatusOK || !bytes.Equal(r.Body, notes) {
			return fmt.Errorf("after wake through edge-b: %d, %d bytes", r.StatusCode, len(r.Body))
		}
		return nil
	})
	t.Logf("woken through edge-b with her files in %s", time.Since(wake).Round(time.Millisecond))
	if pods := composePods(t, ctx, "ann"); len(pods) != 1 {
		t.Fatalf("woken, ann has %d pods", len(pods))
	}
}

// composeClient is a browser on compose's edge at port, for which every
// name (localhost, <user>.localhost) is this machine.
func composeClient(t *testing.T, port string) *testenv.Client {
	c := testenv.NewClient(t, "http://localhost:"+port).WithTimeout(time.Minute)
	c.HTTP.Transport = &http.Transport{DialContext: dialTo(net.JoinHostPort("127.0.0.1", port))}
	return c
}

// writeComposeKubeconfig writes the real node's admin kubeconfig with its
// credentials inline, readable by compose's uid 65532 through its bind
// mount, as `make kind-up` writes kind's.
func writeComposeKubeconfig(t *testing.T, path string) {
	cfg, err := clientcmd.LoadFromFile(cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if err := clientcmdapi.FlattenConfig(cfg); err != nil {
		t.Fatal(err)
	}
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
}

// applyDevTemplate applies manifests/dev/kind, as `make kind-up` does,
// in compose's namespace, and deletes the namespace (and so compose's
// sandboxes) when the test ends.
func applyDevTemplate(t *testing.T, ctx context.Context) {
	objs, err := manifests.Render("manifests/dev/kind")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		switch {
		case o.GetKind() == "Namespace" && o.GetName() == sandboxNS:
			o.SetName(composeNS)
		case o.GetNamespace() == sandboxNS:
			o.SetNamespace(composeNS)
		}
	}
	if err := cluster.Apply(ctx, "", objs...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		ns := cluster.Client.CoreV1().Namespaces()
		if err := ns.Delete(ctx, composeNS, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete %s: %v", composeNS, err)
			return
		}
		testutil.Eventually(t, 3*time.Minute, func() error {
			if _, err := ns.Get(ctx, composeNS, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("%s still there (%v)", composeNS, err)
			}
			return nil
		})
	})
}

// composePods are the pods of user's sandbox in compose's namespace,
// but those already going.
func composePods(t *testing.T, ctx context.Context, user string) []corev1.Pod {
	t.Helper()
	list, err := cluster.Client.CoreV1().Pods(composeNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=dsh-web"})
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil && owner(t, &p) == user {
			out = append(out, p)
		}
	}
	return out
}
