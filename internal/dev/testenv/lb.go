package testenv

import (
	"testing"

	"github.com/aaas-project/aaas/internal/dev/tcplb"
)

// Balancer is a TCP load balancer in front of edge replicas, like the
// Service in front of the edge Deployment: each new connection goes to the
// next backend that accepts it, so a dead edge is skipped.
type Balancer struct{ *tcplb.Balancer }

// NewBalancer listens on addr (from Stack.FrontAddr, so the edges serve
// it as a public host) and spreads connections over backends (host:port);
// it closes when the test ends.
func NewBalancer(t testing.TB, addr string, backends ...string) *Balancer {
	t.Helper()
	b, err := tcplb.Listen(addr, backends...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return &Balancer{b}
}

// URL is http://host:port of the balancer.
func (b *Balancer) URL() string { return "http://" + b.Addr() }
