//go:build tools

// Package tools pins the agent-sandbox controller that internal/dev/devcluster
// runs. It is its own module so the controller builds against exactly the
// dependency versions it was released with, not the gateway's.
package tools

import _ "sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller"
