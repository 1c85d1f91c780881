//go:build tools

// Package tools pins oauth2-proxy, the single sign-on proxy the
// deployment tier puts in front of the edge for the gateway-sso exposure
// (a test-bed part: the chart deploys the operator's own oauth2-proxy
// image). A separate module keeps its dependencies out of aaas.
package tools

import _ "github.com/oauth2-proxy/oauth2-proxy/v7"
