// Package embednats runs a real NATS server with JetStream inside the
// process: single node for `make run` and tests, or a cluster of nodes on
// loopback for failover tests.
package embednats

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Options configures one node.
type Options struct {
	// Dir holds the JetStream store.
	Dir string
	// Host and Port to listen on; Port 0 picks a free port.
	Host string
	Port int
	Name string
	// ClusterName, ClusterPort and Routes join the node to a cluster.
	ClusterName string
	ClusterPort int
	Routes      []string
	// NoAdvertise keeps the node from telling clients the other nodes'
	// addresses, so a client uses only the URLs it was given (each
	// process's fault proxies, in the fault tests).
	NoAdvertise bool
	// Users, when set, are the only clients the server admits (nkey
	// users with their permissions: natsauth.Identities.Users); otherwise
	// anyone may connect.
	Users []*server.NkeyUser
	// TLS, when set, is the server's TLS for clients (required).
	TLS *tls.Config
	// Debug turns on the server's own logging.
	Debug bool
	// MaxStore is the JetStream store's max_file_store; 0 is 6 GiB,
	// which the development sizing's caps fit (README, Sizing).
	MaxStore int64
}

// Server is a running embedded node.
type Server struct {
	*server.Server
	opts Options
}

// Start runs a node and waits until it accepts clients.
func Start(o Options) (*Server, error) {
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Port == 0 {
		p, err := FreePort()
		if err != nil {
			return nil, err
		}
		o.Port = p
	}
	if o.Name == "" {
		o.Name = fmt.Sprintf("aaas-%d", o.Port)
	}
	so := &server.Options{
		ServerName: o.Name,
		Host:       o.Host,
		Port:       o.Port,
		JetStream:  true,
		StoreDir:   filepath.Join(o.Dir, "jetstream"),
		NoSigs:     true,
		NoLog:      !o.Debug,
		// Keep cluster elections snappy on loopback.
		JetStreamMaxMemory: 256 << 20,
		JetStreamMaxStore:  cmp.Or(o.MaxStore, 6<<30),
		Nkeys:              o.Users,
		TLS:                o.TLS != nil,
		TLSConfig:          o.TLS,
	}
	if o.ClusterName != "" {
		so.Cluster = server.ClusterOpts{Name: o.ClusterName, Host: o.Host, Port: o.ClusterPort, NoAdvertise: o.NoAdvertise}
		for _, r := range o.Routes {
			u, err := url.Parse(r)
			if err != nil {
				return nil, fmt.Errorf("route %q: %w", r, err)
			}
			so.Routes = append(so.Routes, u)
		}
	}
	s, err := server.NewServer(so)
	if err != nil {
		return nil, fmt.Errorf("nats server %s: %w", o.Name, err)
	}
	if o.Debug {
		s.ConfigureLogger()
	}
	go s.Start()
	if !s.ReadyForConnections(30 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("nats server %s: not ready after 30s", o.Name)
	}
	return &Server{Server: s, opts: o}, nil
}

// URL is the client URL.
func (s *Server) URL() string { return fmt.Sprintf("nats://%s:%d", s.opts.Host, s.opts.Port) }

// Dir is the directory of the node's JetStream store.
func (s *Server) Dir() string { return s.opts.Dir }

// Restart starts a stopped node again with the same ports and store.
func (s *Server) Restart() (*Server, error) { return Start(s.opts) }

// Stop shuts the node down and waits until it has.
func (s *Server) Stop() {
	s.Shutdown()
	s.WaitForShutdown()
}

// Cluster is a set of nodes routed to each other on loopback.
type Cluster struct {
	Nodes []*Server
	opts  []Options
}

// StartCluster runs n nodes with JetStream stores under dir; every node
// takes base's Users, TLS, NoAdvertise and Debug.
func StartCluster(dir string, n int, base Options) (*Cluster, error) {
	c := &Cluster{}
	var routes []string
	for i := 0; i < n; i++ {
		cp, err := FreePort()
		if err != nil {
			return nil, err
		}
		cport, err := FreePort()
		if err != nil {
			return nil, err
		}
		c.opts = append(c.opts, Options{
			Dir: filepath.Join(dir, fmt.Sprintf("n%d", i)), Port: cp, Name: fmt.Sprintf("n%d", i),
			ClusterName: "aaas", ClusterPort: cport,
			Users: base.Users, TLS: base.TLS, NoAdvertise: base.NoAdvertise, Debug: base.Debug, MaxStore: base.MaxStore,
		})
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", cport))
	}
	c.Nodes = make([]*Server, n)
	errs := make(chan error, n)
	for i := range c.opts {
		c.opts[i].Routes = routes
		go func(i int) {
			s, err := Start(c.opts[i])
			c.Nodes[i] = s
			errs <- err
		}(i)
	}
	for range c.opts {
		if err := <-errs; err != nil {
			c.Shutdown()
			return nil, err
		}
	}
	return c, c.waitJetStream(30 * time.Second)
}

func (c *Cluster) waitJetStream(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if c.formed() {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("jetstream cluster not formed after %s", timeout)
}

// formed says the cluster can place a stream on any of its running nodes:
// every node is current, and the meta leader has heard every running node's
// statistics. Without the second, a bucket created at once fails with "no
// suitable peers for placement, peer offline" (the check nats-server's own
// tests make, waitOnClusterReadyWithNumPeers).
func (c *Cluster) formed() bool {
	running, peers := 0, 0
	for _, s := range c.Nodes {
		if s == nil {
			continue
		}
		running++
		if !s.JetStreamIsCurrent() {
			return false
		}
		if s.JetStreamIsLeader() {
			peers = len(s.JetStreamClusterPeers())
		}
	}
	return peers == running
}

// URLs is a comma-separated client URL list of the running nodes.
func (c *Cluster) URLs() string {
	var us []string
	for i, s := range c.Nodes {
		if s != nil {
			us = append(us, s.URL())
		} else {
			us = append(us, fmt.Sprintf("nats://127.0.0.1:%d", c.opts[i].Port))
		}
	}
	return strings.Join(us, ",")
}

// Kill takes node i down at once, as SIGKILL would: the node drops its
// connections and routes without the shutdown's orderly goodbyes (lame
// duck, JetStream leader transfer), and its store is left as it was.
func (c *Cluster) Kill(i int) {
	if s := c.Nodes[i]; s != nil {
		s.Server.DisableJetStream()
		s.Stop()
		c.Nodes[i] = nil
	}
}

// Stop takes node i down.
func (c *Cluster) Stop(i int) {
	if c.Nodes[i] != nil {
		c.Nodes[i].Stop()
		c.Nodes[i] = nil
	}
}

// Restart brings nodes back with their stores and ports, all of them
// before it waits for the cluster: a cluster that lost its quorum forms
// again only once enough of them run.
func (c *Cluster) Restart(nodes ...int) error {
	for _, i := range nodes {
		s, err := Start(c.opts[i])
		if err != nil {
			return err
		}
		c.Nodes[i] = s
	}
	return c.waitJetStream(30 * time.Second)
}

// Shutdown stops every node.
func (c *Cluster) Shutdown() {
	for i := range c.Nodes {
		c.Stop(i)
	}
}

// FreePort returns a TCP port on loopback that nothing listens on, for a
// listener that starts later (a front, a child process). Two things could
// take it in between, and neither can:
//   - it lies below the kernel's ephemeral range (ip_local_port_range
//     starts at 32768), which is where a port 0 listener or an outgoing
//     connection's source port comes from;
//   - it is held for the life of this process by a lock file other test
//     processes (go test runs packages in parallel) honour, and once per
//     process by handed.
func FreePort() (int, error) {
	handedMu.Lock()
	defer handedMu.Unlock()
	dir := filepath.Join(os.TempDir(), "aaas-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	const first, n = 20000, 10000
	start := rand.IntN(n)
	for i := range n {
		port := first + (start+i)%n
		if handed[port] != nil {
			continue
		}
		lock, ok := reserve(dir, port)
		if !ok {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			lock.Close() // someone else's listener: try another
			continue
		}
		l.Close()
		handed[port] = lock
		return port, nil
	}
	return 0, errors.New("free port: every port from 20000 to 29999 is taken")
}

// reserve takes port's lock file without waiting; the lock lasts as long
// as the file stays open, which is until this process ends.
func reserve(dir string, port int) (*os.File, bool) {
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return nil, false
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, false
	}
	return f, true
}

var (
	handedMu sync.Mutex
	handed   = map[int]*os.File{}
)
