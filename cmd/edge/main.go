// Command edge is the aaas edge process; see the README for its configuration.
package main

import (
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/process"
)

func main() {
	cfg, err := config.LoadEdge(config.FromOS())
	if err != nil {
		process.Fatal("edge", err)
	}
	p, err := process.Start("edge", cfg.Common)
	if err != nil {
		process.Fatal("edge", err)
	}
	defer p.Close()
	p.SetReady(func() bool { return true })
	<-p.Ctx.Done()
}
