package testenv

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// Balancer is a TCP load balancer in front of edge replicas, like the
// Service in front of the edge Deployment: each new connection goes to the
// next backend that accepts it, so a dead edge is skipped.
type Balancer struct {
	ln       net.Listener
	backends []string
	next     atomic.Uint64
	wg       sync.WaitGroup
}

// NewBalancer listens on a free port and spreads connections over
// backends (host:port).
func NewBalancer(t testing.TB, backends ...string) *Balancer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &Balancer{ln: ln, backends: backends}
	b.wg.Add(1)
	go b.serve()
	t.Cleanup(func() { ln.Close(); b.wg.Wait() })
	return b
}

// URL is http://host:port of the balancer.
func (b *Balancer) URL() string { return "http://" + b.ln.Addr().String() }

func (b *Balancer) serve() {
	defer b.wg.Done()
	for {
		c, err := b.ln.Accept()
		if err != nil {
			return
		}
		go b.relay(c)
	}
}

func (b *Balancer) relay(c net.Conn) {
	defer c.Close()
	var up net.Conn
	for i := 0; i < len(b.backends) && up == nil; i++ {
		addr := b.backends[int(b.next.Add(1))%len(b.backends)]
		up, _ = net.Dial("tcp", addr)
	}
	if up == nil {
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
}
