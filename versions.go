// Package aaas exposes the pinned versions in versions.env to Go code, so
// the file stays the single place a version is written.
package aaas

import (
	_ "embed"
	"strings"
)

//go:embed versions.env
var versionsEnv string

// Version returns the value of name in versions.env, or "" if absent.
func Version(name string) string {
	for _, line := range strings.Split(versionsEnv, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if ok && k == name {
			return v
		}
	}
	return ""
}
