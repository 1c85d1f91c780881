package main

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/dev/embednats"
)

// target is one way to reach the dshsim pod. Every load generator sends
// the same request to every target: GET addr+prefix+path with Host and
// Cookie as given, so the peers only forward what they receive.
type target struct {
	name   string
	addr   string // host:port the client connects to
	host   string // Host header
	prefix string // path prefix before /api/…
	cookie string // Cookie header
	pid    int    // process whose CPU time is counted (with its children); 0 for none
	stop   func()
	note   func() string // what the target's own log says about the runs, if anything
}

func (t *target) url(path string) string { return "http://" + t.addr + t.prefix + path }

func (t *target) headers() []string { return []string{"Host: " + t.host, "Cookie: " + t.cookie} }

// The peers: what the edge is measured against. Each forwards to the
// dshsim pod over kept-alive HTTP/1.1 connections, logs no requests, and
// runs from its own temporary directory as the invoking user.
// nginx resolves the relative paths below against its prefix (-p), the
// temporary directory.
const nginxConf = `worker_processes %[3]d;
daemon off;
pid nginx.pid;
error_log error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path body; proxy_temp_path proxy; fastcgi_temp_path fastcgi; uwsgi_temp_path uwsgi; scgi_temp_path scgi;
  upstream dshsim {
    server %[1]s;
    keepalive 64;
  }
  server {
    listen %[2]s;
    location / {
      proxy_pass http://dshsim;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
    }
  }
}
`

const haproxyConf = `global
  nbthread %[3]d
  maxconn 4096
defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend bench
  bind %[2]s
  default_backend dshsim
backend dshsim
  server dshsim %[1]s
`

// Caddy: JSON configuration, run with `caddy run --config <tmp>/caddy.json`.
// Its admin API is disabled (no listener at all) and the configuration is
// not autosaved; it writes no access log without a "logs" entry on the
// server. Its reverse_proxy passes the client's Host through unchanged.
const caddyConf = `{
  "admin": {"disabled": true, "config": {"persist": false}},
  "logging": {"logs": {"default": {"level": "WARN"}}},
  "apps": {
    "http": {
      "servers": {
        "bench": {
          "listen": ["%[2]s"],
          "automatic_https": {"disable": true},
          "routes": [{
            "handle": [{
              "handler": "reverse_proxy",
              "upstreams": [{"dial": "%[1]s"}],
              "transport": {
                "protocol": "http",
                "versions": ["1.1"],
                "keep_alive": {"enabled": true, "max_idle_conns_per_host": 64}
              }
            }]
          }]
        }
      }
    }
  }
}
`

// Traefik: a static configuration file (traefik --configFile) and the
// dynamic one its file provider reads (from the temporary directory it
// runs in). Without an accessLog section it logs no requests; without api,
// ping or metrics it opens no port but the entry point. The static
// serversTransport is the default transport of every service.
const traefikConf = `global:
  checkNewVersion: false
  sendAnonymousUsage: false
log:
  level: ERROR
entryPoints:
  bench:
    address: "%[2]s"
serversTransport:
  maxIdleConnsPerHost: 64
providers:
  file:
    filename: traefik-dynamic.yml
    watch: false
`

const traefikDynamic = `http:
  routers:
    dshsim:
      entryPoints: [bench]
      rule: "PathPrefix(` + "`/`" + `)"
      service: dshsim
  services:
    dshsim:
      loadBalancer:
        passHostHeader: true
        servers:
          - url: "http://%[1]s"
`

// peerNames are the peers in report order.
var peerNames = []string{"nginx", "haproxy", "caddy", "traefik", "chp"}

// peerTitle is how the report names a target.
func peerTitle(name string) string {
	switch name {
	case "chp":
		return "configurable-http-proxy"
	case "caddy":
		return "Caddy"
	case "traefik":
		return "Traefik"
	}
	return name
}

// startPeer starts the named peer in front of upstream (host:port) with
// threads worker processes or threads where the peer has the choice, and
// waits until a request through it succeeds as t's requests will.
func startPeer(name, upstream string, threads int, direct *target) (*target, error) {
	port, err := embednats.FreePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	dir, err := os.MkdirTemp("", "aaas-bench-"+name+"-")
	if err != nil {
		return nil, err
	}
	// nginx's workers drop to nobody when started as root: they must reach
	// the temp directories below.
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	cmd, err := peerCommand(name, dir, upstream, addr, threads)
	if err != nil {
		return nil, err
	}
	log, err := os.Create(filepath.Join(dir, "output.log"))
	if err != nil {
		return nil, err
	}
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); log.Close(); close(exited) }()
	t := &target{name: name, addr: addr, host: direct.host, cookie: direct.cookie, pid: cmd.Process.Pid}
	if name == "nginx" {
		t.note = func() string {
			b, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			n := bytes.Count(b, []byte("an upstream response is buffered to a temporary file"))
			if n == 0 {
				return ""
			}
			return fmt.Sprintf("nginx logged %d times that it buffered an upstream response to a temporary file (`proxy_buffering` on, its default, with the default buffers: a 1 MiB response that dshsim sends faster than the client reads spills to disk).", n)
		}
	}
	t.stop = func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		os.RemoveAll(dir)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		err := probe(t)
		if err == nil {
			return t, nil
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(filepath.Join(dir, "output.log"))
			e, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.stop()
			return nil, fmt.Errorf("%s exited: %s%s", name, b, e)
		default:
		}
		if time.Now().After(deadline) {
			t.stop()
			return nil, fmt.Errorf("%s not serving: %v", name, err)
		}
	}
}

// peerCommand writes the named peer's configuration into dir and returns
// the command that serves it on addr in front of upstream, with threads
// workers where the peer has the choice.
func peerCommand(name, dir, upstream, addr string, threads int) (*exec.Cmd, error) {
	// write fills in a configuration text (upstream, addr, threads) and
	// writes it to file in dir.
	write := func(file, text string) (string, error) {
		path := filepath.Join(dir, file)
		return path, os.WriteFile(path, fmt.Appendf(nil, text, upstream, addr, threads), 0o644)
	}
	var cmd *exec.Cmd
	switch name {
	case "nginx":
		conf, err := write("nginx.conf", nginxConf)
		if err != nil {
			return nil, err
		}
		cmd = exec.Command(sbin("nginx"), "-c", conf, "-p", dir, "-e", filepath.Join(dir, "error.log"))
	case "haproxy":
		conf, err := write("haproxy.cfg", haproxyConf)
		if err != nil {
			return nil, err
		}
		cmd = exec.Command(sbin("haproxy"), "-db", "-f", conf)
	case "caddy":
		conf, err := write("caddy.json", caddyConf)
		if err != nil {
			return nil, err
		}
		cmd = exec.Command(caddyBin(), "run", "--config", conf)
		// Whatever Caddy would keep in the user's config and data
		// directories stays in the temporary one.
		cmd.Env = append(os.Environ(), fmt.Sprintf("GOMAXPROCS=%d", threads), "XDG_CONFIG_HOME="+dir, "XDG_DATA_HOME="+dir)
	case "traefik":
		if _, err := write("traefik-dynamic.yml", traefikDynamic); err != nil {
			return nil, err
		}
		conf, err := write("traefik.yml", traefikConf)
		if err != nil {
			return nil, err
		}
		cmd = exec.Command(traefikBin(), "--configFile="+conf)
		cmd.Env = append(os.Environ(), fmt.Sprintf("GOMAXPROCS=%d", threads))
	case "chp":
		apiPort, err := embednats.FreePort()
		if err != nil {
			return nil, err
		}
		_, port, _ := strings.Cut(addr, ":")
		cmd = exec.Command(chpBin(), "--ip", "127.0.0.1", "--port", port,
			"--api-ip", "127.0.0.1", "--api-port", fmt.Sprint(apiPort),
			"--default-target", "http://"+upstream, "--log-level", "warn")
		cmd.Env = append(os.Environ(), "CONFIGPROXY_AUTH_TOKEN=bench")
	default:
		return nil, fmt.Errorf("unknown peer %q", name)
	}
	return cmd, nil
}

// probe fetches the 1 KiB file through t.
func probe(t *target) error {
	req, _ := http.NewRequest("GET", t.url("/api/files/1k.bin"), nil)
	req.Host = t.host
	req.Header.Set("Cookie", t.cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s", resp.Status)
	}
	return nil
}

// sbin finds a Debian daemon that is not on a non-root PATH.
func sbin(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	return "/usr/sbin/" + name
}

// cached is path inside the tools cache directory hack/tools.sh installs
// tool at the version versions.env pins with key: $CACHE/tool-version/path.
func cached(tool, key string, path ...string) string {
	cache := os.Getenv("AAAS_TOOLS_CACHE") // set by the Makefile
	if cache == "" {
		if base, err := os.UserCacheDir(); err == nil {
			cache = filepath.Join(base, "aaas", "tools")
		}
	}
	return filepath.Join(append([]string{cache, tool + "-" + aaas.Version(key)}, path...)...)
}

// chpBin is configurable-http-proxy as `hack/tools.sh chp` installs it.
func chpBin() string {
	return cached("chp", "CHP_VERSION", "node_modules", ".bin", "configurable-http-proxy")
}

// caddyBin is Caddy as `hack/tools.sh bench` builds it.
func caddyBin() string { return cached("caddy", "CADDY_VERSION", "caddy") }

// traefikBin is Traefik as `hack/tools.sh go` builds it.
func traefikBin() string { return cached("traefik", "TRAEFIK_VERSION", "traefik") }

// checkTools says what `make bench` would install when something the
// chosen targets need is missing.
func checkTools(names map[string]bool, profile bool) error {
	need := map[string]string{"wrk": "wrk"}
	if profile {
		need["strace"] = "strace"
	}
	if names["nginx"] {
		need["nginx"] = sbin("nginx")
	}
	if names["haproxy"] {
		need["haproxy"] = sbin("haproxy")
	}
	if names["caddy"] {
		need["caddy"] = caddyBin()
	}
	if names["traefik"] {
		need["traefik"] = traefikBin()
	}
	if names["chp"] {
		need["configurable-http-proxy"] = chpBin()
	}
	var missing []string
	for name, path := range need {
		if _, err := exec.LookPath(path); err != nil {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("not installed: %s (run `make bench`, it installs them)", strings.Join(missing, ", "))
	}
	return nil
}

// versions reports each tool's version as the tool prints it.
func versions(names map[string]bool) map[string]string {
	first := func(name string, args ...string) string {
		out, _ := exec.Command(name, args...).CombinedOutput()
		line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		return line
	}
	v := map[string]string{"wrk": strings.TrimSuffix(first("wrk", "-v"), " Copyright (C) 2012 Will Glozer")}
	if names["nginx"] {
		v["nginx"] = strings.TrimPrefix(first(sbin("nginx"), "-v"), "nginx version: ")
	}
	if names["haproxy"] {
		// "HAProxy version 2.6.12-1+deb12u4 2026/10/17 - https://haproxy.org/"
		if f := strings.Fields(first(sbin("haproxy"), "-v")); len(f) > 2 {
			v["haproxy"] = f[2]
		}
	}
	if names["caddy"] {
		// "v2.11.9" (the module version stamped in by hack/tools.sh)
		v["caddy"] = first(caddyBin(), "version")
	}
	if names["traefik"] {
		// "Version:      v3.6.12", then Codename:, Go version:, …
		out, _ := exec.Command(traefikBin(), "version").CombinedOutput()
		for l := range strings.Lines(string(out)) {
			if k, val, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "Version" {
				v["traefik"] = strings.TrimSpace(val)
			}
		}
	}
	if names["chp"] {
		v["chp"] = "configurable-http-proxy " + first(chpBin(), "--version") + " on Node.js " + first("node", "-v")
	}
	return v
}

// edgeBuild identifies the edge binary measured: the tree it was most
// likely built from and its hash, since bin/ holds whatever was built last.
func edgeBuild(bin string) string {
	path := filepath.Join(bin, "edge")
	b, err := os.ReadFile(path)
	if err != nil {
		return path
	}
	st, _ := os.Stat(path)
	head, _ := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	dirty, _ := exec.Command("git", "status", "--porcelain", "--", "cmd", "internal").Output()
	tree := "the commit " + strings.TrimSpace(string(head))
	if len(dirty) > 0 {
		tree += " with uncommitted changes under cmd/ and internal/"
	}
	sum := sha256.Sum256(b)
	return fmt.Sprintf("`%s` (sha256 %x…, built %s; the working tree was at %s)", path, sum[:6], st.ModTime().UTC().Format("2006-01-02 15:04 MST"), tree)
}
