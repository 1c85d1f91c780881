package dshsim

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"
)

// Options configures the simulator. OptionsFromEnv fills every field except
// RotateSignals from flags and environment variables.
type Options struct {
	Listen       string        // --listen (or DSH's own --host and --port), DSHSIM_LISTEN; default ":3080"
	DSHHome      string        // DSH_HOME; default "/home/node/.dsh"
	Workspace    string        // HOME; default the user's home directory
	TrustedHosts []string      // DSH_TRUSTED_HOSTS, comma separated; localhost and 127.0.0.1 are always trusted
	AuthTTL      time.Duration // DSH_AUTH_TTL; default 24h
	CrashAfter   time.Duration // --crash-after, DSHSIM_CRASH_AFTER; 0 never crashes
	SlowStart    time.Duration // --slow-start, DSHSIM_SLOW_START; delay before listening
	NoToken      bool          // --no-token, DSHSIM_NO_TOKEN; never print the token line
	Noise        bool          // --noise, DSHSIM_NOISE; print fake model output and ANSI noise
	// FakeTokens (DSHSIM_FAKE_TOKENS) prints that many lines that look
	// like token lines after each real one, as a tenant's agent could.
	FakeTokens int
	// SilentHandshake (DSHSIM_SILENT_HANDSHAKE) accepts the handshake
	// request and never answers it, as a hung or hostile pod would.
	SilentHandshake bool

	// RotateSignals rotates the launch token on every receive; the binary
	// wires SIGHUP to it. Nil never rotates.
	RotateSignals <-chan os.Signal
}

// OptionsFromEnv parses args (without the program name) and falls back to
// getenv for every flag that is not given; a flag wins over its variable.
// Positional arguments such as "web" are skipped because real DSH is started
// as `dsh web ...`.
func OptionsFromEnv(args []string, getenv func(string) string) (Options, error) {
	o := Options{
		Listen:       envOr(getenv, "DSHSIM_LISTEN", ":3080"),
		DSHHome:      envOr(getenv, "DSH_HOME", "/home/node/.dsh"),
		Workspace:    getenv("HOME"),
		TrustedHosts: splitList(getenv("DSH_TRUSTED_HOSTS")),
	}
	if o.Workspace == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return Options{}, fmt.Errorf("find workspace: HOME is not set: %w", err)
		}
		o.Workspace = home
	}
	var err error
	if o.AuthTTL, err = envDuration(getenv, "DSH_AUTH_TTL", 24*time.Hour); err != nil {
		return Options{}, err
	}
	if o.CrashAfter, err = envDuration(getenv, "DSHSIM_CRASH_AFTER", 0); err != nil {
		return Options{}, err
	}
	if o.SlowStart, err = envDuration(getenv, "DSHSIM_SLOW_START", 0); err != nil {
		return Options{}, err
	}
	if o.NoToken, err = envBool(getenv, "DSHSIM_NO_TOKEN"); err != nil {
		return Options{}, err
	}
	if o.Noise, err = envBool(getenv, "DSHSIM_NOISE"); err != nil {
		return Options{}, err
	}
	if o.SilentHandshake, err = envBool(getenv, "DSHSIM_SILENT_HANDSHAKE"); err != nil {
		return Options{}, err
	}
	if v := getenv("DSHSIM_FAKE_TOKENS"); v != "" {
		if o.FakeTokens, err = strconv.Atoi(v); err != nil || o.FakeTokens < 0 {
			return Options{}, fmt.Errorf("parse DSHSIM_FAKE_TOKENS: %q is not a count", v)
		}
	}

	fs := flag.NewFlagSet("dshsim", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // the caller reports the returned error
	fs.StringVar(&o.Listen, "listen", o.Listen, "listen address")
	fs.DurationVar(&o.CrashAfter, "crash-after", o.CrashAfter, "exit with status 2 after this long")
	fs.DurationVar(&o.SlowStart, "slow-start", o.SlowStart, "sleep this long before listening")
	fs.BoolVar(&o.NoToken, "no-token", o.NoToken, "never print the launch token line")
	fs.BoolVar(&o.Noise, "noise", o.Noise, "print log noise and fake model output")
	// DSH Web is started as `dsh web --host H --port P` (the SandboxTemplate's
	// args); the stand-in must accept the same command line.
	var host, port string
	fs.StringVar(&host, "host", "", "listen host, as DSH Web takes it")
	fs.StringVar(&port, "port", "", "listen port, as DSH Web takes it")
	for {
		if err := fs.Parse(args); err != nil {
			return Options{}, fmt.Errorf("parse flags: %w", err)
		}
		if fs.NArg() == 0 {
			break
		}
		args = fs.Args()[1:]
	}

	if host != "" || port != "" {
		h, p, err := net.SplitHostPort(o.Listen)
		if err != nil {
			return Options{}, fmt.Errorf("parse options: listen address %q: %w", o.Listen, err)
		}
		if host != "" {
			h = host
		}
		if port != "" {
			if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
				return Options{}, fmt.Errorf("parse options: --port %q is not a port", port)
			}
			p = port
		}
		o.Listen = net.JoinHostPort(h, p)
	}
	if o.Listen == "" {
		return Options{}, fmt.Errorf("parse options: empty listen address")
	}
	if o.AuthTTL <= 0 {
		return Options{}, fmt.Errorf("parse options: DSH_AUTH_TTL must be positive, got %s", o.AuthTTL)
	}
	return o, nil
}

func envOr(getenv func(string) string, name, def string) string {
	if v := getenv(name); v != "" {
		return v
	}
	return def
}

func envDuration(getenv func(string) string, name string, def time.Duration) (time.Duration, error) {
	v := getenv(name)
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", name, err)
	}
	return d, nil
}

func envBool(getenv func(string) string, name string) (bool, error) {
	v := getenv(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("parse %s: %w", name, err)
	}
	return b, nil
}

func splitList(s string) []string {
	var out []string
	for item := range strings.SplitSeq(s, ",") {
		if item = strings.TrimSpace(item); item != "" {
			out = append(out, item)
		}
	}
	return out
}
