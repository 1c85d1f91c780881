//go:build tools

// Package tools pins staticcheck for `make lint`.
package tools

import _ "honnef.co/go/tools/cmd/staticcheck"
