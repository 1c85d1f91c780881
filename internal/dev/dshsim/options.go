package dshsim

import (
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"regexp"
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
	// RefuseHandshakeAfter (DSHSIM_REFUSE_HANDSHAKE_AFTER) answers every
	// handshake, whatever its token, with 401 after this long: a hostile
	// pod holding the gateway's handshake as long as it can.
	RefuseHandshakeAfter time.Duration
	// RefuseCookies (DSHSIM_REFUSE_COOKIES) completes the handshake but
	// answers every request with 401, so each one looks like an expired
	// cookie.
	RefuseCookies bool
	// LogFlood (DSHSIM_LOG_FLOOD) prints that many bytes of log lines
	// before the first token line, as a tenant's program could.
	LogFlood int

	// Apps (DSHSIM_APPS, comma-separated ports) are started at boot on
	// DSH's host, as POST /api/apps starts them: a sandbox whose agent
	// runs a dev server.
	Apps []int

	// Provider is the model provider POST /api/chat streams its replies
	// from; the zero value (no base URL set) answers "You said: …" itself.
	Provider Provider
	// Version (DSHSIM_VERSION, which the image sets to its tag) is what
	// /api/echo reports as "version": which image a pod runs, seen through
	// the gateway, as a rollout's tests look for it.
	Version string
	// Model (DSHSIM_MODEL; default deepseek-chat) is the model asked for
	// when a chat request names none.
	Model string
	// SourceIP (DEVCLUSTER_POD_IP) is the local address provider
	// connections are made from. The simulated node sets it: its pods share
	// the host's network namespace, where a connection would otherwise come
	// from 127.0.0.1 instead of the pod's address, which the broker
	// attributes calls by.
	SourceIP netip.Addr

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
		Version:      getenv("DSHSIM_VERSION"),
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
	if o.RefuseHandshakeAfter, err = envDuration(getenv, "DSHSIM_REFUSE_HANDSHAKE_AFTER", 0); err != nil {
		return Options{}, err
	}
	if o.RefuseCookies, err = envBool(getenv, "DSHSIM_REFUSE_COOKIES"); err != nil {
		return Options{}, err
	}
	if v := getenv("DSHSIM_LOG_FLOOD"); v != "" {
		if o.LogFlood, err = strconv.Atoi(v); err != nil || o.LogFlood < 0 {
			return Options{}, fmt.Errorf("parse DSHSIM_LOG_FLOOD: %q is not a byte count", v)
		}
	}
	if v := getenv("DSHSIM_FAKE_TOKENS"); v != "" {
		if o.FakeTokens, err = strconv.Atoi(v); err != nil || o.FakeTokens < 0 {
			return Options{}, fmt.Errorf("parse DSHSIM_FAKE_TOKENS: %q is not a count", v)
		}
	}
	for _, v := range splitList(getenv("DSHSIM_APPS")) {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 65535 {
			return Options{}, fmt.Errorf("parse DSHSIM_APPS: %q is not a port", v)
		}
		o.Apps = append(o.Apps, n)
	}

	if o.Provider, err = providerFromEnv(getenv); err != nil {
		return Options{}, err
	}
	o.Model = envOr(getenv, "DSHSIM_MODEL", "deepseek-chat")
	if !validModel(o.Model) {
		return Options{}, fmt.Errorf("parse DSHSIM_MODEL: %q is not a model name", o.Model)
	}
	if v := getenv("DEVCLUSTER_POD_IP"); v != "" {
		if o.SourceIP, err = netip.ParseAddr(v); err != nil {
			return Options{}, fmt.Errorf("parse DEVCLUSTER_POD_IP: %w", err)
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

// Provider is a model provider as DSH finds it: the official SDKs'
// <PROVIDER>_BASE_URL and <PROVIDER>_API_KEY (../shared/UPSTREAM.md).
type Provider struct {
	Name    string // deepseek, openai or anthropic
	BaseURL string // without a trailing slash
	Key     string
}

// Anthropic reports whether the provider speaks the messages API; the
// others speak OpenAI's chat completions.
func (p Provider) Anthropic() bool { return p.Name == "anthropic" }

// providerNames is the order the base URLs are looked at: the first set wins.
var providerNames = []string{"deepseek", "openai", "anthropic"}

func providerFromEnv(getenv func(string) string) (Provider, error) {
	for _, name := range providerNames {
		prefix := strings.ToUpper(name)
		base := getenv(prefix + "_BASE_URL")
		if base == "" {
			continue
		}
		u, err := url.Parse(base)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return Provider{}, fmt.Errorf("parse %s_BASE_URL: %q is not an http(s) URL", prefix, base)
		}
		return Provider{Name: name, BaseURL: strings.TrimSuffix(base, "/"), Key: getenv(prefix + "_API_KEY")}, nil
	}
	return Provider{}, nil
}

var modelName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$`)

func validModel(m string) bool { return modelName.MatchString(m) }

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
