package dshsim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// ErrSimulatedCrash is returned by Run when Options.CrashAfter elapses; the
// binary exits with status 2 for it.
var ErrSimulatedCrash = errors.New("simulated crash")

const shutdownTimeout = 5 * time.Second

// Run starts the simulator, prints the token line and serves until ctx ends,
// then shuts down gracefully and returns nil. A start-up failure, a serve
// failure or a simulated crash is returned as an error.
func Run(ctx context.Context, o Options, stdout io.Writer) error {
	if o.SlowStart > 0 {
		select {
		case <-time.After(o.SlowStart):
		case <-ctx.Done():
			return nil
		}
	}
	s, err := NewServer(o, stdout)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", o.Listen, err)
	}
	// With --listen :0 only the listener knows the port the token line must name.
	s.port = strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	s.flood()
	s.announce()

	hs := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 30 * time.Second}
	hs.RegisterOnShutdown(s.stopStreams)
	defer s.stopApps() // the apps an agent started end with the sandbox
	for _, port := range o.Apps {
		if _, err := s.startApp(port); err != nil {
			_ = ln.Close()
			return fmt.Errorf("app on port %d: %w", port, err)
		}
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()

	var wg sync.WaitGroup
	noiseCtx, stopNoise := context.WithCancel(ctx)
	defer wg.Wait() // no noise line may follow Run's return
	defer stopNoise()
	if o.Noise {
		wg.Go(func() { s.noise(noiseCtx) })
	}

	var crash <-chan time.Time
	if o.CrashAfter > 0 {
		t := time.NewTimer(o.CrashAfter)
		defer t.Stop()
		crash = t.C
	}

	for {
		select {
		case <-o.RotateSignals:
			s.Rotate()
		case <-crash:
			s.out.printf("\x1b[31mdsh: fatal: simulated crash after %s\x1b[0m", o.CrashAfter)
			_ = hs.Close()
			return fmt.Errorf("crash after %s: %w", o.CrashAfter, ErrSimulatedCrash)
		case err := <-served:
			return fmt.Errorf("serve: %w", err)
		case <-ctx.Done():
			s.out.printf("dsh: shutting down")
			sctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
			defer cancel()
			if err := hs.Shutdown(sctx); err != nil {
				_ = hs.Close()
				return fmt.Errorf("shutdown: %w", err)
			}
			return nil
		}
	}
}

// noiseLines imitate what surrounds the token line in a real container log:
// colours, fake model output, a spinner with carriage returns and lines that
// mention "dsh web" or "token" without being the token line.
var noiseLines = []string{
	"\x1b[2m[model] thinking…\x1b[0m",
	"\x1b[36massistant>\x1b[0m Sure! First I will read the files, then run the tests.",
	"\x1b[33mwarn\x1b[0m rate limit headroom 87%",
	"dsh: token usage: prompt=1234 completion=56",
	"⠋ running tool\r⠙ running tool\r\x1b[32m✓\x1b[0m tool finished",
	"\x1b[1mdsh web:\x1b[0m 1 client connected",
	"\x1b[36massistant>\x1b[0m The URL looks like http://example.invalid/?token=not-a-real-token",
}

func (s *Server) noise(ctx context.Context) {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.out.printf("%s", noiseLines[i%len(noiseLines)])
		}
	}
}
