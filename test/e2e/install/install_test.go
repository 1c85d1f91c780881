// Package install_test is the deployment tier: it installs aaas exactly as
// README.md tells operators, running the README's install commands as
// written in a shell (kubectl and Helm at their pinned versions, the
// operator's values.yaml read from the README with only the registry, host
// name and API address substituted, and the remote locations mapped onto
// their local copies: agent-sandbox's release rendered from its pinned
// module, this repository's checkout for its clone) against the real-node
// devcluster, where images, container
// args, image users, probes, volumes, Pod Security, quotas and
// NetworkPolicy are all real. It then uses the install as a client would,
// through the edge Service, and probes the network from inside pods. The
// machine must be left as it was found: TestMain compares
// devcluster.HostState before and after.
package install_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/manifests"
	"github.com/aaas-project/aaas/internal/dev/providersim"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

const (
	// The namespaces the install puts the control plane and the tenants in.
	controlNS = config.DefaultControlPlaneNamespace
	sandboxNS = config.DefaultSandboxNamespace
	// registry and domain replace the README's registry.example.com and
	// aaas.example.com, as an operator replaces them.
	registry = "registry.local"
	domain   = "aaas.test"
	// readmeAPICIDR is the README's example API server address, which an
	// operator replaces with their cluster's; apiEndpoint is this test's:
	// a public address at which pods reach the API server (apiStandIn), as
	// on a managed cluster, where the private ranges the template excludes
	// anyway do not cover it.
	readmeAPICIDR = "192.0.2.10/32"
	apiEndpoint   = "198.51.100.7:443"
	// idleTimeout is what the test sets as config.IDLE_TIMEOUT (README:
	// helm upgrade with the new value), so that idle suspend is observable.
	idleTimeout = "20s"
	// providerAddr is where pods reach the provider stand-in, and
	// providerKey the key README's install stores in aaas-provider-keys.
	providerAddr = "198.51.100.9:443"
	providerKey  = "sk-install-test-0000000000000042"
)

var (
	cluster *devcluster.Cluster
	invite  string
	// probeRef is the image of the netprobe command (ephemeral containers);
	// curlRef is Debian's curl, the probe of scripts/preflight-sso.sh.
	probeRef = registry + "/netprobe:test"
	curlRef  = registry + "/curl:test"
	// modelProbeRef is the hostile agent of the broker's tests.
	modelProbeRef = registry + "/modelprobe:test"
	// traefikRef is the operator's ingress controller, Traefik built from
	// its module; front is its websecure address, where README's DNS
	// records would point.
	traefikRef = registry + "/traefik:" + aaas.Version("TRAEFIK_VERSION")
	front      string
	// oauth2ProxyRef and oidcRef are the gateway-sso exposure's test bed:
	// oauth2-proxy and the organisation's OpenID Connect provider, each
	// built from its module.
	oauth2ProxyRef = registry + "/oauth2-proxy:" + aaas.Version("OAUTH2_PROXY_VERSION")
	oidcRef        = registry + "/oidcop:" + aaas.Version("ZITADEL_OIDC_VERSION")
	// installDir is where README's commands run: the operator's values
	// and certificate files, and the checkout as aaas-src.
	installDir string
	// models is the model provider stand-in, which the install's broker
	// calls at providerAddr, a public address (the real providers cannot
	// be reached from here; it is the far end only).
	models     *providersim.Server
	providerLn net.Listener
	// kubectl is the pinned kubectl, on the README commands' PATH.
	kubectl string
)

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	// -short (make unit): no real node, and every test here needs it.
	if flag.Parse(); testing.Short() {
		fmt.Println("every test here needs the real node: none runs under -short")
		return 0
	}
	// A run killed before its cleanup must not count as this one's change.
	if err := devcluster.CleanupRealNode(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	before := devcluster.HostState()
	tmp, err := os.MkdirTemp("", "install-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)
	code := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		defer cancel()
		start := time.Now()
		kubectl = devcluster.KubectlBinary()
		if _, err := os.Stat(kubectl); err != nil {
			fmt.Fprintf(os.Stderr, "%s not built: run `make tools`\n", kubectl)
			return 1
		}
		values, commands, err := readme()
		if err != nil {
			fmt.Fprintln(os.Stderr, "install:", err)
			return 1
		}
		objs, err := renderChart(tmp, values)
		if err != nil {
			fmt.Fprintln(os.Stderr, "install:", err)
			return 1
		}
		tars, err := buildImages(tmp, objs)
		if err != nil {
			fmt.Fprintln(os.Stderr, "images:", err)
			return 1
		}
		built := time.Since(start)
		cluster, err = devcluster.Start(ctx, devcluster.Options{Node: devcluster.NodeReal, Images: tars, Dir: filepath.Join(tmp, "cluster")})
		if err != nil {
			fmt.Fprintln(os.Stderr, "devcluster:", err)
			return 1
		}
		defer func() {
			if err := cluster.StopChecked(); err != nil {
				fmt.Fprintln(os.Stderr, "devcluster stop:", err)
			}
		}()
		// The operator's ingress controller, there before aaas is.
		if front, err = cluster.InstallTraefik(ctx, traefikRef); err != nil {
			fmt.Fprintln(os.Stderr, "traefik:", err)
			dumpPods(devcluster.TraefikNamespace)
			return 1
		}
		up := time.Since(start)
		defer func() {
			if providerLn != nil {
				providerLn.Close()
			}
		}()
		installDir = filepath.Join(tmp, "install")
		if err := install(ctx, installDir, values, commands); err != nil {
			fmt.Fprintln(os.Stderr, "install:", err)
			dumpPods(controlNS)
			dumpPods(sandboxNS)
			return 1
		}
		fmt.Fprintf(os.Stderr, "images built in %s, real node up at %s, install rolled out at %s\n",
			built.Round(time.Millisecond), up.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		return m.Run()
	}()
	if after := devcluster.HostState(); after != before {
		fmt.Fprintf(os.Stderr, "the real node left the machine changed:\n%s", diff(before, after))
		return 1
	}
	return code
}

// readme returns README.md's Helm install: the operator's values (the
// yaml block that starts with "# values.yaml") and the shell commands that
// follow it, with the registry, host name and API server address replaced
// as an operator replaces them.
func readme() (values string, commands []string, err error) { return readmeBlock("values.yaml") }

// readmeBlock returns README.md's yaml block that starts with "# file"
// and the shell commands of the block that follows it, replaced as readme
// says.
func readmeBlock(file string) (values string, commands []string, err error) {
	b, err := os.ReadFile(filepath.Join(testenv.Root(), "README.md"))
	if err != nil {
		return "", nil, err
	}
	apiHost, _, _ := net.SplitHostPort(apiEndpoint)
	text := strings.NewReplacer("registry.example.com", registry, "aaas.example.com", domain, readmeAPICIDR, apiHost+"/32").Replace(string(b))
	blocks := regexp.MustCompile("(?s)```(yaml|sh)\n(.*?)```").FindAllStringSubmatch(text, -1)
	for i, bl := range blocks {
		if bl[1] == "yaml" && strings.HasPrefix(bl[2], "# "+file+"\n") && i+1 < len(blocks) && blocks[i+1][1] == "sh" {
			return bl[2], strings.Split(strings.TrimSpace(blocks[i+1][2]), "\n"), nil
		}
	}
	return "", nil, fmt.Errorf("README.md has no %s block followed by its commands", file)
}

// chartDir is the chart in the checkout under test.
func chartDir() string { return filepath.Join(testenv.Root(), manifests.Chart) }

// chartVersion is the release the checkout is (the chart's version).
func chartVersion() (string, error) {
	b, err := os.ReadFile(filepath.Join(chartDir(), "Chart.yaml"))
	if err != nil {
		return "", err
	}
	var c struct{ Version string }
	if err := yaml.Unmarshal(b, &c); err != nil || c.Version == "" {
		return "", fmt.Errorf("Chart.yaml's version: %v", err)
	}
	return c.Version, nil
}

// renderChart renders the chart with README's values (written into dir),
// as `helm install` would install it.
func renderChart(dir, values string) ([]*unstructured.Unstructured, error) {
	f := filepath.Join(dir, "values.yaml")
	if err := os.WriteFile(f, []byte(values), 0o600); err != nil {
		return nil, err
	}
	return manifests.RenderChart(devcluster.HelmBinary(), chartDir(), "aaas", controlNS, "-f", f)
}

// images lists the images the rendered install runs that come from the
// operator's registry.
func images(objs []*unstructured.Unstructured) map[string]bool {
	refs := map[string]bool{}
	re := regexp.MustCompile(`"image":"(` + regexp.QuoteMeta(registry) + `/[^"]+)"`)
	for _, o := range objs {
		b, _ := o.MarshalJSON()
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			refs[m[1]] = true
		}
	}
	return refs
}

// buildImages builds the aaas binaries and every image the install names
// (aaas, the DSH stand-in, NATS, agent-sandbox) plus the probes.
func buildImages(dir string, objs []*unstructured.Unstructured) ([]string, error) {
	var aaasRef, dshRef string
	for ref := range images(objs) {
		switch {
		case strings.HasPrefix(ref, registry+"/aaas:"):
			aaasRef = ref
		case strings.HasPrefix(ref, registry+"/dsh-web:"):
			dshRef = ref
		default:
			return nil, fmt.Errorf("the install names an image this test does not build: %s", ref)
		}
	}
	if aaasRef == "" || dshRef == "" {
		return nil, fmt.Errorf("the install does not name the aaas and DSH images from %s: %v", registry, images(objs))
	}
	bin := filepath.Join(dir, "bin")
	if err := image.BuildBinaries(bin); err != nil {
		return nil, err
	}
	tars, err := image.Install(bin, filepath.Join(dir, "images"), aaasRef, dshRef, devcluster.AgentSandboxBinary())
	if err != nil {
		return nil, err
	}
	// The same build as the next release, for the upgrade test.
	next := filepath.Join(dir, "images", "aaas-next.tar")
	if err := image.AAAS(bin, aaasRef[:strings.LastIndex(aaasRef, ":")+1]+nextTag).Write(next); err != nil {
		return nil, err
	}
	tars = append(tars, next)
	// DSH's next image, which a rollout takes existing sandboxes to.
	dshNext := filepath.Join(dir, "images", "dsh-web-next.tar")
	if err := image.DSHSim(bin, dshRef[:strings.LastIndex(dshRef, ":")+1]+dshNextTag).Write(dshNext); err != nil {
		return nil, err
	}
	tars = append(tars, dshNext)
	probe, err := image.Program(filepath.Join(dir, "images"), "github.com/aaas-project/aaas/test/e2e/install/netprobe", probeRef, image.NonRoot)
	if err != nil {
		return nil, err
	}
	modelProbe, err := image.Program(filepath.Join(dir, "images"), "github.com/aaas-project/aaas/test/e2e/install/modelprobe", modelProbeRef, image.NonRoot)
	if err != nil {
		return nil, err
	}
	curl, err := image.HostProgram(filepath.Join(dir, "images"), "/usr/bin/curl", curlRef, image.NonRoot)
	if err != nil {
		return nil, err
	}
	tars = append(tars, probe, modelProbe, curl)
	for _, tool := range []struct{ name, ref, bin string }{
		{"traefik", traefikRef, devcluster.TraefikBinary()},
		{"oauth2-proxy", oauth2ProxyRef, devcluster.OAuth2ProxyBinary()},
		{"oidcop", oidcRef, devcluster.OIDCProviderBinary()},
	} {
		tar := filepath.Join(dir, "images", tool.name+".tar")
		spec := image.Spec{Ref: tool.ref, Files: map[string]string{"/" + tool.name: tool.bin}, Entrypoint: []string{"/" + tool.name}, User: image.NonRoot}
		if err := spec.Write(tar); err != nil {
			return nil, err
		}
		tars = append(tars, tar)
	}
	return tars, nil
}

// remote maps what README's commands fetch from the network onto the local
// copies this test uses: agent-sandbox's release (rendered from the pinned
// module as the release asset is made) and this repository's clone at
// the release README pins, which must be the checkout's own (the checkout
// under test, linked where the clone would be, so what is tested is the
// working tree, uncommitted changes included).
func remote(dir string) (map[string]string, error) {
	version, err := chartVersion()
	if err != nil {
		return nil, err
	}
	objs, err := devcluster.AgentSandboxRelease()
	if err != nil {
		return nil, err
	}
	var release bytes.Buffer
	for _, o := range objs {
		b, err := yaml.Marshal(o.Object)
		if err != nil {
			return nil, err
		}
		release.WriteString("---\n")
		release.Write(b)
	}
	file := filepath.Join(dir, "sandbox-with-extensions.yaml")
	if err := os.WriteFile(file, release.Bytes(), 0o600); err != nil {
		return nil, err
	}
	return map[string]string{
		"https://github.com/kubernetes-sigs/agent-sandbox/releases/download/" + aaas.Version("AGENT_SANDBOX_VERSION") + "/sandbox-with-extensions.yaml":                                                                        file,
		fmt.Sprintf("git clone -q --depth 1 --branch v%[1]s https://github.com/aaas-project/aaas aaas-src 2>/dev/null || git -C aaas-src fetch -q --depth 1 origin tag v%[1]s && git -C aaas-src checkout -q v%[1]s", version): "ln -sfn " + testenv.Root() + " aaas-src",
	}, nil
}

// shell runs one command line as README's reader would, in dir, with the
// pinned kubectl and Helm on PATH and this cluster as their cluster.
func shell(ctx context.Context, dir, line string, env ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", line)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(kubectl)+":"+filepath.Dir(devcluster.HelmBinary())+":"+os.Getenv("PATH"), "KUBECONFIG="+cluster.Kubeconfig)
	cmd.Env = append(cmd.Env, env...)
	return cmd.CombinedOutput()
}

// install runs README's install commands as written, in a directory that
// holds the operator's values.yaml and the certificate files README makes
// the TLS Secrets from, then changes settings as README says an operator
// does (helm upgrade with new values: the idle timeout, so that idle
// suspend is observable, and the providers, the stand-in's address), and
// waits for every rollout and the warm pool.
func install(ctx context.Context, dir, values string, commands []string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "values.yaml"), []byte(values), 0o600); err != nil {
		return err
	}
	// README's certificates without cert-manager: files the operator
	// obtained (here from the test's CA), which README's commands turn
	// into the Secrets aaas-tls and aaas-sandboxes-tls the Ingress names.
	if err := certificates(dir); err != nil {
		return err
	}
	fetched, err := remote(filepath.Dir(dir))
	if err != nil {
		return err
	}
	used := map[string]bool{}
	for _, line := range commands {
		for from, to := range fetched {
			if strings.Contains(line, from) {
				line, used[from] = strings.ReplaceAll(line, from, to), true
			}
		}
		out, err := shell(ctx, dir, line, "DEEPSEEK_API_KEY="+providerKey)
		shown := out
		if strings.Contains(line, "get secret") {
			// README's last line prints the invite code: a credential.
			shown = []byte("(output withheld: it reads a Secret)\n")
		}
		fmt.Fprintf(os.Stderr, "$ %s\n%s", line, shown)
		if err != nil {
			return fmt.Errorf("README's command %q: %w", line, err)
		}
	}
	for from := range fetched {
		if !used[from] {
			return fmt.Errorf("README's install no longer fetches %s: update remote()", from)
		}
	}
	// The providers: the stand-in at a public address, as the deepseek
	// provider (README: list yours in broker.providers).
	ln, err := devcluster.ListenForPods(providerAddr)
	if err != nil {
		return err
	}
	providerLn = ln
	models = providersim.New(providersim.Options{Keys: []string{providerKey}, Slow: time.Second, TokenInterval: 50 * time.Millisecond})
	go func() { _ = http.Serve(ln, models) }()
	providers, _ := json.Marshal([]config.Provider{{Name: "deepseek", API: config.APIOpenAI, BaseURL: "http://" + providerAddr, Models: []string{"deepseek-chat"}}})
	// And helm test through the front door (README: tests.frontDoor),
	// verifying its certificate against the test CA.
	if out, err := shell(ctx, dir, "kubectl -n "+controlNS+" create secret generic aaas-test-ca --from-file=ca.crt=ca.crt"); err != nil {
		return fmt.Errorf("the test CA's Secret: %w: %s", err, out)
	}
	if out, err := helmUpgrade(ctx, dir, "--set", "config.IDLE_TIMEOUT="+idleTimeout, "--set-json", "broker.providers="+string(providers),
		"--set", "tests.frontDoor=traefik."+devcluster.TraefikNamespace+".svc:443", "--set", "tests.caSecret=aaas-test-ca"); err != nil {
		return fmt.Errorf("helm upgrade with the test's settings: %w: %s", err, out)
	}
	if err := cluster.WaitRollout(ctx, controlNS, 5*time.Minute); err != nil {
		return err
	}
	out, err := helmTest(ctx, dir)
	fmt.Fprintf(os.Stderr, "$ helm test aaas -n %s\n%s", controlNS, out)
	if err != nil || !strings.Contains(out, "ok: signed up") || !strings.Contains(out, "ok: deleted") || strings.Count(out, "is unreachable from this pod") != 2 {
		return fmt.Errorf("helm test through Traefik: %v", err)
	}
	s, err := cluster.Client.CoreV1().Secrets(controlNS).Get(ctx, "aaas-secrets", metav1.GetOptions{})
	if err != nil {
		return err
	}
	invite = string(s.Data["invite-code"])
	return waitPool(ctx, 3*time.Minute, "dsh-pool")
}

// helmUpgrade changes the install's values as an operator does after
// README's install: helm upgrade of the same chart, keeping the values
// given so far.
func helmUpgrade(ctx context.Context, dir string, args ...string) ([]byte, error) {
	line := "helm upgrade aaas " + chartDir() + " -n " + controlNS + " --reuse-values"
	for _, a := range args {
		line += " " + shellQuote(a)
	}
	out, err := shell(ctx, dir, line)
	fmt.Fprintf(os.Stderr, "$ %s\n%s", line, out)
	return out, err
}

// helmTest runs README's verify step, `helm test`, and returns its output
// with the test pods' logs, which Helm (--logs) finds only in the release's
// namespace while the tenants' preflight pod runs in theirs.
func helmTest(ctx context.Context, dir string) (string, error) {
	out, err := shell(ctx, dir, "helm test aaas -n "+controlNS+" --timeout 3m")
	logs := string(out)
	for _, p := range []struct{ ns, name string }{
		{controlNS, "aaas-test-signup"}, {controlNS, "aaas-test-preflight-control-plane"}, {sandboxNS, "aaas-test-preflight-tenants"},
	} {
		b, lerr := cluster.Client.CoreV1().Pods(p.ns).GetLogs(p.name, &corev1.PodLogOptions{}).DoRaw(ctx)
		if lerr == nil {
			logs += fmt.Sprintf("%s/%s: %s", p.ns, p.name, b)
		}
	}
	return logs, err
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// waitPool waits until each warm pool has its spares ready.
func waitPool(ctx context.Context, timeout time.Duration, pools ...string) error {
	_, ext, err := cluster.SandboxClients()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for _, name := range pools {
		for {
			p, err := ext.ExtensionsV1beta1().SandboxWarmPools(sandboxNS).Get(ctx, name, metav1.GetOptions{})
			if err == nil && p.Spec.Replicas != nil && p.Status.ReadyReplicas >= *p.Spec.Replicas {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("warm pool %s not ready: %v %+v", name, err, p)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	return nil
}

// dumpPods prints every pod's state and its containers' last log lines, for
// a failed install.
func dumpPods(ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return
	}
	for _, p := range pods.Items {
		fmt.Fprintf(os.Stderr, "pod %s/%s: %s\n", ns, p.Name, p.Status.Phase)
		for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			fmt.Fprintf(os.Stderr, "  %s ready=%v restarts=%d state=%+v\n", cs.Name, cs.Ready, cs.RestartCount, cs.State)
			tail := int64(10)
			b, _ := cluster.Client.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{Container: cs.Name, TailLines: &tail}).DoRaw(ctx)
			fmt.Fprintf(os.Stderr, "  %s\n", strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", "\n  "))
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func diff(a, b string) string {
	al, bl := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(a, "\n") {
		al[l] = true
	}
	for _, l := range strings.Split(b, "\n") {
		bl[l] = true
	}
	var out strings.Builder
	for _, l := range strings.Split(a, "\n") {
		if !bl[l] {
			fmt.Fprintf(&out, "- %s\n", l)
		}
	}
	for _, l := range strings.Split(b, "\n") {
		if !al[l] {
			fmt.Fprintf(&out, "+ %s\n", l)
		}
	}
	return out.String()
}

// sandboxDomain is the README's sandboxes.aaas.example.com as an operator
// replaces it (readme() substitutes the host name it lies under).
const sandboxDomain = "sandboxes." + domain

// origin is user's sandbox origin, as a browser reaches it through the
// ingress's wildcard rule.
func origin(user string) string { return "https://" + user + "." + sandboxDomain }

func bearer(tok string) []string { return []string{"Authorization", "Bearer " + tok} }

// signIn opens path on user's sandbox origin as a browser signed in on
// the gateway (gw holds that session) does: the navigation is sent to the
// gateway, which mints a code for that origin; the origin trades it for a
// host-only cookie of its own and sends the browser back to path. It
// returns a client for the origin holding that cookie (the jar is gw's:
// the browser's).
func signIn(t *testing.T, gw *testenv.Client, user, path string) *testenv.Client {
	t.Helper()
	s := gw.At(origin(user))
	r := s.Do("GET", path, nil, "Accept", "text/html")
	mint := gw.Base + "/_/signin/sandbox?next=" + url.QueryEscape(origin(user)+path)
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != mint {
		t.Fatalf("navigation to %s%s without its session: %d %q, want 303 to %s", origin(user), path, r.StatusCode, r.Header.Get("Location"), mint)
	}
	r = gw.Do("GET", strings.TrimPrefix(mint, gw.Base), nil, "Accept", "text/html")
	// (The code is a credential: failures name the link without it.)
	loc, err := url.Parse(r.Header.Get("Location"))
	if err != nil {
		t.Fatalf("the gateway's code for %s: %d, Location not a URL", origin(user), r.StatusCode)
	}
	if r.StatusCode != http.StatusSeeOther || loc.Scheme+"://"+loc.Host != origin(user) || loc.Path != "/_aaas/signin" || loc.Query().Get("code") == "" || loc.Query().Get("next") != path {
		t.Fatalf("the gateway's code for %s: %d to %s://%s%s next=%q %s", origin(user), r.StatusCode, loc.Scheme, loc.Host, loc.Path, loc.Query().Get("next"), r.Body)
	}
	trade := loc.RequestURI()
	r = s.Do("GET", trade, nil, "Accept", "text/html")
	if r.StatusCode != http.StatusSeeOther || r.Header.Get("Location") != path {
		t.Fatalf("trading the code: %d %q %s", r.StatusCode, r.Header.Get("Location"), r.Body)
	}
	var set *http.Cookie
	var names []string
	for _, ck := range r.Cookies() {
		names = append(names, ck.Name)
		if ck.Name == "__Host-aaas-sandbox" {
			set = ck
		}
	}
	// (Failures name the cookies' scope and flags, never a value.)
	if set == nil {
		t.Fatalf("no __Host-aaas-sandbox cookie from the trade; cookies set: %v", names)
	}
	if set.Domain != "" || set.Path != "/" || !set.Secure || !set.HttpOnly || set.SameSite != http.SameSiteLaxMode {
		t.Fatalf("the origin's session cookie: domain=%q path=%q secure=%v httponly=%v samesite=%v, want host-only, /, Secure, HttpOnly, Lax", set.Domain, set.Path, set.Secure, set.HttpOnly, set.SameSite)
	}
	// Single use: the same link again changes nothing.
	if r := s.Do("GET", trade, nil, "Accept", "text/html"); r.StatusCode != http.StatusBadRequest {
		t.Fatalf("a used code traded again: %d, want 400", r.StatusCode)
	}
	return s
}

// TestUserJourney is what a user does, in subdomain mode through the edge
// Service (as the ingress's two rules route it): sign up on the gateway,
// open the sandbox's own origin (the sign-in code trade), use it over
// HTTP, SSE and WebSocket (every request needs the DSH handshake
// lifecycle performed), leave it idle until it is suspended, come back and
// find the files, recreate it (which ends the origin's session), delete
// the account.
func TestUserJourney(t *testing.T) {
	front := ingress(t)
	c := client(t, front).WithTimeout(2 * time.Minute)
	tok := c.Signup("alice", invite)

	// The gateway serves no tenant byte: /u/alice/ is a redirect to the
	// origin, path and query kept.
	r := c.Do("GET", "/u/alice/api/files?x=1", nil)
	if r.StatusCode != http.StatusMovedPermanently || r.Header.Get("Location") != origin("alice")+"/api/files?x=1" {
		t.Fatalf("/u/alice/ on the gateway: %d %q, want 301 to the origin", r.StatusCode, r.Header.Get("Location"))
	}
	s := signIn(t, c, "alice", "/")
	// The page a browser is sent back to: the starting page until the
	// sandbox is Ready, then DSH's.
	testutil.Eventually(t, 2*time.Minute, func() error {
		if r := s.Do("GET", "/", nil, "Accept", "text/html"); r.StatusCode != http.StatusOK || !bytes.Contains(r.Body, []byte("<title>DSH Web")) {
			return fmt.Errorf("the origin's page: %d %.300s", r.StatusCode, r.Body)
		}
		return nil
	})
	// A sandbox origin serves nothing of the gateway's.
	if r := s.Do("GET", "/_/status", nil); r.StatusCode != http.StatusNotFound {
		t.Fatalf("/_/status on the origin: %d, want DSH's 404", r.StatusCode)
	}
	// DSH gets Host localhost:<pod port> (which it always trusts), the
	// origin as X-Forwarded-Host, and neither aaas cookie.
	r = s.Do("GET", "/api/echo", nil)
	var e struct {
		Host    string              `json:"host"`
		Headers map[string][]string `json:"headers"`
	}
	if err := json.Unmarshal(r.Body, &e); r.StatusCode != http.StatusOK || err != nil {
		t.Fatalf("echo: %d %v %s", r.StatusCode, err, r.Body)
	}
	cookies := strings.Join(e.Headers["Cookie"], ";")
	if !strings.HasPrefix(e.Host, "localhost:") || strings.Join(e.Headers["X-Forwarded-Host"], ",") != "alice."+sandboxDomain || strings.Contains(cookies, "aaas-sandbox") || strings.Contains(cookies, "dsh_gw_session") {
		t.Fatalf("DSH got Host %q, X-Forwarded-Host %q, Cookie %q", e.Host, e.Headers["X-Forwarded-Host"], cookies)
	}

	if r := s.Do("GET", "/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("files: %d %s", r.StatusCode, r.Body)
	}
	body := bytes.Repeat([]byte("kept across suspend "), 1000)
	if r := s.Do("PUT", "/api/files/notes.txt", bytes.NewReader(body)); r.StatusCode/100 != 2 {
		t.Fatalf("upload: %d %s", r.StatusCode, r.Body)
	}
	// A mutation with the ambient cookie from another origin (the
	// gateway's) is refused: only the origin's own pages may.
	if r := s.Do("PUT", "/api/files/cross.txt", strings.NewReader("x"), "Origin", c.Base); r.StatusCode != http.StatusForbidden {
		t.Fatalf("a PUT from the gateway's origin: %d, want 403", r.StatusCode)
	}
	sse(t, s)
	echo(t, s, front)
	// API clients: the account's bearer token works on the origin, no
	// cookie needed.
	if r := client(t, front).At(origin("alice")).Do("GET", "/api/files", nil, bearer(tok)...); r.StatusCode != http.StatusOK || !bytes.Contains(r.Body, []byte("notes.txt")) {
		t.Fatalf("bearer on the origin: %d %s", r.StatusCode, r.Body)
	}

	// Idle: nothing in flight, no requests for idleTimeout.
	phase := func() string {
		r := c.Do("GET", "/_/status", nil)
		p, _ := r.JSON()["phase"].(string)
		return p
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		if p := phase(); p != "Suspended" {
			return fmt.Errorf("phase %s", p)
		}
		return nil
	})
	if pods := userPods(t, "alice"); len(pods) != 0 {
		t.Fatalf("suspended, but %d pods remain", len(pods))
	}
	t.Logf("suspended after %s idle", idleTimeout)
	start := time.Now()
	r = s.Do("GET", "/api/files/notes.txt", nil)
	if r.StatusCode != http.StatusOK || !bytes.Equal(r.Body, body) {
		t.Fatalf("after wake: %d, %d bytes (want %d)", r.StatusCode, len(r.Body), len(body))
	}
	t.Logf("woken with files kept in %s", time.Since(start).Round(time.Millisecond))

	r = c.Do("POST", "/recreate", nil, "Accept", "application/json")
	if r.StatusCode != http.StatusAccepted {
		t.Fatalf("recreate: %d %s", r.StatusCode, r.Body)
	}
	// Recreate ends every session of the account, the origin's with it;
	// the gateway's new session signs the origin in again.
	if r := s.Do("GET", "/api/files", nil); r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("the origin's session after recreate: %d, want 401", r.StatusCode)
	}
	s = signIn(t, c, "alice", "/api/files")
	testutil.Eventually(t, 2*time.Minute, func() error {
		r := s.Do("GET", "/api/files", nil)
		if r.StatusCode != http.StatusOK {
			return fmt.Errorf("files after recreate: %d", r.StatusCode)
		}
		if bytes.Contains(r.Body, []byte("notes.txt")) {
			return fmt.Errorf("recreated workspace still has notes.txt: %s", r.Body)
		}
		return nil
	})

	claims := volumeClaims(t, "alice")
	if len(claims) == 0 {
		t.Fatal("alice has no volume claim")
	}
	if r := c.Do("DELETE", "/users/alice", nil, "Accept", "application/json"); r.StatusCode/100 != 2 {
		t.Fatalf("delete: %d %s", r.StatusCode, r.Body)
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		if p := userPods(t, "alice"); len(p) > 0 {
			return fmt.Errorf("%d pods remain", len(p))
		}
		for _, pvc := range claims {
			if _, err := cluster.Client.CoreV1().PersistentVolumeClaims(sandboxNS).Get(context.Background(), pvc.Name, metav1.GetOptions{}); err == nil {
				return fmt.Errorf("claim %s remains", pvc.Name)
			}
			if _, err := cluster.Client.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{}); err == nil {
				return fmt.Errorf("volume %s remains", pvc.Spec.VolumeName)
			}
		}
		return nil
	})
	if r := s.Do("GET", "/api/files", nil); r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("deleted account still served: %d", r.StatusCode)
	}
}

// sse reads a short event stream through the edge, on the origin s is for.
func sse(t *testing.T, s *testenv.Client) {
	t.Helper()
	req, _ := http.NewRequest("GET", s.Base+"/api/events?interval=200&count=3", nil)
	resp, err := s.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("events: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	events := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data:") {
			events++
		}
	}
	if events != 3 {
		t.Fatalf("%d events, want 3", events)
	}
}

// echo round-trips WebSocket messages through the edge, on the origin s
// is for, with its cookie and its own Origin; the same handshake naming
// the gateway's origin is refused.
func echo(t *testing.T, s *testenv.Client, front string) {
	t.Helper()
	d := websocket.Dialer{NetDialContext: dialTo(front), TLSClientConfig: &tls.Config{RootCAs: roots}, HandshakeTimeout: 30 * time.Second, Jar: s.HTTP.Jar}
	ws := "wss" + strings.TrimPrefix(s.Base, "https") + "/api/ws"
	// Refusals before the bridge are what a browser can see: the upgrade
	// accepted and closed at once with 4403.
	xs, _, err := d.Dial(ws, http.Header{"Origin": {"https://" + domain}})
	if err != nil {
		t.Fatalf("a WebSocket from the gateway's origin: %v, want it accepted and closed with 4403", err)
	}
	_ = xs.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, _, err = xs.ReadMessage()
	var ce *websocket.CloseError
	if xs.Close(); !errors.As(err, &ce) || ce.Code != 4403 {
		t.Fatalf("a WebSocket from the gateway's origin: %v, want close 4403", err)
	}
	conn, resp, err := d.Dial(ws, http.Header{"Origin": {s.Base}})
	if err != nil {
		status := 0
		if resp != nil {
			status = resp.StatusCode
		}
		t.Fatalf("websocket: %v (%d)", err, status)
	}
	defer conn.Close()
	for _, msg := range []string{"hello", "from the real node"} {
		if err := conn.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, got, err := conn.ReadMessage(); err != nil || string(got) != msg {
			t.Fatalf("echo: %q %v", got, err)
		}
	}
}

// userPods are the pods of user's sandbox.
func userPods(t *testing.T, user string) []corev1.Pod {
	t.Helper()
	pods, err := cluster.Client.CoreV1().Pods(sandboxNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=dsh-web"})
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Pod
	for _, p := range pods.Items {
		if owner(t, &p) == user {
			out = append(out, p)
		}
	}
	return out
}

// owner is the user whose claim owns the pod's Sandbox ("" for the pool's).
func owner(t *testing.T, p *corev1.Pod) string {
	t.Helper()
	sc, _, err := cluster.SandboxClients()
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range p.OwnerReferences {
		if ref.Kind != "Sandbox" {
			continue
		}
		sb, err := sc.AgentsV1beta1().Sandboxes(p.Namespace).Get(context.Background(), ref.Name, metav1.GetOptions{})
		if err != nil {
			return ""
		}
		for _, o := range sb.OwnerReferences {
			if o.Kind == "SandboxClaim" {
				return strings.TrimPrefix(o.Name, "dsh-")
			}
		}
	}
	return ""
}

// volumeClaims are the PersistentVolumeClaims user's pods mount.
func volumeClaims(t *testing.T, user string) []*corev1.PersistentVolumeClaim {
	t.Helper()
	var out []*corev1.PersistentVolumeClaim
	for _, p := range userPods(t, user) {
		for _, v := range p.Spec.Volumes {
			if v.PersistentVolumeClaim == nil {
				continue
			}
			pvc, err := cluster.Client.CoreV1().PersistentVolumeClaims(sandboxNS).Get(context.Background(), v.PersistentVolumeClaim.ClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, pvc)
		}
	}
	return out
}
