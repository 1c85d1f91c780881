//go:build tools

// Package tools pins Docker Compose v2, which the deployment tier runs
// compose.yaml with against a Docker engine from Debian's docker.io (a
// development tool, never deployed by aaas). A separate module keeps its
// dependencies out of aaas.
package tools

import _ "github.com/docker/compose/v2/cmd"
