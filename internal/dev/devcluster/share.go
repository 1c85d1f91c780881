package devcluster

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// A shared cluster is one simulated-node cluster that several test
// processes use at once (`make test` runs one for every integration
// package, as it shares the race-enabled binaries): the process that
// started it calls Share, the others Attach to its directory. Everything
// but the simulated node's process handles is reachable through the API
// server and the file system; Node.Signal is served by the owner over a
// Unix socket in the cluster directory.

const (
	sharedFile = "shared.json"
	nodeSocket = "node.sock"
)

// shared is what an attaching process needs to find the cluster.
type shared struct {
	Server     string `json:"server"`
	Kubeconfig string `json:"kubeconfig"`
	EtcdURL    string `json:"etcd"`
	Node       string `json:"node"`
}

// Share makes a running simulated-node cluster attachable from other
// processes (Attach(c.Dir)) until ctx ends.
func (c *Cluster) Share(ctx context.Context) error {
	if c.Node == nil {
		return errors.New("devcluster: only a simulated-node cluster can be shared")
	}
	sock := filepath.Join(c.Dir, nodeSocket)
	_ = os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("devcluster: node socket: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /signal", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		sig, err := strconv.Atoi(q.Get("signal"))
		if err == nil {
			err = c.Node.Signal(q.Get("namespace"), q.Get("pod"), q.Get("container"), syscall.Signal(sig))
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusConflict)
		}
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	go func() { <-ctx.Done(); _ = srv.Close() }()
	b, err := json.Marshal(shared{Server: c.server, Kubeconfig: c.Kubeconfig, EtcdURL: c.EtcdURL, Node: c.Node.Name})
	if err != nil {
		return err
	}
	// Written last and renamed into place: its presence means ready.
	tmp := filepath.Join(c.Dir, sharedFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("devcluster: %w", err)
	}
	return os.Rename(tmp, filepath.Join(c.Dir, sharedFile))
}

// Attach returns a handle on the cluster another process shares from dir.
// Stop on it releases nothing: the owner stops the cluster.
func Attach(dir string) (*Cluster, error) {
	b, err := os.ReadFile(filepath.Join(dir, sharedFile))
	if err != nil {
		return nil, fmt.Errorf("devcluster: attach %s: %w (is the sharing process still running?)", dir, err)
	}
	var s shared
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("devcluster: attach %s: %w", dir, err)
	}
	p, err := loadPKI(filepath.Join(dir, "pki"))
	if err != nil {
		return nil, err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", s.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("devcluster: attach: %w", err)
	}
	cfg.QPS, cfg.Burst = 200, 400
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("devcluster: attach: %w", err)
	}
	sock := filepath.Join(dir, nodeSocket)
	n := &Node{Name: s.Node, client: client, opts: nodeOptions{dir: dir}, remote: &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}},
	}}
	return &Cluster{Dir: dir, Kubeconfig: s.Kubeconfig, EtcdURL: s.EtcdURL, Config: cfg, Client: client, Node: n, pki: p, server: s.Server, log: slog.New(slog.DiscardHandler)}, nil
}

// loadPKI reads the CA certificate of a cluster another process started
// (its key stays with that process).
func loadPKI(dir string) (*pki, error) {
	b, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return nil, fmt.Errorf("devcluster: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return nil, fmt.Errorf("devcluster: %s/ca.crt holds no certificate", dir)
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("devcluster: %w", err)
	}
	return &pki{dir: dir, caCert: cert}, nil
}

// remoteSignal asks the process that runs an attached cluster's node.
func (n *Node) remoteSignal(namespace, pod, container string, sig syscall.Signal) error {
	q := url.Values{"namespace": {namespace}, "pod": {pod}, "container": {container}, "signal": {strconv.Itoa(int(sig))}}
	resp, err := n.remote.Post("http://node/signal?"+q.Encode(), "", nil)
	if err != nil {
		return fmt.Errorf("signal %s/%s: %w", namespace, pod, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var msg [512]byte
		k, _ := resp.Body.Read(msg[:])
		return fmt.Errorf("signal %s/%s: %s", namespace, pod, msg[:k])
	}
	return nil
}

// remotePVCDir is PVCDir without the owner's informer.
func (n *Node) remotePVCDir(namespace, name string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pvc, err := n.client.CoreV1().PersistentVolumeClaims(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	return n.pvcDir(pvc), nil
}
