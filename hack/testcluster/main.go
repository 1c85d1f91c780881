// Command testcluster runs one simulated-node devcluster for the command
// after it and every test process that command starts (`make test`:
// testcluster go test ./...), so the integration packages share one
// control plane instead of starting one each; each test still gets its
// own namespace and NATS server.
package main

import (
	"os"

	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
)

func main() {
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	os.Exit(devclustertest.Serve(args))
}
