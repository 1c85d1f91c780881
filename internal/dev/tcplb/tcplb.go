// Package tcplb relays TCP connections, each to the next backend that
// accepts it, as a Kubernetes Service spreads connections over its
// endpoints: make run NODE=real puts the edge Service on local ports with
// it, and tests put it in front of edge or broker replicas (a dead one is
// skipped). Like a Service, it keeps the client's address: a loopback
// client's connection to the backend is made from that same address (the
// broker attributes calls by it).
package tcplb

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Balancer is a listening relay.
type Balancer struct {
	ln       net.Listener
	backends []string
	next     atomic.Uint64
	wg       sync.WaitGroup
}

// Listen relays connections to addr (host:port; port 0 picks one) over
// backends (host:port).
func Listen(addr string, backends ...string) (*Balancer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	b := &Balancer{ln: ln, backends: backends}
	b.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go b.relay(c)
		}
	})
	return b, nil
}

// Addr is the address the balancer listens on.
func (b *Balancer) Addr() string { return b.ln.Addr().String() }

// Close stops accepting; relayed connections end with their peers.
func (b *Balancer) Close() {
	b.ln.Close()
	b.wg.Wait()
}

func (b *Balancer) relay(c net.Conn) {
	defer c.Close()
	d := net.Dialer{Timeout: 5 * time.Second}
	if ra, ok := c.RemoteAddr().(*net.TCPAddr); ok && ra.IP.IsLoopback() {
		d.LocalAddr = &net.TCPAddr{IP: ra.IP}
	}
	var up net.Conn
	for i := 0; i < len(b.backends) && up == nil; i++ {
		addr := b.backends[int(b.next.Add(1))%len(b.backends)]
		up, _ = d.Dial("tcp", addr)
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
