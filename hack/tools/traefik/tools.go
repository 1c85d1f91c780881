//go:build tools

// Package tools pins Traefik, the ingress controller the deployment tier
// serves the install's Ingress through (a test-bed part, never deployed
// by aaas). A separate module keeps its dependencies out of aaas.
package tools

import _ "github.com/traefik/traefik/v3/cmd/traefik"
