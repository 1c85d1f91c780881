// Command devstack runs the whole aaas system on this machine (`make run`):
// embedded NATS, a local Kubernetes control plane with a warm pool of
// dshsim sandboxes, lifecycle, the sweeper and two edges; with -node real,
// the documented install on a real kubelet instead.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/devstack"
)

func main() {
	state := flag.String("state", ".run", "state directory (wiped at start)")
	natsPort := flag.Int("nats-port", 4222, "NATS client port")
	edgePorts := flag.String("edge-ports", "8080,8081", "comma-separated edge ports, one replica each")
	metricsPort := flag.Int("metrics-port", 9090, "first metrics port (0: free ports)")
	node := flag.String("node", "sim", "sim: the simulated node; real: a real kubelet with containerd (needs root)")
	pathMode := flag.Bool("path-mode", false, "serve sandboxes under /u/<user>/ on the edges' hosts instead of each on <user>.localhost:<port>")
	flag.Parse()

	var ports []int
	for _, p := range strings.Split(*edgePorts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n <= 0 || n > 65535 {
			fmt.Fprintf(os.Stderr, "devstack: -edge-ports: %q is not a port\n", p)
			os.Exit(2)
		}
		ports = append(ports, n)
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "devstack:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	err = devstack.Run(ctx, devstack.Options{
		StateDir:    *state,
		NATSPort:    *natsPort,
		EdgePorts:   ports,
		MetricsPort: *metricsPort,
		Node:        devcluster.NodeKind(*node),
		PathMode:    *pathMode,
		BinDir:      filepath.Dir(exe),
		Out:         os.Stdout,
		Log:         slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "devstack:", err)
		os.Exit(1)
	}
}
