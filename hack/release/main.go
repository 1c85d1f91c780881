// Command release cuts a release of aaas from this checkout into a
// directory (package release says what it holds):
//
//	go run ./hack/release -version 0.2.0 [-out dist/v0.2.0]
//
// `make release VERSION=x.y.z` runs it. The checkout must already say the
// version (CHANGELOG.md's section, the chart, the kustomize image tag).
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/aaas-project/aaas/internal/dev/release"
)

func main() {
	version := flag.String("version", "", "the release, x.y.z")
	out := flag.String("out", "", "where the release goes (default dist/v<version>)")
	flag.Parse()
	if *out == "" {
		*out = "dist/v" + *version
	}
	root, err := os.Getwd()
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
	r, err := release.Build(release.Options{Version: *version, Root: root, Out: *out, Log: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
	fmt.Printf("image %s:%s@%s\n", release.Repository, *version, r.Digest)
	for _, f := range r.Files {
		fmt.Printf("%s/%s\n", *out, f)
	}
}
