// Command edge serves browsers and API clients: the landing page, accounts
// and sessions, and the proxy to each user's sandbox. It holds no
// Kubernetes credentials; see the README for its configuration.
package main

import (
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/edge"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/process"
)

func main() {
	cfg, err := config.LoadEdge(config.FromOS())
	process.Main(natsauth.Edge, cfg.Common, err, func(p *process.Process) error {
		e, err := edge.New(p, cfg)
		if err != nil {
			return err
		}
		return e.Serve()
	})
}
