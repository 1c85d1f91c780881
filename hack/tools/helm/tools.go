//go:build tools

// Package tools pins the Helm CLI the chart tests render and install
// charts/aaas with (hack/tools.sh builds it into the tools cache).
package tools

import _ "helm.sh/helm/v4/cmd/helm"
