// Command sweeper is the aaas sweeper process; see the README for its configuration.
package main

import (
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/process"
)

func main() {
	cfg, err := config.LoadSweeper(config.FromOS())
	if err != nil {
		process.Fatal("sweeper", err)
	}
	p, err := process.Start("sweeper", cfg.Common)
	if err != nil {
		process.Fatal("sweeper", err)
	}
	defer p.Close()
	p.SetReady(func() bool { return true })
	<-p.Ctx.Done()
}
