package devcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/dev/child"
)

// ComposeBinary is Docker Compose at COMPOSE_VERSION, which `make tools`
// builds from its Go module.
func ComposeBinary() string {
	return filepath.Join(toolsCache(), "compose-"+aaas.Version("COMPOSE_VERSION"), "docker-compose")
}

// Docker is a Docker engine (dockerd from Debian's docker.io, which `make
// tools` installs) with its data, state and socket in a directory of its
// own, for the tests that run docker compose. It leaves the machine's
// network to the real node beside it: no packet filter rules, no
// forwarding or masquerading, no bridge (--bridge=none), so its containers
// share the host's network or have none. It runs the containerd it
// starts itself, not the real node's.
type Docker struct {
	// Host is the engine's address as DOCKER_HOST takes it.
	Host string
	sock string
	exec string
	p    *child.Process
}

// StartDocker starts the engine in dir and returns once it answers.
func StartDocker(ctx context.Context, dir string) (*Docker, error) {
	bin, err := exec.LookPath("dockerd")
	if err != nil {
		return nil, fmt.Errorf("dockerd is not installed: `make tools` installs Debian's docker.io")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	d := &Docker{sock: filepath.Join(dir, "docker.sock"), exec: filepath.Join(dir, "exec")}
	d.Host = "unix://" + d.sock
	d.p, err = child.Start(child.Options{Name: "dockerd", Path: bin, Dir: dir, Log: filepath.Join(dir, "dockerd.log"), Args: []string{
		"--host", d.Host, "--data-root", filepath.Join(dir, "data"), "--exec-root", d.exec,
		"--pidfile", filepath.Join(dir, "dockerd.pid"),
		"--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
	}})
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := d.api(ctx, http.MethodGet, "/_ping", nil)
		if err == nil && resp.StatusCode == http.StatusOK {
			return d, nil
		}
		if d.p.Exited() || time.Now().After(deadline) || ctx.Err() != nil {
			_ = d.Stop()
			return nil, fmt.Errorf("dockerd did not answer (%v): %s", err, d.p.LogTail(20))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// api makes one call to the engine's API and reads the whole answer.
func (d *Docker) api(ctx context.Context, method, path string, body io.Reader) (*http.Response, error) {
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", d.sock)
	}}}
	defer c.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, method, "http://docker"+path, body)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode/100 != 2 {
		err = fmt.Errorf("%s %s: %d %s", method, path, resp.StatusCode, b)
	}
	return resp, err
}

// Load loads docker-archive tarballs (image.Spec.Write) into the engine,
// as `docker load -i` does.
func (d *Docker) Load(ctx context.Context, tarballs ...string) error {
	for _, t := range tarballs {
		f, err := os.Open(t)
		if err != nil {
			return err
		}
		_, err = d.api(ctx, http.MethodPost, "/images/load?quiet=1", f)
		f.Close()
		if err != nil {
			return fmt.Errorf("load %s: %w", filepath.Base(t), err)
		}
	}
	return nil
}

// Stop stops the engine and the containerd it started, and unmounts what
// the engine leaves mounted: its handle on the host's network namespace.
// Containers still running are the caller's to remove first (docker
// compose down), as their processes would outlive it.
func (d *Docker) Stop() error {
	d.p.Stop(30 * time.Second)
	ns := filepath.Join(d.exec, "netns", "default")
	if err := syscall.Unmount(ns, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("unmount %s: %w", ns, err)
	}
	return nil
}
