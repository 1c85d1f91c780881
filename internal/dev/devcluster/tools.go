package devcluster

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/aaas-project/aaas"
)

// toolsCache is where `make tools` puts the binaries, keyed by version.
func toolsCache() string {
	if d := os.Getenv("AAAS_TOOLS_CACHE"); d != "" {
		return d
	}
	base := os.Getenv("XDG_CACHE_HOME")
	if base == "" {
		home, _ := os.UserHomeDir()
		base = filepath.Join(home, ".cache")
	}
	return filepath.Join(base, "aaas", "tools")
}

// binaries locates every executable the control plane needs and says how
// to get the missing ones.
type binaries struct {
	etcd, apiserver, controllerManager, agentSandbox string
	// The real node's.
	kubelet, kubeProxy, scheduler, kubeRouter, coreDNS string
}

func findBinaries() (binaries, error) {
	cache := toolsCache()
	k8s := filepath.Join(cache, "kubernetes-control-"+aaas.Version("KUBERNETES_VERSION"))
	node := filepath.Join(cache, "kubernetes-node-"+aaas.Version("KUBERNETES_VERSION"))
	b := binaries{
		apiserver:         filepath.Join(k8s, "kube-apiserver"),
		controllerManager: filepath.Join(k8s, "kube-controller-manager"),
		agentSandbox:      AgentSandboxBinary(),
		kubelet:           filepath.Join(node, "kubelet"),
		kubeProxy:         filepath.Join(node, "kube-proxy"),
		scheduler:         filepath.Join(node, "kube-scheduler"),
		kubeRouter:        filepath.Join(cache, "kube-router-"+aaas.Version("KUBE_ROUTER_VERSION"), "kube-router"),
		coreDNS:           filepath.Join(cache, "coredns-"+aaas.Version("COREDNS_VERSION"), "coredns"),
	}
	etcd, err := exec.LookPath("etcd")
	if err != nil {
		return b, fmt.Errorf("etcd not found on PATH: run `make tools` (installs Debian's etcd-server)")
	}
	b.etcd = etcd
	for _, p := range []string{b.apiserver, b.controllerManager, b.agentSandbox} {
		if _, err := os.Stat(p); err != nil {
			return b, fmt.Errorf("%s not built: run `make tools`", p)
		}
	}
	return b, nil
}

// AgentSandboxBinary is the agent-sandbox controller `make tools` built
// from the pinned module (the real node runs it from an image of it).
func AgentSandboxBinary() string {
	return filepath.Join(toolsCache(), "agent-sandbox-"+aaas.Version("AGENT_SANDBOX_VERSION"), "agent-sandbox-controller")
}

// KubectlBinary is kubectl at the pinned Kubernetes version, which `make
// tools` builds (the deployment tier runs README's commands with it).
func KubectlBinary() string {
	return filepath.Join(toolsCache(), "kubectl-"+aaas.Version("KUBERNETES_VERSION"), "kubectl")
}

// HelmBinary is the Helm CLI at HELM_VERSION, which `make tools` builds
// (the chart's tests render and install charts/aaas with it).
func HelmBinary() string {
	return filepath.Join(toolsCache(), "helm-"+aaas.Version("HELM_VERSION"), "helm")
}

// ModuleDir returns the source of a pinned Go module (for the CRDs it
// ships), downloading it through the Go module proxy if needed.
func ModuleDir(path, version string) (string, error) {
	mod := path + "@" + version
	out, err := exec.Command("go", "mod", "download", "-json", mod).Output()
	if err != nil {
		return "", fmt.Errorf("go mod download %s: %w", mod, err)
	}
	var info struct{ Dir, Error string }
	if err := json.Unmarshal(out, &info); err != nil {
		return "", fmt.Errorf("go mod download %s: %w", mod, err)
	}
	if info.Error != "" || info.Dir == "" {
		return "", fmt.Errorf("go mod download %s: %s", mod, info.Error)
	}
	return info.Dir, nil
}
