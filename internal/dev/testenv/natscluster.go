package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	aaas "github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/natsauth"
)

// NATSCluster is a JetStream cluster of nats-server processes (the
// nats-server module at go.mod's version) run with the manifests' own
// configuration (manifests/base/nats: the permission table, authenticated
// routes, JetStream limits), so a node can be SIGKILLed as a pod is and
// the configuration operators deploy is what the fault tests exercise.
type NATSCluster struct {
	Nodes []*NATSNode
}

// NATSNode is one server process.
type NATSNode struct {
	Name string
	// Port is the client port; Monitor the HTTP monitoring port.
	Port, Monitor int
	opts          child.Options
	p             *child.Process
	out           *testutil.Buffer
}

var (
	natsServerOnce sync.Once
	natsServerBin  string
	natsServerErr  error
)

// natsServer builds nats-server once per test binary (the Go build cache
// makes it quick after the first time) into a directory that lives as long
// as the test binary.
func natsServer() (string, error) {
	natsServerOnce.Do(func() {
		dir, err := os.MkdirTemp("", "testenv-nats-")
		if err != nil {
			natsServerErr = err
			return
		}
		natsServerBin, natsServerErr = gobuild.BinaryNamed(dir, "github.com/nats-io/nats-server/v2", "nats-server")
	})
	return natsServerBin, natsServerErr
}

// StartNATSCluster runs n nodes admitting ids' identities (and the
// harness's Admin), waits until JetStream is current on all of them, and
// stops them when the test ends.
func StartNATSCluster(t testing.TB, n int, ids *natsauth.Identities) *NATSCluster {
	t.Helper()
	bin, err := natsServer()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	conf := writeNATSConfig(t, dir)
	type ports struct{ client, cluster, monitor int }
	var ps []ports
	var routes []string
	password, err := natsauth.RoutePassword()
	if err != nil {
		t.Fatal(err)
	}
	for range n {
		p := ports{freePort(t), freePort(t), freePort(t)}
		ps = append(ps, p)
		routes = append(routes, fmt.Sprintf("nats://route:%s@127.0.0.1:%d", password, p.cluster))
	}
	c := &NATSCluster{}
	for i, p := range ps {
		name := fmt.Sprintf("nats-%d", i)
		env := map[string]string{
			"POD_NAME": name, "NATS_ROUTE_PASSWORD": password,
			"NATS_ROUTES":     `["` + strings.Join(routes, `","`) + `"]`,
			"NATS_ADMIN_NKEY": ids.Public(natsauth.Admin), "NATS_STORE_DIR": filepath.Join(dir, name),
			// The manifests' StatefulSet sets it (16Gi, for a million
			// accounts); the stacks' development sizing reserves 4.3 GiB.
			"NATS_MAX_FILE_STORE": "8Gi",
		}
		maps.Copy(env, ids.ServerEnv())
		node := &NATSNode{Name: name, Port: p.client, Monitor: p.monitor, out: &testutil.Buffer{}}
		node.opts = child.Options{Name: name, Path: bin, Env: child.Environ(env), Output: node.out, Args: []string{
			"--config", conf,
			// Listeners and store move to this node's ports and directory;
			// the rest is the manifests' configuration.
			"--addr", "127.0.0.1", "--port", fmt.Sprint(p.client), "--http_port", fmt.Sprint(p.monitor),
			"--cluster", fmt.Sprintf("nats://127.0.0.1:%d", p.cluster),
			"--pid", filepath.Join(dir, name+".pid"),
			// Clients use only the URLs they are given (each process's fault
			// proxies), not the addresses the nodes would advertise.
			"--no_advertise",
		}}
		c.Nodes = append(c.Nodes, node)
		node.start(t)
	}
	t.Cleanup(func() {
		for _, node := range c.Nodes {
			node.p.Stop(10 * time.Second)
			// The node's own log is the witness of a refused subject
			// (violations.go).
			if v := serverViolations(node.out.String()); v != "" {
				t.Errorf("NATS node %s refused subjects their identity is not granted (internal/natsauth):\n%s", node.Name, v)
			}
			if t.Failed() {
				t.Logf("--- %s output ---\n%s", node.Name, tailString(node.out.String(), 30))
			}
		}
	})
	c.WaitCurrent(t, time.Minute)
	return c
}

func freePort(t testing.TB) int {
	t.Helper()
	var port int
	_, err := fmt.Sscanf(FreeAddr(t), "127.0.0.1:%d", &port)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// writeNATSConfig copies manifests/base/nats into dir without its TLS, the
// harness's Admin identity (every permission; the tests observe and inject through
// it) added to the users and the store moved to $NATS_STORE_DIR, and
// returns the path of nats.conf.
func writeNATSConfig(t testing.TB, dir string) string {
	t.Helper()
	const src = "manifests/base/nats"
	entries, err := fs.ReadDir(aaas.Manifests, src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := fs.ReadFile(aaas.Manifests, src+"/"+e.Name())
		if err != nil {
			t.Fatal(err)
		}
		if e.Name() == "tls.conf" || e.Name() == "cluster-tls.conf" {
			// The harness's nodes and clients talk plaintext on loopback:
			// the manifests' TLS (a certificate from a Secret) is the
			// deployment tier's to prove.
			b = []byte("# TLS: not in the test harness\n")
		}
		if e.Name() == "nats.conf" {
			s := strings.Replace(string(b), "users: [\n", "users: [\n    {nkey: $NATS_ADMIN_NKEY}\n", 1)
			if s == string(b) {
				t.Fatal("manifests/base/nats/nats.conf has no users list to add the harness identity to")
			}
			b = []byte(s)
			// Each node's store is its own directory.
			if s = strings.Replace(s, "store_dir: /data\n", "store_dir: $NATS_STORE_DIR\n", 1); s == string(b) {
				t.Fatal("manifests/base/nats/nats.conf has no store_dir: /data to move")
			}
			b = []byte(s)
		}
		if err := os.WriteFile(filepath.Join(dir, e.Name()), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(dir, "nats.conf")
}

func (n *NATSNode) start(t testing.TB) {
	t.Helper()
	p, err := child.Start(n.opts)
	if err != nil {
		t.Fatal(err)
	}
	n.p = p
}

// URL is the node's client URL.
func (n *NATSNode) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Addr is the node's client host:port.
func (n *NATSNode) Addr() string { return fmt.Sprintf("127.0.0.1:%d", n.Port) }

// Kill ends the node with SIGKILL: no lame duck, no leader transfer, its
// store as the crash left it.
func (n *NATSNode) Kill() { n.p.Kill() }

// Restart starts a killed node again on its ports and store.
func (n *NATSNode) Restart(t testing.TB) { t.Helper(); n.start(t) }

// Healthy reports whether the node's /healthz (JetStream current: meta
// leader known, its streams caught up; the manifests' readiness probe)
// answers 200.
func (n *NATSNode) Healthy() bool {
	if n.p.Exited() {
		return false
	}
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/healthz", n.Monitor))
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// URLs is a comma-separated client URL list of every node.
func (c *NATSCluster) URLs() string {
	var us []string
	for _, n := range c.Nodes {
		us = append(us, n.URL())
	}
	return strings.Join(us, ",")
}

// WaitCurrent waits until every running node is healthy.
func (c *NATSCluster) WaitCurrent(t testing.TB, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		bad := ""
		for _, n := range c.Nodes {
			if !n.p.Exited() && !n.Healthy() {
				bad = n.Name
			}
		}
		if bad == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("NATS node %s not current after %s", bad, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// PID is the node's process id (of its current run).
func (n *NATSNode) PID() int { return n.p.PID() }

// Node is the node named name (nats-0, ...), or nil.
func (c *NATSCluster) Node(name string) *NATSNode {
	for _, n := range c.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// StreamLeader is the server that leads stream now, from the stream's
// cluster info ("" while it has none).
func StreamLeader(ctx context.Context, js jetstream.JetStream, stream string) (string, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return "", err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return "", err
	}
	if info.Cluster == nil {
		return "", fmt.Errorf("stream %s has no cluster info", stream)
	}
	return info.Cluster.Leader, nil
}

// KVStreams are the streams behind every KV bucket.
func KVStreams(ctx context.Context, js jetstream.JetStream) ([]string, error) {
	var out []string
	names := js.StreamNames(ctx)
	for n := range names.Name() {
		if strings.HasPrefix(n, "KV_") {
			out = append(out, n)
		}
	}
	return out, names.Err()
}

// MoveLeaders makes node the leader of each of streams, asking the
// current leader of each to step down in its favour until it is, so one
// SIGKILL takes every one of their leaders at once.
func (c *NATSCluster) MoveLeaders(t testing.TB, js jetstream.JetStream, node string, streams ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	req, _ := json.Marshal(map[string]any{"placement": map[string]string{"preferred": node}})
	for _, s := range streams {
		for {
			leader, err := StreamLeader(ctx, js, s)
			if err == nil && leader == node {
				break
			}
			if err == nil && leader != "" {
				// A refusal (an election already under way) is asked again.
				_, _ = js.Conn().RequestWithContext(ctx, "$JS.API.STREAM.LEADER.STEPDOWN."+s, req)
			}
			select {
			case <-ctx.Done():
				t.Fatalf("%s does not lead %s after 2 minutes (leader %q, %v)", node, s, leader, err)
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// Connections counts the client connections named name ("<role>/<id>",
// as every aaas process names its own) open on the running nodes, by the
// nodes' own monitoring (/connz): a process cut off from NATS has none.
func (c *NATSCluster) Connections(name string) (int, error) {
	n := 0
	for _, node := range c.Nodes {
		if node.p.Exited() {
			continue
		}
		cl := http.Client{Timeout: 5 * time.Second}
		resp, err := cl.Get(fmt.Sprintf("http://127.0.0.1:%d/connz?limit=100000", node.Monitor))
		if err != nil {
			return 0, err
		}
		var connz struct {
			Connections []struct {
				Name string `json:"name"`
			} `json:"connections"`
		}
		err = json.NewDecoder(resp.Body).Decode(&connz)
		resp.Body.Close()
		if err != nil {
			return 0, fmt.Errorf("%s /connz: %w", node.Name, err)
		}
		for _, conn := range connz.Connections {
			if conn.Name == name {
				n++
			}
		}
	}
	return n, nil
}
