//go:build tools

// Package tools pins Caddy, a Go reverse proxy `make bench` measures the
// edge against (a benchmark peer, never deployed by aaas). A separate
// module keeps its dependencies out of aaas.
package tools

import _ "github.com/caddyserver/caddy/v2/cmd/caddy"
