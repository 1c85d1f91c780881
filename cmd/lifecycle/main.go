// Command lifecycle is the aaas lifecycle process; see the README for its configuration.
package main

import (
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/process"
)

func main() {
	cfg, err := config.LoadLifecycle(config.FromOS())
	if err != nil {
		process.Fatal("lifecycle", err)
	}
	p, err := process.Start("lifecycle", cfg.Common)
	if err != nil {
		process.Fatal("lifecycle", err)
	}
	defer p.Close()
	<-p.Ctx.Done()
}
