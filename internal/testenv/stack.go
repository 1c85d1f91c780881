package testenv

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/embednats/natstest"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
)

// Stack is one test's system: its own NATS server (with the production
// identities and permissions) and namespace, and the aaas processes the
// test starts into them.
type Stack struct {
	t    testing.TB
	pkg  *Package
	NATS *embednats.Server
	// IDs are the stack's NATS identities; JS is connected as Admin.
	IDs *natsauth.Identities
	JS  jetstream.JetStream
	NS  *Namespace
	// Key is the HANDSHAKE_KEYS every process shares.
	Key string
	// Env is added to every process started after it is set.
	Env   map[string]string
	Procs []*Proc
	// PublicHosts are served by every edge started after they are added,
	// besides the edge's own address (see FrontAddr).
	PublicHosts []string
}

// FrontAddr reserves the address of a front (NewFrontAt) and makes it a
// public host of every edge started after.
func (s *Stack) FrontAddr() string {
	addr := FreeAddr(s.t)
	s.PublicHosts = append(s.PublicHosts, addr)
	return addr
}

// NewStack starts NATS with the production identities, runs the setup
// step, and makes a namespace (mutate adjusts the sandbox template and
// pool).
func (p *Package) NewStack(t testing.TB, mutate func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool)) *Stack {
	t.Helper()
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := natstest.StartWith(t, embednats.Options{Users: ids.Users()})
	_, js := natstest.Connect(t, s.URL(), natstest.As(t, ids, natsauth.Admin))
	st := &Stack{t: t, pkg: p, NATS: s, IDs: ids, JS: js, Key: HandshakeKey(),
		// Short enough for the tests' failovers; setup creates the commands'
		// consumer with this acknowledgement wait.
		Env: map[string]string{"COMMAND_ACK_WAIT": "2s", "LEASE_TTL": "2s"}}
	st.Setup()
	st.NS = p.NewNamespace(t, mutate)
	return st
}

// Setup runs the setup step (the setup binary, with the setup identity)
// and fails the test unless it succeeds.
func (s *Stack) Setup() {
	s.t.Helper()
	p := s.pkg.Start(s.t, "setup", s.env("setup", map[string]string{"INSTANCE_ID": "setup"}))
	select {
	case <-p.done:
	case <-time.After(time.Minute):
		s.t.Fatalf("setup did not finish:\n%s", p.Logs())
	}
	if p.ExitCode() != 0 {
		s.t.Fatalf("setup failed:\n%s", p.Logs())
	}
}

// env is the environment of a process of the stack: where NATS is, the
// role's own identity, the stack's settings, and extra.
func (s *Stack) env(name string, extra map[string]string) map[string]string {
	full := map[string]string{"NATS_URL": s.NATS.URL(), "HANDSHAKE_KEYS": s.Key, "NATS_NKEY": s.IDs.SeedFile(natsauth.Role(name))}
	for k, v := range s.Env {
		full[k] = v
	}
	for k, v := range extra {
		full[k] = v
	}
	return full
}

func (s *Stack) start(name string, env map[string]string) *Proc {
	s.t.Helper()
	full := s.env(name, env)
	p := s.pkg.Start(s.t, name, full)
	s.Procs = append(s.Procs, p)
	return p
}

// Lifecycle starts a lifecycle worker as the manifests' ServiceAccount and
// waits until it is ready.
func (s *Stack) Lifecycle(id string) *Proc {
	s.t.Helper()
	p := s.start("lifecycle", map[string]string{
		"KUBECONFIG": s.NS.Kubeconfig, "NAMESPACE": s.NS.Name, "INSTANCE_ID": id,
	})
	p.WaitReady(s.t, time.Minute)
	return p
}

// Edge is a running edge replica.
type Edge struct {
	*Proc
	// URL is http://127.0.0.1:port.
	URL string
}

// Edge starts an edge replica on a free port (plain HTTP, so insecure
// cookies are allowed; signup open unless the test sets an invite; serving
// its own address and the stack's PublicHosts) and waits until it is ready.
func (s *Stack) Edge(id string, env map[string]string) *Edge {
	s.t.Helper()
	addr := FreeAddr(s.t)
	full := map[string]string{
		"LISTEN_ADDR": addr, "INSTANCE_ID": id, "COOKIE_SECURE": "false", "ALLOW_INSECURE_COOKIES": "1",
		"BEACON_INTERVAL": "1s", "SHUTDOWN_TIMEOUT": "5s",
		// Tests sign up without an invite unless they set one.
		"OPEN_SIGNUP":  "true",
		"PUBLIC_HOSTS": strings.Join(append([]string{addr}, s.PublicHosts...), ","),
	}
	for k, v := range env {
		full[k] = v
	}
	p := s.start("edge", full)
	p.WaitReady(s.t, time.Minute)
	return &Edge{Proc: p, URL: "http://" + addr}
}

// Sweeper starts a sweeper and waits until it is ready.
func (s *Stack) Sweeper(id string, env map[string]string) *Proc {
	s.t.Helper()
	full := map[string]string{"INSTANCE_ID": id}
	for k, v := range env {
		full[k] = v
	}
	p := s.start("sweeper", full)
	p.WaitReady(s.t, time.Minute)
	return p
}

// NoRedirects is an HTTP client that returns redirects instead of
// following them.
func NoRedirects() *http.Client {
	return &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }, Timeout: 2 * time.Minute}
}

// Sandboxes is a watch cache of the sandboxes bucket, alive for the rest of
// the test: tests wait on its phases the way the edge does.
func (s *Stack) Sandboxes() *kv.Cache[kv.Sandbox] {
	s.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.t.Cleanup(cancel)
	b, err := kv.Open[kv.Sandbox](ctx, s.JS, kv.BucketSandboxes)
	if err != nil {
		s.t.Fatal(err)
	}
	c, err := kv.NewCache(ctx, b, ">", Logger())
	if err != nil {
		s.t.Fatal(err)
	}
	return c
}

// AuditLog is the whole audit stream, one JSON event per line, so tests can
// look for an event or make sure a secret never reached it.
func (s *Stack) AuditLog() string {
	s.t.Helper()
	ctx := Context(s.t, time.Minute)
	st, err := s.JS.Stream(ctx, events.StreamAudit)
	if err != nil {
		s.t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	var b strings.Builder
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		if m, err := st.GetMsg(ctx, seq); err == nil {
			b.Write(m.Data)
			b.WriteByte('\n')
		}
	}
	return b.String()
}
