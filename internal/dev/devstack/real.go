package devstack

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/manifests"
	"github.com/aaas-project/aaas/internal/dev/tcplb"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natstls"
)

// The images a real-node stack builds and runs.
const (
	aaasRef = "registry.local/aaas:dev"
	dshRef  = "registry.local/dsh-web:dev"
)

// realKustomization is the README's install with this stack's images (the
// API server's address needs no patch here: it is the node's, a private
// address no sandbox reaches anyway).
const realKustomization = `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ` + manifests.Source + `base
  - ` + manifests.Source + `sandbox
components:
  - ` + manifests.Source + `exposure/ingress
images:
  - name: ghcr.io/aaas-project/aaas
    newName: registry.local/aaas
    newTag: dev
  - name: dsh-web
    newName: registry.local/dsh-web
    newTag: dev
`

// runReal installs the stack on a real node as README's install does:
// images, agent-sandbox, the two namespaces, the Secrets (NATS identities
// and TLS, handshake keys and invite) and ConfigMaps, the install itself
// with the operator's settings in aaas-config, and local ports forwarded
// to the edge Service.
func runReal(ctx context.Context, o Options, start time.Time) error {
	fmt.Fprintln(o.Out, "building images (aaas, DSH stand-in, NATS, agent-sandbox)…")
	tars, err := image.Install(o.BinDir, filepath.Join(o.StateDir, "images"), aaasRef, dshRef, devcluster.AgentSandboxBinary())
	if err != nil {
		return err
	}
	fmt.Fprintln(o.Out, "starting the local control plane and a real node (containerd, kubelet, kube-proxy, kube-router, CoreDNS)…")
	cluster, err := devcluster.Start(ctx, devcluster.Options{Node: devcluster.NodeReal, Dir: filepath.Join(o.StateDir, "devcluster"), Images: tars, Log: o.Log})
	if err != nil {
		return fmt.Errorf("start devcluster: %w", err)
	}
	defer cluster.Stop()
	fmt.Fprintln(o.Out, "installing agent-sandbox and aaas…")
	if err := cluster.InstallAgentSandbox(ctx); err != nil {
		return err
	}
	for _, ns := range []string{ControlPlaneNamespace, SandboxNamespace} {
		if err := cluster.CreateNamespace(ctx, ns); err != nil {
			return err
		}
	}
	settings := map[string]string{
		// Plain HTTP on localhost.
		"COOKIE_SECURE": "false", "ALLOW_INSECURE_COOKIES": "1",
	}
	for k, v := range o.settings() {
		settings[k] = v
	}
	invite := settings["SIGNUP_INVITE_CODE"]
	if invite == "" {
		invite = randomString(9)
	}
	key := settings["HANDSHAKE_KEYS"]
	if key == "" {
		key = randomKey()
	}
	// Secrets go where the manifests read them from, not into the ConfigMap.
	delete(settings, "SIGNUP_INVITE_CODE")
	delete(settings, "HANDSHAKE_KEYS")
	core := cluster.Client.CoreV1()
	natsCreds, err := natsauth.SecretData()
	if err != nil {
		return err
	}
	natsTLS, err := natstls.SecretData(ControlPlaneNamespace)
	if err != nil {
		return err
	}
	for name, data := range map[string]map[string][]byte{"aaas-nats": natsCreds, natstls.SecretName: natsTLS} {
		if _, err := core.Secrets(ControlPlaneNamespace).Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: name}, Data: data,
		}, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	if _, err := core.Secrets(ControlPlaneNamespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "aaas-secrets"},
		StringData: map[string]string{"handshake-keys": key, "invite-code": invite},
	}, metav1.CreateOptions{}); err != nil {
		return err
	}
	// ConfigMap dsh-web as README's install makes it: the edge's host names
	// (PUBLIC_HOSTS) and SANDBOX_DOMAIN in the control plane's namespace.
	// Every local port reaches the same edges, so the sandboxes' origins
	// are under the first. DSH reads the host names (DSH_TRUSTED_HOSTS)
	// in path mode only: with sandbox origins the edge sends it Host
	// localhost, which it always trusts.
	domain := o.sandboxDomain(settings, o.EdgePorts[0])
	delete(settings, "SANDBOX_DOMAIN")
	configs := map[string]map[string]string{ControlPlaneNamespace: {"trusted-hosts": publicHosts(o.EdgePorts), "sandbox-domain": domain}}
	if domain == "" {
		configs[SandboxNamespace] = map[string]string{"trusted-hosts": publicHosts(o.EdgePorts)}
	}
	for ns, data := range configs {
		if _, err := core.ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: "dsh-web"}, Data: data,
		}, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	objs, err := manifests.RenderKustomization(realKustomization)
	if err != nil {
		return err
	}
	for _, cm := range manifests.Pick(objs, "ConfigMap") {
		if cm.GetName() != "aaas-config" {
			continue
		}
		data := cm.Object["data"].(map[string]any)
		for k, v := range settings {
			data[k] = v
		}
	}
	// Every object names its namespace (base's or sandbox's).
	if err := cluster.Apply(ctx, "", objs...); err != nil {
		return err
	}
	if err := cluster.WaitRollout(ctx, ControlPlaneNamespace, 5*time.Minute); err != nil {
		return err
	}
	svc, err := core.Services(ControlPlaneNamespace).Get(ctx, "aaas-edge", metav1.GetOptions{})
	if err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "Kubernetes %s\n           kubectl --kubeconfig %s -n %s get sandboxes,pods\n", cluster.Config.Host, cluster.Kubeconfig, SandboxNamespace)
	// Local ports forwarded to the edge Service, as a load balancer in
	// front of the cluster would.
	target := net.JoinHostPort(svc.Spec.ClusterIP, "8080")
	for _, port := range o.EdgePorts {
		lb, err := tcplb.Listen(fmt.Sprintf("127.0.0.1:%d", port), target)
		if err != nil {
			return err
		}
		defer lb.Close()
	}
	if err := waitPool(ctx, cluster); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "logs       kubectl --kubeconfig %s -n %s logs deploy/aaas-edge\n", cluster.Kubeconfig, ControlPlaneNamespace)
	info := Info{Kubeconfig: cluster.Kubeconfig, Invite: invite}
	for range o.EdgePorts {
		info.SandboxDomains = append(info.SandboxDomains, domain)
	}
	o.ready(info, start)
	<-ctx.Done()
	fmt.Fprintln(o.Out, "stopping…")
	return nil
}

func waitPool(ctx context.Context, c *devcluster.Cluster) error {
	_, ext, err := c.SandboxClients()
	if err != nil {
		return err
	}
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := ext.ExtensionsV1beta1().SandboxWarmPools(SandboxNamespace).Get(ctx, "dsh-pool", metav1.GetOptions{})
		return err == nil && p.Spec.Replicas != nil && p.Status.ReadyReplicas >= *p.Spec.Replicas, nil
	})
}

// publicHosts are the names a browser on this machine uses for the local
// ports: DSH trusts localhost anyway, the edge serves exactly these.
func publicHosts(ports []int) string {
	var hosts []string
	for _, p := range ports {
		hosts = append(hosts, fmt.Sprintf("localhost:%d", p), fmt.Sprintf("127.0.0.1:%d", p))
	}
	return strings.Join(hosts, ",")
}
