package testenv

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/state"
)

// Stack is one test's system: its own NATS server (with the production
// identities and permissions) and namespace, and the aaas processes the
// test starts into them.
type Stack struct {
	t    testing.TB
	pkg  *Package
	NATS *embednats.Server
	// Cluster, instead of NATS when StackOptions.NATSNodes > 1, is a
	// cluster of nats-server processes.
	Cluster *NATSCluster
	// Faults, when StackOptions.Faults is set, sits between every process
	// the stack starts and each NATS node.
	Faults *Faults
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
	boxes       *kv.Cache[state.Sandbox]
	// readySince is each user's latest ReadySince the watch saw (the
	// record drops it once the sandbox leaves Ready).
	readyMu    sync.Mutex
	readySince map[string]time.Time
}

// StackOptions shape a new Stack.
type StackOptions struct {
	// Sandbox adjusts the sandbox template and warm pool (short auth TTLs,
	// dshsim switches, pool size).
	Sandbox func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool)
	// Env is added to every process's environment, the setup step's too.
	Env map[string]string
	// Lifecycle, when set, is the INSTANCE_ID of a lifecycle worker the
	// stack starts (and waits for) before it returns.
	Lifecycle string
	// NATSNodes above 1 runs a cluster of that many nats-server processes
	// with the manifests' configuration, streams and buckets replicated on
	// every node (STREAM_REPLICAS).
	NATSNodes int
	// Faults puts a fault proxy per process and node on the way to NATS.
	Faults bool
}

// FrontAddr reserves the address of a front (NewFrontAt) and makes it a
// public host of every edge started after.
func (s *Stack) FrontAddr() string {
	addr := FreeAddr(s.t)
	s.PublicHosts = append(s.PublicHosts, addr)
	return addr
}

// NewStack starts NATS with the production identities, runs the setup
// step, makes a namespace, and starts what o asks for.
func (p *Package) NewStack(t testing.TB, o StackOptions) *Stack {
	t.Helper()
	devclustertest.Need(t, p.Cluster)
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	st := &Stack{t: t, pkg: p, IDs: ids, Key: HandshakeKey(),
		// Short enough for the tests' failovers; setup creates the commands'
		// consumer with this acknowledgement wait. The development sizing:
		// its caps fit the embedded server's 6 GiB store.
		Env: map[string]string{"COMMAND_ACK_WAIT": "2s", "LEASE_TTL": "2s", "EXPECTED_ACCOUNTS": "10000"}}
	if o.NATSNodes > 1 {
		st.Cluster = StartNATSCluster(t, o.NATSNodes, ids)
		st.Env["STREAM_REPLICAS"] = fmt.Sprint(o.NATSNodes)
	} else {
		st.NATS = natstest.StartWith(t, embednats.Options{Users: ids.Users()})
		WatchNATS(t, st.NATS)
	}
	if o.Faults {
		st.Faults = NewFaults(t)
	}
	_, st.JS = natstest.Connect(t, st.NATSURLs(), natstest.As(t, ids, natsauth.Admin))
	for k, v := range o.Env {
		st.Env[k] = v
	}
	st.Setup()
	st.watchSandboxes()
	st.NS = p.NewNamespace(t, o.Sandbox)
	if o.Lifecycle != "" {
		st.Lifecycle(o.Lifecycle)
	}
	return st
}

// Setup runs the setup step (the setup binary, with the setup identity)
// and fails the test unless it succeeds.
func (s *Stack) Setup() {
	s.t.Helper()
	s.pkg.Start(s.t, "setup", s.env("setup", map[string]string{"INSTANCE_ID": "setup"})).Wait(s.t, time.Minute)
}

// LoseNATS is NATS losing everything: the server stops, its store is
// deleted, it starts empty on the same address, and setup runs again (as
// lifecycle's init container or an operator would). No aaas process is
// restarted.
func (s *Stack) LoseNATS() {
	s.t.Helper()
	s.NATS.Stop()
	if err := os.RemoveAll(s.NATS.Dir()); err != nil {
		s.t.Fatal(err)
	}
	n, err := s.NATS.Restart()
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(n.Stop)
	s.NATS = n
	s.Setup()
}

// env is the environment of a process of the stack: where NATS is, the
// role's own identity, the stack's settings, and extra.
func (s *Stack) env(name string, extra map[string]string) map[string]string {
	full := map[string]string{"HANDSHAKE_KEYS": s.Key, "NATS_NKEY": s.IDs.SeedFile(natsauth.Role(name))}
	for k, v := range s.Env {
		full[k] = v
	}
	for k, v := range extra {
		full[k] = v
	}
	full["NATS_URL"] = s.NATSURLs()
	if s.Faults != nil && name != "setup" {
		full["NATS_URL"] = s.Faults.Links(full["INSTANCE_ID"], s.natsAddrs())
	}
	return full
}

// NATSURLs is the client URL list of the stack's NATS, without fault
// proxies.
func (s *Stack) NATSURLs() string {
	if s.Cluster != nil {
		return s.Cluster.URLs()
	}
	return s.NATS.URL()
}

func (s *Stack) natsAddrs() []string {
	if s.Cluster == nil {
		return []string{strings.TrimPrefix(s.NATS.URL(), "nats://")}
	}
	var addrs []string
	for _, n := range s.Cluster.Nodes {
		addrs = append(addrs, n.Addr())
	}
	return addrs
}

func (s *Stack) start(name string, env map[string]string) *Proc {
	s.t.Helper()
	full := s.env(name, env)
	p := s.pkg.Start(s.t, name, full)
	s.Procs = append(s.Procs, p)
	return p
}

// Lifecycle starts a lifecycle worker as the manifests' ServiceAccount and
// waits until it is ready. With Faults, its Kubernetes API traffic goes
// through a fault link too, named "kube-<id>".
func (s *Stack) Lifecycle(id string) *Proc {
	s.t.Helper()
	kubeconfig := s.NS.Kubeconfig
	if s.Faults != nil {
		kubeconfig = s.faultyKubeconfig("kube-" + id)
	}
	p := s.start("lifecycle", map[string]string{
		"KUBECONFIG": kubeconfig, "SANDBOX_NAMESPACE": s.NS.Name, "INSTANCE_ID": id,
	})
	p.WaitReady(s.t, time.Minute)
	return p
}

// faultyKubeconfig is the namespace's kubeconfig with the API server
// reached through the fault link name (the server's certificate names
// 127.0.0.1, so TLS is unaffected by the port).
func (s *Stack) faultyKubeconfig(name string) string {
	s.t.Helper()
	cfg, err := clientcmd.LoadFromFile(s.NS.Kubeconfig)
	if err != nil {
		s.t.Fatal(err)
	}
	for _, c := range cfg.Clusters {
		u, err := url.Parse(c.Server)
		if err != nil {
			s.t.Fatal(err)
		}
		link := strings.TrimPrefix(s.Faults.Links(name, []string{u.Host}), "nats://")
		u.Host = link
		c.Server = u.String()
	}
	path := filepath.Join(s.t.TempDir(), name+".kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		s.t.Fatal(err)
	}
	return path
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
		"BEACON_INTERVAL": "1s", "BEACON_TTL": "3s", "SHUTDOWN_TIMEOUT": "5s",
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

// Broker is a running model-API broker.
type Broker struct {
	*Proc
	// URL is http://127.0.0.1:port; sandboxes call URL/<provider>/….
	URL string
}

// Broker starts a broker on a free port and waits until it is ready (its
// sandboxes index loaded). env must name the providers
// (BROKER_PROVIDERS); BROKER_KEYS_DIR defaults to an empty directory
// (providers called without a key).
func (s *Stack) Broker(id string, env map[string]string) *Broker {
	s.t.Helper()
	addr := FreeAddr(s.t)
	full := map[string]string{"BROKER_ADDR": addr, "INSTANCE_ID": id, "BROKER_KEYS_DIR": s.t.TempDir(),
		"BEACON_INTERVAL": "1s", "SHUTDOWN_TIMEOUT": "5s"}
	for k, v := range env {
		full[k] = v
	}
	p := s.start("broker", full)
	p.WaitReady(s.t, time.Minute)
	return &Broker{Proc: p, URL: "http://" + addr}
}

// SandboxesCallBroker is a StackOptions.Sandbox that points every model
// base URL the sandbox template sets (<PROVIDER>_BASE_URL) at a broker
// listening on addr, as the manifests point them at its Service.
func SandboxesCallBroker(addr string) func(*extv1beta1.SandboxTemplate, *extv1beta1.SandboxWarmPool) {
	return func(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[0]
		for i := range c.Env {
			if name, ok := strings.CutSuffix(c.Env[i].Name, "_BASE_URL"); ok {
				c.Env[i].Value = "http://" + addr + "/" + strings.ToLower(name)
			}
		}
	}
}

// NoRedirects is an HTTP client that returns redirects instead of
// following them.
func NoRedirects() *http.Client {
	return &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }, Timeout: 2 * time.Minute}
}

// Sandboxes is a watch cache of the sandboxes bucket, alive for the rest of
// the test: tests wait on its phases the way the edge does.
func (s *Stack) Sandboxes() *kv.Cache[state.Sandbox] { return s.boxes }

// watchSandboxes starts the cache Sandboxes returns.
func (s *Stack) watchSandboxes() {
	s.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.t.Cleanup(cancel)
	b, err := kv.Open[state.Sandbox](ctx, s.JS, state.BucketSandboxes)
	if err != nil {
		s.t.Fatal(err)
	}
	s.readySince = map[string]time.Time{}
	remember := kv.OnChange(func(user string, e kv.Entry[state.Sandbox], deleted bool) {
		if !deleted && !e.Value.ReadySince.IsZero() {
			s.readyMu.Lock()
			s.readySince[user] = e.Value.ReadySince
			s.readyMu.Unlock()
		}
	})
	if s.boxes, err = kv.NewCache(ctx, b, ">", Logger(), remember); err != nil {
		s.t.Fatal(err)
	}
}

// Box is user's sandbox as the watch cache has it now.
func (s *Stack) Box(user string) state.Sandbox {
	e, _ := s.boxes.Get(user)
	return e.Value
}

// WaitPhase waits until the stack's watch shows user's sandbox in phase,
// failing t once within has passed.
func (s *Stack) WaitPhase(t testing.TB, user string, phase state.Phase, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if _, _, err := s.boxes.Wait(ctx, user, func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase == phase }); err != nil {
		t.Fatalf("%s not %s: %+v", user, phase, s.Box(user))
	}
}

// Suspend asks lifecycle to suspend user's sandbox, as the sweeper does,
// and waits until it is Suspended.
func (s *Stack) Suspend(user string) {
	s.t.Helper()
	ctx := Context(s.t, time.Minute)
	pub := events.NewPublisher(s.JS, "test", Logger())
	// The edge's last beacon for a request that just ended may land after
	// the activity sequence read here, and lifecycle rightly refuses a
	// suspend decided on older evidence: then decide again.
	for range 5 {
		e, _ := s.boxes.Get(user)
		var seq uint64
		if stream, err := s.JS.Stream(ctx, events.StreamActivity); err == nil {
			if m, err := stream.GetLastMsgForSubject(ctx, events.ActivitySubjectUser(user)); err == nil {
				seq = m.Sequence
			}
		}
		if _, err := pub.Command(ctx, events.NewSuspend(user, seq, e.Revision, time.Now(), "idle", "")); err != nil {
			s.t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, _, err := s.boxes.Wait(wctx, user, func(e kv.Entry[state.Sandbox], _ bool) bool {
			return e.Value.Phase == state.PhaseSuspended
		})
		cancel()
		if err == nil {
			return
		}
	}
	s.t.Fatalf("%s not suspended: %+v", user, s.Box(user))
}

// PodLog is the log of user's sandbox pod, read through the API server.
func (s *Stack) PodLog(user string) string {
	s.t.Helper()
	b, err := s.pkg.Cluster.Client.CoreV1().Pods(s.NS.Name).GetLogs(s.Box(user).PodName, &corev1.PodLogOptions{}).DoRaw(Context(s.t, time.Minute))
	if err != nil {
		s.t.Fatal(err)
	}
	return string(b)
}

// EndPod marks user's sandbox pod Failed with reason and message, as the
// kubelet does when it evicts a pod: the node never runs it again.
func (s *Stack) EndPod(user, reason, message string) {
	s.t.Helper()
	ctx := Context(s.t, time.Minute)
	pods := s.pkg.Cluster.Client.CoreV1().Pods(s.NS.Name)
	// The node writes the pod's status too: retry on its newer versions.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := pods.Get(ctx, s.Box(user).PodName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		pod.Status.Phase, pod.Status.Reason, pod.Status.Message = corev1.PodFailed, reason, message
		for i := range pod.Status.Conditions {
			if pod.Status.Conditions[i].Type == corev1.PodReady {
				pod.Status.Conditions[i].Status = corev1.ConditionFalse
			}
		}
		_, err = pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		s.t.Fatal(err)
	}
}

// Claims counts the SandboxClaims in the stack's namespace.
func (s *Stack) Claims() int {
	s.t.Helper()
	_, ext, _ := s.pkg.Cluster.SandboxClients()
	l, err := ext.ExtensionsV1beta1().SandboxClaims(s.NS.Name).List(Context(s.t, time.Minute), metav1.ListOptions{})
	if err != nil {
		s.t.Fatal(err)
	}
	return len(l.Items)
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

// readAll passes fn every message an ordered consumer of stream with cfg
// has for it now, oldest first. A read the cluster interrupts (a fault
// test's partition, a stream leader moving: "no responders") starts over
// with a new consumer until the read completes, so fn sees each message
// once.
func (s *Stack) readAll(stream string, cfg jetstream.OrderedConsumerConfig, fn func(jetstream.Msg)) {
	s.t.Helper()
	var msgs []jetstream.Msg
	testutil.Eventually(s.t, time.Minute, func() (err error) {
		msgs, err = s.tryReadAll(stream, cfg)
		return err
	})
	for _, m := range msgs {
		fn(m)
	}
}

func (s *Stack) tryReadAll(stream string, cfg jetstream.OrderedConsumerConfig) ([]jetstream.Msg, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cons, err := s.JS.OrderedConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, err
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return nil, err
	}
	var msgs []jetstream.Msg
	for pending := info.NumPending; pending > 0; {
		batch, err := cons.Fetch(int(min(pending, 1000)), jetstream.FetchMaxWait(10*time.Second))
		if err != nil {
			return nil, err
		}
		got := 0
		for m := range batch.Messages() {
			got++
			msgs = append(msgs, m)
			if meta, err := m.Metadata(); err == nil {
				pending = meta.NumPending
			}
		}
		if err := batch.Error(); err != nil || got == 0 {
			return nil, fmt.Errorf("reading %s: %d messages pending, none delivered (%v)", stream, pending, err)
		}
	}
	return msgs, nil
}

// Idleness is what the activity stream says about a user's idle clock,
// read as the sweeper reads it: each edge's newest beacon by the stream's
// clock (events.Beacon.At).
type Idleness struct {
	// Last is when the user was last seen active (or the sandbox last
	// became Ready, if later); Pinned is until when a beacon reporting work in
	// flight keeps the sandbox busy.
	Last, Pinned time.Time
	// Stamped is when the stream stored each edge's newest beacon.
	Stamped map[string]time.Time
}

// Due is when the user falls idle for idle.
func (i Idleness) Due(idle time.Duration) time.Time {
	if d := i.Last.Add(idle); d.After(i.Pinned) {
		return d
	}
	return i.Pinned
}

// Idleness reads user's idle clock from the activity stream now.
func (s *Stack) Idleness(user string) Idleness {
	s.t.Helper()
	s.readyMu.Lock()
	i := Idleness{Last: s.readySince[user], Stamped: map[string]time.Time{}}
	s.readyMu.Unlock()
	s.readAll(events.StreamActivity, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{events.ActivitySubjectUser(user)}, DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy,
	}, func(m jetstream.Msg) {
		meta, err := m.Metadata()
		if err != nil {
			s.t.Fatal(err)
		}
		b, err := events.Decode[events.Beacon](m.Data())
		if err != nil {
			s.t.Fatal(err)
		}
		last, ttl := b.At(meta.Timestamp)
		if b.InFlight > 0 {
			last = latest(last, meta.Timestamp)
			i.Pinned = latest(i.Pinned, meta.Timestamp.Add(ttl))
		}
		i.Last = latest(i.Last, last)
		i.Stamped[b.Edge] = meta.Timestamp
	})
	return i
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// Audit is every audit event of kind about user so far, oldest first.
func (s *Stack) Audit(kind events.AuditKind, user string) []events.AuditEvent {
	s.t.Helper()
	var out []events.AuditEvent
	s.readAll(events.StreamAudit, jetstream.OrderedConsumerConfig{FilterSubjects: []string{events.AuditSubject(kind, user)}}, func(m jetstream.Msg) {
		e, err := events.Decode[events.AuditEvent](m.Data())
		if err != nil {
			s.t.Fatal(err)
		}
		out = append(out, e)
	})
	return out
}

// Decision is user's newest audited decision to suspend (the sweeper's
// "requested"), once there is one: when the sweeper made it (its round's
// clock) and which replica did.
func (s *Stack) Decision(user string) (e events.AuditEvent, ok bool) {
	s.t.Helper()
	for _, a := range s.Audit(events.AuditSuspend, user) {
		if a.Outcome == "requested" {
			e, ok = a, true
		}
	}
	return e, ok
}

// WaitCommandsDone waits until lifecycle has carried out every command
// published so far: the commands consumer has none pending and none
// delivered but unacknowledged.
func (s *Stack) WaitCommandsDone(within time.Duration) {
	s.t.Helper()
	ctx := Context(s.t, within)
	var last string
	for {
		c, err := s.JS.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
		if err == nil {
			info := c.CachedInfo()
			if info.NumPending == 0 && info.NumAckPending == 0 {
				return
			}
			last = fmt.Sprintf("%d pending, %d unacknowledged", info.NumPending, info.NumAckPending)
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			s.t.Fatalf("commands not carried out within %s: %s", within, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
