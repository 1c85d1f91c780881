package testenv

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// Front is nginx in front of edge replicas, configured as an ingress is:
// an upstream pool with keep-alive connections shared by every client,
// HTTP/1.1 upstream, request bodies streamed unbuffered, WebSockets
// upgraded. Request smuggling and connection reuse only show up behind it.
type Front struct {
	Addr string
}

const frontConf = `worker_processes 1;
daemon off;
master_process off;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  upstream edges {
%[2]s    keepalive 16;
  }
  map $http_upgrade $connection_upgrade {
    default upgrade;
    ''      '';
  }
  server {
    listen %[3]s;
    client_max_body_size 0;
    location / {
      proxy_pass http://edges;
      proxy_http_version 1.1;
      proxy_set_header Host $http_host;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_request_buffering off;
      proxy_buffering off;
      proxy_read_timeout 1h;
      proxy_send_timeout 1h;
    }
  }
}
`

// NewFrontAt starts nginx on addr in front of backends (host:port) and
// stops it when the test ends. Edges refuse Hosts they do not serve: use
// Stack.FrontAddr for a front whose address the edges know as a public
// host.
func NewFrontAt(t testing.TB, addr string, backends ...string) *Front {
	t.Helper()
	var servers strings.Builder
	for _, b := range backends {
		fmt.Fprintf(&servers, "    server %s max_fails=0;\n", b)
	}
	return Nginx(t, addr, func(dir string) string { return fmt.Sprintf(frontConf, dir, servers.String(), addr) })
}

// Nginx starts nginx with the configuration conf returns for dir (its
// own directory, for the pid, logs and temporary files), waits until it
// listens on addr and stops it when the test ends: for a front of another
// shape than NewFront's (TLS, several server names).
func Nginx(t testing.TB, addr string, conf func(dir string) string) *Front {
	t.Helper()
	bin, err := exec.LookPath("nginx")
	if err != nil {
		bin = "/usr/sbin/nginx"
		if _, err := os.Stat(bin); err != nil {
			t.Fatal("nginx not found: run `make tools` (installs Debian's nginx-light)")
		}
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(file, []byte(conf(dir)), 0o600); err != nil {
		t.Fatal(err)
	}
	out := &testutil.Buffer{}
	p, err := child.Start(child.Options{Name: "nginx", Path: bin, Args: []string{"-c", file, "-p", dir, "-e", filepath.Join(dir, "error.log")}, Output: out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(5 * time.Second) })
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return &Front{Addr: addr}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.Fatalf("nginx did not start: %s\n%s", out.String(), b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// URL is http://host:port of the front.
func (f *Front) URL() string { return "http://" + f.Addr }

var npmOnce sync.Once

// NodeUpstream starts test/nodeupstream (a Node.js HTTP and WebSocket
// server; README there) and returns its host:port. Its one dependency (ws)
// is installed from the lockfile the first time.
func NodeUpstream(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(Root(), "test", "nodeupstream")
	var npmErr error
	npmOnce.Do(func() {
		if _, err := os.Stat(filepath.Join(dir, "node_modules", "ws")); err == nil {
			return
		}
		cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund")
		cmd.Dir = dir
		if b, err := cmd.CombinedOutput(); err != nil {
			npmErr = fmt.Errorf("npm ci in %s: %v\n%s", dir, err, b)
		}
	})
	if npmErr != nil {
		t.Fatal(npmErr)
	}
	out := &testutil.Buffer{}
	p, err := child.Start(child.Options{Name: "node", Path: "node", Args: []string{"server.js"}, Dir: dir, Env: append(os.Environ(), "PORT=0"), Output: out})
	if err != nil {
		t.Fatalf("%v (Debian's nodejs; make tools installs it)", err)
	}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("--- node upstream output ---\n%s", tailString(out.String(), 40))
		}
	})
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline) && !p.Exited(); time.Sleep(20 * time.Millisecond) {
		for _, l := range strings.SplitAfter(out.String(), "\n") {
			if port, ok := strings.CutPrefix(l, "listening "); ok && strings.HasSuffix(port, "\n") {
				return "127.0.0.1:" + strings.TrimSpace(port)
			}
		}
	}
	t.Fatalf("node upstream did not start:\n%s", out.String())
	return ""
}
