//go:build tools

// Package tools pins the Kubernetes control-plane binaries that
// internal/devcluster runs. It is a separate module because k8s.io/kubernetes
// cannot be required without replacing every staging module, and those
// replacements must not leak into the main module.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
)
