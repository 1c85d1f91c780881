// Command setup is the provisioning step of an install and of every
// upgrade: with the setup identity, the only one allowed to, it creates or
// updates the streams, buckets and the commands' consumer the other
// processes only check for, then exits. It runs as lifecycle's init
// container; see the README for its configuration.
package main

import (
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/process"
)

func main() {
	cfg, err := config.LoadSetup(config.FromOS())
	if err == nil {
		err = process.Setup(cfg)
	}
	if err != nil {
		process.Fatal("setup", err)
	}
}
