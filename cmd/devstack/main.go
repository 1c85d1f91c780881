// Command devstack runs the whole aaas system on this machine (`make run`).
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/aaas-project/aaas/internal/devstack"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "devstack:", err)
		os.Exit(1)
	}
	err = devstack.Run(ctx, devstack.Options{
		StateDir:    ".run",
		NATSPort:    4222,
		BinDir:      filepath.Dir(exe),
		EdgePorts:   []int{8080, 8081},
		MetricsPort: 9090,
		Out:         os.Stdout,
		Log:         slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "devstack:", err)
		os.Exit(1)
	}
}
