package aaas

import "embed"

// Manifests holds manifests/, so tools and tests apply exactly what
// operators deploy.
//
//go:embed manifests
var Manifests embed.FS
