// Command image builds, without Docker, the images an aaas install needs
// from the static binaries of `make build`: aaas (what the Dockerfile
// builds), the DSH stand-in (dshsim, started with the SandboxTemplate's
// args), NATS from its module and the agent-sandbox controller, as
// docker-archive tarballs tagged as the manifests name them: load them with
// `docker load -i` or `ctr -n k8s.io images import`.
//
//	go run ./hack/image [-bin bin] [-out bin/images] [-aaas registry.local/aaas:dev] [-dsh registry.local/dsh-web:dev]
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/image"
)

func main() {
	bin := flag.String("bin", "bin", "directory with the static binaries (make build)")
	out := flag.String("out", "bin/images", "where the tarballs go")
	aaasRef := flag.String("aaas", "registry.local/aaas:dev", "name of the aaas image")
	dshRef := flag.String("dsh", "registry.local/dsh-web:dev", "name of the DSH stand-in image")
	flag.Parse()
	tars, err := image.Install(*bin, *out, *aaasRef, *dshRef, devcluster.AgentSandboxBinary())
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
	for _, t := range tars {
		fmt.Println(t)
	}
}
