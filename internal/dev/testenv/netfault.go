package testenv

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// Faults puts a TCP fault proxy (Shopify's toxiproxy, embedded) between
// each process and each NATS node, so a test can cut, blackhole, slow or
// reset one process's bus while the others keep theirs.
type Faults struct {
	t      testing.TB
	server *toxiproxy.ApiServer
	mu     sync.Mutex
	links  map[string][]*toxiproxy.Proxy // by process instance
}

// NewFaults starts the fault proxy server; its links close when the test
// ends.
func NewFaults(t testing.TB) *Faults {
	f := &Faults{t: t, server: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop()), links: map[string][]*toxiproxy.Proxy{}}
	t.Cleanup(func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, ps := range f.links {
			for _, p := range ps {
				p.Stop()
			}
		}
	})
	return f
}

// Links gives instance its own proxy to each of upstreams (host:port) and
// returns their URLs as NATS_URL (nats://host:port, comma-separated); the
// same instance gets the same links again (a restarted process keeps its
// path to the bus).
func (f *Faults) Links(instance string, upstreams []string) string {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.links[instance]; !ok {
		for i, up := range upstreams {
			p := toxiproxy.NewProxy(f.server, fmt.Sprintf("%s-%d", instance, i), FreeAddr(f.t), up)
			if err := p.Start(); err != nil {
				f.t.Fatal(err)
			}
			f.links[instance] = append(f.links[instance], p)
		}
	}
	var urls []string
	for _, p := range f.links[instance] {
		urls = append(urls, "nats://"+p.Listen)
	}
	return strings.Join(urls, ",")
}

func (f *Faults) of(instance string) []*toxiproxy.Proxy {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	ps, ok := f.links[instance]
	if !ok {
		f.t.Fatalf("no fault links for %s", instance)
	}
	return ps
}

// Cut closes instance's connections to every node and refuses new ones
// until Restore, as a network partition the host notices does. The
// listener stays open through the cut: were it closed, an outgoing
// connection could take its port as an ephemeral one and Restore could
// not listen there again. A reset toxic answers each new connection with
// a TCP reset as soon as the node greets it; the proxy's restart, whose
// listener is back at once, drops the connections already open.
func (f *Faults) Cut(instance string) {
	f.t.Helper()
	f.toxic(instance, `{"name":"cut-%s","type":"reset_peer","stream":"%s","attributes":{"timeout":0}}`)
	for _, p := range f.of(instance) {
		p.Stop()
		if err := p.Start(); err != nil {
			f.t.Fatal(err)
		}
	}
}

// Blackhole keeps instance's connections open but lets nothing through in
// either direction, as a partition nobody notices does, until Restore.
func (f *Faults) Blackhole(instance string) {
	f.toxic(instance, `{"name":"blackhole-%s","type":"timeout","stream":"%s","attributes":{"timeout":0}}`)
}

// Latency delays everything instance sends and receives by d, until
// Restore.
func (f *Faults) Latency(instance string, d time.Duration) {
	f.toxic(instance, `{"name":"latency-%s","type":"latency","stream":"%s","attributes":{"latency":`+fmt.Sprint(d.Milliseconds())+`}}`)
}

// Reset ends instance's open connections with a TCP reset; the process
// reconnects at once.
func (f *Faults) Reset(instance string) {
	f.toxic(instance, `{"name":"reset-%s","type":"reset_peer","stream":"%s","attributes":{"timeout":0}}`)
	time.Sleep(100 * time.Millisecond)
	f.Restore(instance)
}

func (f *Faults) toxic(instance, format string) {
	f.t.Helper()
	for _, p := range f.of(instance) {
		for _, dir := range []string{"upstream", "downstream"} {
			if _, err := p.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(format, dir, dir))); err != nil {
				f.t.Fatal(err)
			}
		}
	}
}

// Restore ends every fault of instance.
func (f *Faults) Restore(instance string) {
	f.t.Helper()
	for _, p := range f.of(instance) {
		p.Toxics.ResetToxics(context.Background())
	}
}
