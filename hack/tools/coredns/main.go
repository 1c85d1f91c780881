// Command coredns is CoreDNS with only the plugins the real-node devcluster
// uses (bind, errors, health, ready, kubernetes): the full build
// pulls in every cloud SDK and takes several minutes longer. It is a
// separate module so CoreDNS's dependencies never reach the main module.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"

	"github.com/coredns/coredns/coremain"
)

func main() { coremain.Run() }
