package config

import (
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// Common holds the settings every process shares.
type Common struct {
	// NATSURL is NATS_URL: one or more comma-separated server URLs.
	NATSURL string
	// NATS holds how the process authenticates to NATS and verifies it.
	NATS NATSAuth
	// NATSFailoverWait is NATS_FAILOVER_WAIT: how long a command or KV
	// write keeps trying while a NATS node's streams elect new leaders
	// (raft takes 4-9 s); past it, without quorum, requests that need a
	// write answer 503.
	NATSFailoverWait time.Duration
	// InstanceID is INSTANCE_ID, this replica's name in beacons, leases and
	// audit events; defaults to the host name plus a random suffix.
	InstanceID string
	// MetricsAddr is METRICS_ADDR, where /metrics is served ("" disables).
	MetricsAddr string
	// Pprof is PPROF: Go's profiler under /debug/pprof/ on the metrics
	// address, for profiling a live process (off by default: it lets
	// whoever reaches the metrics port slow the process down).
	Pprof bool
	// LogLevel is LOG_LEVEL: debug, info, warn or error.
	LogLevel slog.Level
	// Streams and Buckets size NATS state; STREAM_REPLICAS sets both
	// replica counts, AUDIT_MAX_AGE and AUDIT_MAX_MB the audit retention.
	Streams events.StreamsConfig
	Buckets state.BucketsConfig
}

var instanceRE = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// LoadCommon reads the shared variables. defaultMetrics is the process's
// default METRICS_ADDR.
func LoadCommon(e *Env, defaultMetrics string) Common {
	c := Common{
		NATSURL:          e.String("NATS_URL", "nats://127.0.0.1:4222"),
		InstanceID:       e.String("INSTANCE_ID", defaultInstanceID()),
		MetricsAddr:      e.String("METRICS_ADDR", defaultMetrics),
		Pprof:            e.Bool("PPROF", false),
		NATSFailoverWait: e.Duration("NATS_FAILOVER_WAIT", 15*time.Second, 0, 5*time.Minute),
		Streams:          events.DefaultStreamsConfig(),
		Buckets:          state.DefaultBucketsConfig(),
	}
	c.NATS = loadNATSAuth(e)
	if !instanceRE.MatchString(c.InstanceID) {
		e.Fail("INSTANCE_ID", "%q must be 1-64 letters, digits, '-' or '_'", c.InstanceID)
	}
	if err := c.LogLevel.UnmarshalText([]byte(e.OneOf("LOG_LEVEL", "info", "debug", "info", "warn", "error"))); err != nil {
		e.Fail("LOG_LEVEL", "%v", err)
	}
	replicas := e.Int("STREAM_REPLICAS", 1, 1, 5)
	c.Streams.Replicas, c.Buckets.Replicas = replicas, replicas
	c.Streams.AuditMaxAge = e.Duration("AUDIT_MAX_AGE", c.Streams.AuditMaxAge, time.Hour, 10*365*24*time.Hour)
	c.Streams.AuditMaxBytes = int64(e.Int("AUDIT_MAX_MB", int(c.Streams.AuditMaxBytes>>20), 16, 1<<20)) << 20
	// Bucket limits every process provisions; they must agree, so these
	// edge settings are read everywhere.
	c.Buckets.SessionTTL = e.Duration("COOKIE_MAX_AGE", c.Buckets.SessionTTL, time.Minute, 365*24*time.Hour)
	c.Buckets.RateWindow = e.Duration("AUTH_RATE_WINDOW", c.Buckets.RateWindow, time.Second, 24*time.Hour)
	// A sign-in code only carries a browser from the gateway to a sandbox
	// origin, one redirect: a minute is ample, and the less time a code
	// (which is in a URL) is good for, the less a leaked one is worth.
	c.Buckets.SigninCodeTTL = e.Duration("SIGNIN_CODE_TTL", c.Buckets.SigninCodeTTL, 5*time.Second, time.Minute)
	// The caps of the buckets that grow with accounts (README, Sizing).
	c.Buckets.Accounts = e.Int("EXPECTED_ACCOUNTS", DefaultExpectedAccounts, 1000, 100_000_000)
	c.Buckets.SessionsPerUser = e.Int("EXPECTED_SESSIONS_PER_USER", DefaultExpectedSessionsPerUser, 1, 1000)
	return c
}

// DefaultExpectedAccounts and DefaultExpectedSessionsPerUser size a
// deployment's buckets when EXPECTED_ACCOUNTS and
// EXPECTED_SESSIONS_PER_USER are not set: a million accounts, signed in
// from five browsers each.
const (
	DefaultExpectedAccounts        = 1_000_000
	DefaultExpectedSessionsPerUser = 5
)

// NATSStoreBytes is what the streams and buckets reserve on each NATS
// node: its max_file_store must be at least this (README, Sizing).
func (c Common) NATSStoreBytes() int64 { return c.Streams.StoreBytes() + c.Buckets.StoreBytes() }

func defaultInstanceID() string {
	host, _ := os.Hostname()
	host = strings.Map(func(r rune) rune {
		if r == '.' {
			return '-'
		}
		return r
	}, host)
	if len(host) > 48 {
		host = host[:48]
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	if host == "" {
		return hex.EncodeToString(b)
	}
	return host + "-" + hex.EncodeToString(b)
}

// NATSAuth is the process's NATS identity and TLS settings.
type NATSAuth struct {
	// NKey is NATS_NKEY, the file holding this process kind's nkey seed;
	// Creds is NATS_CREDS, a JWT credentials file. One is required unless
	// Anonymous (NATS_ALLOW_ANONYMOUS, for a server without authorization).
	NKey, Creds string
	Anonymous   bool
	// CA is NATS_CA, the CA bundle that verifies the server; Cert and Key
	// are NATS_CERT and NATS_KEY, a client certificate for servers that
	// require one.
	CA, Cert, Key string
}

func loadNATSAuth(e *Env) NATSAuth {
	a := NATSAuth{
		NKey: e.String("NATS_NKEY", ""), Creds: e.String("NATS_CREDS", ""), Anonymous: e.Bool("NATS_ALLOW_ANONYMOUS", false),
		CA: e.String("NATS_CA", ""), Cert: e.String("NATS_CERT", ""), Key: e.String("NATS_KEY", ""),
	}
	switch {
	case a.NKey != "" && a.Creds != "":
		e.Fail("NATS_NKEY", "set NATS_NKEY or NATS_CREDS, not both")
	case a.NKey == "" && a.Creds == "" && !a.Anonymous:
		e.Fail("NATS_NKEY", "no NATS identity: set NATS_NKEY (or NATS_CREDS); NATS_ALLOW_ANONYMOUS=true only for a server without authorization")
	}
	if (a.Cert == "") != (a.Key == "") {
		e.Fail("NATS_CERT", "NATS_CERT and NATS_KEY go together")
	}
	for name, path := range map[string]string{"NATS_NKEY": a.NKey, "NATS_CREDS": a.Creds, "NATS_CA": a.CA, "NATS_CERT": a.Cert, "NATS_KEY": a.Key} {
		if path == "" {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			e.Fail(name, "cannot read %s: %v", path, err)
		}
	}
	return a
}
