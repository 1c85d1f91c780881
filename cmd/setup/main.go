// Command setup is the provisioning step of an install and of every
// upgrade: with the setup identity, the only one allowed to, it creates or
// updates the streams, buckets and the commands' consumer the other
// processes only check for, then exits. It runs as lifecycle's init
// container; see the README for its configuration. `setup
// credentials-keygen` instead prints a new key pair for BYOK
// (CREDENTIALS_KEYS for the brokers, CREDENTIALS_PUBLIC_KEY for the edges)
// and exits.
package main

import (
	"os"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/process"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "credentials-keygen" {
		if err := credentials.WriteKeygen(os.Stdout); err != nil {
			process.Fatal("setup credentials-keygen", err)
		}
		return
	}
	cfg, err := config.LoadSetup(config.FromOS())
	if err == nil {
		err = process.Setup(cfg)
	}
	if err != nil {
		process.Fatal("setup", err)
	}
}
