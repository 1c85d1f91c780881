// Command providersim is the model provider stand-in (OpenAI- and
// Anthropic-compatible) that tests use as the far end of
// model calls; see internal/dev/providersim. SIGINT and SIGTERM shut it down.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/aaas-project/aaas/internal/dev/providersim"
)

func main() { os.Exit(run()) }

func run() int {
	o, err := providersim.OptionsFromEnv(os.Getenv)
	if err != nil {
		fmt.Fprintf(os.Stderr, "providersim: %v\n", err)
		return 1
	}
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "providersim: listen on %s: %v\n", o.Listen, err)
		return 1
	}
	// With PROVIDERSIM_LISTEN=127.0.0.1:0 only this line names the port.
	fmt.Printf("providersim: listening on %s\n", ln.Addr())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := providersim.Run(ctx, o, ln); err != nil {
		fmt.Fprintf(os.Stderr, "providersim: %v\n", err)
		return 1
	}
	return 0
}
