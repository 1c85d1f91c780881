// Command dshsim is the DSH Web stand-in used by tests and demos; see
// internal/dev/dshsim and /work/shared/UPSTREAM.md. SIGHUP rotates the launch
// token, SIGINT and SIGTERM shut it down.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/aaas-project/aaas/internal/dev/dshsim"
)

func main() { os.Exit(run()) }

func run() int {
	o, err := dshsim.OptionsFromEnv(os.Args[1:], os.Getenv)
	if err != nil {
		fmt.Fprintf(os.Stderr, "dshsim: %v\n", err)
		return 1
	}
	// Registered before Run so a SIGHUP during --slow-start rotates instead
	// of killing the process.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	o.RotateSignals = hup

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err = dshsim.Run(ctx, o, os.Stdout)
	switch {
	case errors.Is(err, dshsim.ErrSimulatedCrash):
		fmt.Fprintf(os.Stderr, "dshsim: %v\n", err)
		return 2
	case err != nil:
		fmt.Fprintf(os.Stderr, "dshsim: %v\n", err)
		return 1
	}
	return 0
}
