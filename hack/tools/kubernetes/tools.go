//go:build tools

// Package tools pins the Kubernetes binaries that internal/dev/devcluster runs:
// the control plane, the real node's kubelet, kube-proxy and
// kube-scheduler, and kubectl for the deployment tier. It is a separate module because k8s.io/kubernetes
// cannot be required without replacing every staging module, and those
// replacements must not leak into the main module.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
