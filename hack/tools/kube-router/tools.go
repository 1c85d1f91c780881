//go:build tools

// Package tools pins kube-router, which the real-node devcluster runs in
// firewall-only mode as its NetworkPolicy enforcer (this kernel lacks the
// nftables queue that kube-network-policies needs). It is a test-bed part,
// never deployed. A separate module keeps its dependencies out of aaas.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
