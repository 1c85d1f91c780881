// Command bench measures the edge's proxy side by side with the proxies it
// must beat, in one run on one machine, against one dshsim pod: wrk
// throughput for 1 KiB and 1 MiB responses directly, through nginx,
// haproxy, Caddy, Traefik, configurable-http-proxy and the edge; p50/p99
// at a fixed open-loop rate; WebSocket echo round trips; memory per idle
// WebSocket; and NATS messages per 10k requests. It starts the whole stack (as
// `make run` does), writes docs/BENCHMARKS.md, and prints it.
//
// Usage (from `make bench`): go run ./hack/bench -bin bin -out docs/BENCHMARKS.md
// A quick look: go run ./hack/bench -d 3s -rounds 1 -targets direct,nginx,edge -out /tmp/b.md
package main

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/dev/devstack"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/procstat"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// allTargets in the order they run and are reported.
var allTargets = []string{"direct", "nginx", "haproxy", "caddy", "traefik", "chp", "edge"}

type options struct {
	bin, out     string
	dur, warmup  time.Duration
	rounds       int
	maxOther     float64
	targets      map[string]bool
	rate         float64
	peerThreads  int
	sockets      int
	socketsAsked int
	models       bool
	modelIdle    int
	profile      bool
}

func main() {
	var o options
	flag.StringVar(&o.bin, "bin", "bin", "directory of the aaas binaries")
	flag.StringVar(&o.out, "out", "docs/BENCHMARKS.md", "report file")
	flag.DurationVar(&o.dur, "d", 10*time.Second, "duration of each measured run")
	flag.DurationVar(&o.warmup, "warmup", 0, "warm-up run before each measured run (0: d/5, at least 1s)")
	flag.IntVar(&o.rounds, "rounds", 3, "rounds over all targets, of the throughput and of the fixed-rate runs; the report gives medians")
	targets := flag.String("targets", strings.Join(allTargets, ","), "targets to measure, comma-separated, of "+strings.Join(allTargets, ", "))
	flag.Float64Var(&o.rate, "rate", 0, "req/s of the fixed-rate latency runs (0: half the best of nginx and haproxy at 1 KiB)")
	flag.IntVar(&o.peerThreads, "peer-threads", runtime.NumCPU(), "nginx worker processes, haproxy threads, and Caddy's and Traefik's GOMAXPROCS (the edge's Go runtime uses every core)")
	flag.Float64Var(&o.maxOther, "max-other", 0.25, "repeat a measured run (at most twice) when other processes used more cores than this during it")
	flag.IntVar(&o.sockets, "ws", 10000, "idle WebSockets to hold open through the edge (0 skips)")
	flag.BoolVar(&o.profile, "profile", true, "after the measured runs, count the system calls per 1 KiB request of the edge and nginx (strace -c) and profile the edge's CPU (pprof)")
	flag.BoolVar(&o.models, "models", true, "measure model calls through the broker beside direct calls to the provider stand-in")
	flag.IntVar(&o.modelIdle, "model-idle", 5000, "idle model streams to hold open through the broker (0 skips)")
	flag.Parse()
	o.targets = map[string]bool{}
	for _, t := range strings.Split(*targets, ",") {
		if t = strings.TrimSpace(t); !slices.Contains(allTargets, t) {
			fmt.Fprintf(os.Stderr, "bench: unknown target %q (known: %s)\n", t, strings.Join(allTargets, ", "))
			os.Exit(2)
		}
		o.targets[t] = true
	}
	if o.warmup == 0 {
		o.warmup = max(time.Second, o.dur/5)
	}
	o.rounds = max(o.rounds, 1)
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type env struct {
	activity jetstream.Stream
	direct   *target // the dshsim pod, with its auth cookie
	edge     *target // the edge, with the bench user's session
	metrics  string  // edge metrics address
	boxes    *kv.Bucket[state.Sandbox]
}

func run(o options) error {
	if err := checkTools(o.targets, o.profile); err != nil {
		return err
	}
	o.socketsAsked = o.sockets
	o.sockets = raiseFileLimit(o.sockets)
	if o.models {
		// The broker holds two sockets per idle stream; the bench one.
		o.modelIdle = raiseFileLimit(o.modelIdle)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	info, stopStack, err := startStack(ctx, o)
	if err != nil {
		return err
	}
	defer stopStack()
	fmt.Fprintln(os.Stderr, "stack up; preparing")
	e, err := prepare(ctx, info)
	if err != nil {
		return err
	}

	targets, stopPeers, err := startPeers(o, e)
	defer stopPeers()
	if err != nil {
		return err
	}
	var order []*target
	for _, name := range allTargets {
		if o.targets[name] {
			order = append(order, targets[name])
		}
	}
	r := &results{opts: o, versions: versions(o.targets), loadBefore: loadavg(), edgeBuild: edgeBuild(o.bin), wrk: map[string]map[string][]wrkResult{}}

	if err := r.throughput(ctx, e, order); err != nil {
		return err
	}
	if err := r.latency(ctx, order); err != nil {
		return err
	}
	if o.profile {
		if err := r.profile(e, order); err != nil {
			return err
		}
	}
	if o.targets["edge"] {
		if err := r.websockets(e); err != nil {
			return err
		}
	}
	if o.models {
		if err := r.modelCalls(ctx, info, e); err != nil {
			return err
		}
	}
	for _, t := range order {
		if t.note != nil {
			if n := t.note(); n != "" {
				r.notes = append(r.notes, n)
			}
		}
	}

	report := r.report()
	// The scale section (hack/scale) is another run's: kept as it was.
	if old, err := os.ReadFile(o.out); err == nil {
		if i := bytes.Index(old, []byte("<!-- scale:")); i >= 0 {
			report = append(append(bytes.TrimRight(report, "\n"), "\n\n"...), old[i:]...)
		}
	}
	if err := os.WriteFile(o.out, report, 0o644); err != nil {
		return err
	}
	fmt.Print(string(report))
	return nil
}

// startStack starts the bench's stack (devstack: NATS, the control plane,
// the processes, one edge) and returns its addresses and how to stop it.
func startStack(ctx context.Context, o options) (devstack.Info, func(), error) {
	ports := make([]int, 2)
	for i := range ports {
		p, err := embednats.FreePort()
		if err != nil {
			return devstack.Info{}, nil, err
		}
		ports[i] = p
	}
	ready := make(chan devstack.Info, 1)
	stackDone := make(chan error, 1)
	sctx, stopStack := context.WithCancel(ctx)
	go func() {
		stackDone <- devstack.Run(sctx, devstack.Options{
			StateDir: ".run-bench", NATSPort: ports[0], EdgePorts: []int{ports[1]},
			BinDir: o.bin, Out: os.Stderr, Log: slog.New(slog.DiscardHandler), Ready: func(i devstack.Info) { ready <- i },
			Env: stackEnv(),
		})
	}()
	select {
	case info := <-ready:
		return info, func() { stopStack(); <-stackDone }, nil
	case err := <-stackDone:
		stopStack()
		return devstack.Info{}, nil, fmt.Errorf("stack: %v", err)
	case <-ctx.Done():
		stopStack()
		<-stackDone
		return devstack.Info{}, nil, ctx.Err()
	}
}

// startPeers starts the chosen peers. Every peer forwards to the same pod
// the direct runs reach; they idle while another target is under load,
// one target being loaded at a time. stop stops those that started.
func startPeers(o options, e *env) (targets map[string]*target, stop func(), err error) {
	targets = map[string]*target{"direct": e.direct, "edge": e.edge}
	var started []*target
	stop = func() {
		for _, t := range started {
			t.stop()
		}
	}
	for _, name := range peerNames {
		if !o.targets[name] {
			continue
		}
		fmt.Fprintf(os.Stderr, "starting %s\n", name)
		t, err := startPeer(name, e.direct.addr, o.peerThreads, e.direct)
		if err != nil {
			return nil, stop, err
		}
		started = append(started, t)
		targets[name] = t
	}
	return targets, stop, nil
}

// stackEnv is the bench stack's settings: one user holds every socket of
// the memory test, sweeping is not measured here, and the model runs'.
func stackEnv() map[string]string {
	env := map[string]string{"MAX_IN_FLIGHT_PER_USER": "100000", "LOG_LEVEL": "warn", "IDLE_TIMEOUT": "24h", "PPROF": "true"}
	maps.Copy(env, modelEnv)
	return env
}

// sizes are the two response bodies, files uploaded by prepare.
var sizes = []struct{ name, path string }{{"1 KiB", "/api/files/1k.bin"}, {"1 MiB", "/api/files/1m.bin"}}

// eachRound calls run for every target in every round, the order of
// targets rotating by one each round so that no target is always first
// or last.
func (r *results) eachRound(ctx context.Context, order []*target, run func(round int, t *target) error) error {
	for round := range r.opts.rounds {
		rotated := append(slices.Clone(order[round%len(order):]), order[:round%len(order)]...)
		for _, t := range rotated {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := run(round, t); err != nil {
				return err
			}
		}
	}
	return nil
}

// measured performs one measured run and repeats it, at most twice, while
// other processes on the machine used more than -max-other cores during
// it. It returns the cores they used during the run kept.
func (r *results) measured(what string, run func() error) (float64, error) {
	for try := 0; ; try++ {
		s := sampleLoad()
		if err := run(); err != nil {
			return 0, err
		}
		other := s.other()
		if other <= r.opts.maxOther || try == 2 {
			if other > r.opts.maxOther {
				r.disturbed++
			}
			return other, nil
		}
		r.repeated++
		fmt.Fprintf(os.Stderr, "  %s: other processes used %.2f cores; repeating\n", what, other)
	}
}

// throughput runs wrk against every target for both sizes, each measured
// run after a warm-up run on the same URL.
func (r *results) throughput(ctx context.Context, e *env, order []*target) error {
	lastSeq := func() float64 {
		info, err := e.activity.Info(ctx)
		if err != nil {
			return 0
		}
		return float64(info.State.LastSeq)
	}
	for _, size := range sizes {
		r.wrk[size.name] = map[string][]wrkResult{}
	}
	return r.eachRound(ctx, order, func(round int, t *target) error {
		for _, size := range sizes {
			what := fmt.Sprintf("round %d/%d: wrk %s %s", round+1, r.opts.rounds, size.name, t.name)
			fmt.Fprintf(os.Stderr, "%s (warm-up %s, then %s)\n", what, r.opts.warmup, r.opts.dur)
			if _, err := wrk(t, size.path, r.opts.warmup); err != nil {
				return err
			}
			var res wrkResult
			var msgs, beacons float64
			other, err := r.measured(what, func() (err error) {
				natsBefore, _ := metric(e.metrics, "aaas_nats_out_msgs_total")
				beaconsBefore := lastSeq()
				res, err = wrk(t, size.path, r.opts.dur)
				natsAfter, _ := metric(e.metrics, "aaas_nats_out_msgs_total")
				msgs, beacons = natsAfter-natsBefore, lastSeq()-beaconsBefore
				return err
			})
			if err != nil {
				return err
			}
			res.other = other
			if t == e.edge {
				r.natsReqs += res.requests
				r.natsMsgs += msgs
				r.natsBeacons += beacons
			}
			if res.socket != "" {
				r.notes = append(r.notes, fmt.Sprintf("wrk reported for %s, %s, round %d: %s", peerTitle(t.name), size.name, round+1, res.socket))
			}
			r.wrk[size.name][t.name] = append(r.wrk[size.name][t.name], res)
		}
		return nil
	})
}

// latency offers the same Poisson arrivals, at half the 1 KiB peak of the
// better of nginx and haproxy, to every target but configurable-http-proxy
// (whose own peak is below that rate), each measured run after a warm-up
// at the same rate.
func (r *results) latency(ctx context.Context, order []*target) error {
	r.rate = r.opts.rate
	if r.rate == 0 {
		_, best := r.bestPeer("1 KiB", "nginx", "haproxy")
		r.rate = best / 2
	}
	if r.rate == 0 {
		r.notes = append(r.notes, "The fixed-rate latency runs need nginx or haproxy measured, or -rate.")
		return nil
	}
	r.open = map[string][]rateResult{}
	order = slices.DeleteFunc(slices.Clone(order), func(t *target) bool { return t.name == "chp" })
	return r.eachRound(ctx, order, func(round int, t *target) error {
		what := fmt.Sprintf("round %d/%d: open loop %.0f req/s %s", round+1, r.opts.rounds, r.rate, t.name)
		fmt.Fprintf(os.Stderr, "%s (warm-up %s, then %s)\n", what, r.opts.warmup, r.opts.dur)
		g := newGenerator(t, sizes[0].path)
		defer g.close()
		if _, err := g.run(r.rate, r.opts.warmup); err != nil {
			return err
		}
		var res rateResult
		other, err := r.measured(what, func() (err error) {
			cpu := procstat.ProcCPU(os.Getpid())
			res, err = g.run(r.rate, r.opts.dur)
			res.clientCPU = (procstat.ProcCPU(os.Getpid()) - cpu) / time.Duration(max(res.sent, 1))
			return err
		})
		if err != nil {
			return err
		}
		res.other = other
		r.open[t.name] = append(r.open[t.name], res)
		return nil
	})
}

// websockets measures echo round trips directly and through the edge, and
// the edge's memory per idle WebSocket.
func (r *results) websockets(e *env) error {
	fmt.Fprintln(os.Stderr, "websocket round trips")
	var err error
	if r.opts.targets["direct"] {
		if r.wsDirect, err = wsRTT(e.direct, 2000); err != nil {
			return err
		}
	}
	if r.wsEdge, err = wsRTT(e.edge, 2000); err != nil {
		return err
	}
	if r.opts.sockets > 0 {
		fmt.Fprintf(os.Stderr, "%d idle websockets\n", r.opts.sockets)
		if r.perSocket, err = idleSockets(e.edge, r.opts.sockets); err != nil {
			return err
		}
	}
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }
func us(d time.Duration) string { return fmt.Sprintf("%d µs", d.Microseconds()) }

// prepare signs up a bench user, uploads the response files, and performs
// the DSH handshake for direct access.
func prepare(ctx context.Context, info devstack.Info) (*env, error) {
	edgeURL := info.EdgeURLs[0]
	e := &env{metrics: info.Metrics["edge-a"]}
	sid, err := signup(info, "bench")
	if err != nil {
		return nil, err
	}
	// The edge listens on 127.0.0.1 and knows itself as localhost:port; the
	// bench user's sandbox is its own origin, bench.localhost:port, signed
	// into as a browser is (a code minted on the gateway, traded there).
	gateway := strings.TrimPrefix(edgeURL, "http://")
	_, port, _ := strings.Cut(gateway, ":")
	e.edge = &target{name: "edge", addr: "127.0.0.1:" + port, host: "bench." + gateway, pid: info.PIDs["edge-a"]}
	if e.edge.cookie, err = sandboxSignIn(e.edge, gateway, sid); err != nil {
		return nil, err
	}
	for name, size := range map[string]int{"1k.bin": 1 << 10, "1m.bin": 1 << 20} {
		req, _ := http.NewRequest("PUT", e.edge.url("/api/files/"+name), bytes.NewReader(bytes.Repeat([]byte("x"), size)))
		req.Host = e.edge.host
		req.Header.Set("Cookie", e.edge.cookie)
		req.Header.Set("Origin", "http://"+e.edge.host)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			return nil, fmt.Errorf("upload %s: %s", name, resp.Status)
		}
	}

	admin, err := nats.NkeyOptionFromSeed(info.NATSAdmin)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(info.NATSURL, admin)
	if err != nil {
		return nil, err
	}
	js, _ := jetstream.New(nc)
	if e.activity, err = js.Stream(ctx, "AAAS_ACTIVITY"); err != nil {
		return nil, err
	}
	if e.boxes, err = kv.Open[state.Sandbox](ctx, js, state.BucketSandboxes); err != nil {
		return nil, err
	}
	box, err := e.boxes.Get(ctx, "bench")
	if err != nil {
		return nil, err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", info.Kubeconfig)
	if err != nil {
		return nil, err
	}
	kc := kubernetes.NewForConfigOrDie(rc)
	logs, err := kc.CoreV1().Pods(devstack.SandboxNamespace).GetLogs(box.Value.PodName, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	token, err := handshake.TokenFromLog(logs)
	if err != nil {
		return nil, err
	}
	cookie, err := handshake.Exchange(ctx, handshake.Client(), handshake.Request{Address: box.Value.Address, Token: token, Host: "localhost"})
	if err != nil {
		return nil, err
	}
	e.direct = &target{name: "direct", addr: box.Value.Address, host: "localhost", cookie: cookie}
	for _, t := range []*target{e.direct, e.edge} {
		if err := probe(t); err != nil {
			return nil, fmt.Errorf("%s: %v", t.name, err)
		}
	}
	return e, nil
}

// sandboxSignIn signs the holder of gateway session sid into t's sandbox
// origin: the gateway (on the same edge) mints a code for it, the origin
// trades it for its own cookie, which it returns as a Cookie header.
func sandboxSignIn(t *target, gateway, sid string) (string, error) {
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(host, uri string, header ...string) (*http.Response, error) {
		req, _ := http.NewRequest("GET", "http://"+t.addr+uri, nil)
		req.Host = host
		req.Header.Set("Accept", "text/html")
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := noFollow.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return resp, err
	}
	resp, err := get(gateway, auth.SandboxMintPath+"?next="+url.QueryEscape("http://"+t.host+"/"), "Cookie", "dsh_gw_session="+sid)
	if err != nil {
		return "", err
	}
	loc, err := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode != http.StatusSeeOther || err != nil || loc.Host != t.host {
		return "", fmt.Errorf("sandbox sign-in: the gateway answered %s, Location %q", resp.Status, resp.Header.Get("Location"))
	}
	if resp, err = get(t.host, loc.RequestURI()); err != nil {
		return "", err
	}
	name := auth.SandboxCookie(false)
	for _, c := range resp.Cookies() {
		if c.Name == name {
			return name + "=" + c.Value, nil
		}
	}
	return "", fmt.Errorf("sandbox sign-in: the origin answered %s without a %s cookie", resp.Status, name)
}

// signup creates user through the first edge and returns their session id.
func signup(info devstack.Info, user string) (string, error) {
	req, _ := http.NewRequest("POST", info.EdgeURLs[0]+"/users", strings.NewReader("user="+user+"&invite="+info.Invite))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Accept", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return "", fmt.Errorf("signup %s: %s", user, resp.Status)
	}
	for _, c := range resp.Cookies() {
		if c.Name == "dsh_gw_session" {
			return c.Value, nil
		}
	}
	return "", fmt.Errorf("signup %s: no session cookie", user)
}

// wsDial opens a WebSocket to t's echo endpoint with t's Host and cookie.
func wsDial(d *websocket.Dialer, t *target) (*websocket.Conn, error) {
	c, _, err := d.Dial("ws://"+t.addr+t.prefix+"/api/ws", http.Header{"Host": {t.host}, "Cookie": {t.cookie}})
	if err != nil {
		return nil, fmt.Errorf("websocket through %s: %w", t.name, err)
	}
	return c, nil
}

// wsRTT returns the p50 and p99 of n echo round trips through t.
func wsRTT(t *target, n int) ([2]time.Duration, error) {
	c, err := wsDial(&websocket.Dialer{}, t)
	if err != nil {
		return [2]time.Duration{}, err
	}
	defer c.Close()
	msg := []byte("0123456789abcdef")
	var rtts []time.Duration
	for i := 0; i < n; i++ {
		start := time.Now()
		if err := c.WriteMessage(websocket.TextMessage, msg); err != nil {
			return [2]time.Duration{}, err
		}
		if _, _, err := c.ReadMessage(); err != nil {
			return [2]time.Duration{}, err
		}
		rtts = append(rtts, time.Since(start))
	}
	return [2]time.Duration{percentile(rtts, 50), percentile(rtts, 99)}, nil
}

// idleSockets opens n WebSockets through the edge and returns the edge's
// RSS growth per socket.
func idleSockets(edge *target, n int) (float64, error) {
	runtime.GC()
	before, err := procstat.RSS(edge.pid)
	if err != nil {
		return 0, err
	}
	d := websocket.Dialer{HandshakeTimeout: time.Minute, ReadBufferSize: 512, WriteBufferSize: 512}
	conns := make([]*websocket.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < n; i++ {
		c, err := wsDial(&d, edge)
		if err != nil {
			return 0, fmt.Errorf("socket %d: %w", i, err)
		}
		conns = append(conns, c)
	}
	time.Sleep(2 * time.Second) // let the edge settle its buffers
	after, err := procstat.RSS(edge.pid)
	if err != nil {
		return 0, err
	}
	return float64(after-before) / float64(n), nil
}

// metric reads one unlabelled value from a /metrics endpoint.
func metric(addr, name string) (float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	s := bufio.NewScanner(resp.Body)
	for s.Scan() {
		if f := strings.Fields(s.Text()); len(f) == 2 && f[0] == name {
			return strconv.ParseFloat(f[1], 64)
		}
	}
	return 0, fmt.Errorf("no metric %s", name)
}

// raiseFileLimit lifts the open-file limit for this process and the stack
// it starts (children inherit it); the idle-socket test needs about three
// descriptors per socket across the processes. It returns how many
// sockets fit.
func raiseFileLimit(want int) int {
	need := uint64(want)*2 + 1024
	var lim syscall.Rlimit
	_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	if lim.Max < need {
		lim.Max = need
	}
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	if fit := int((lim.Cur - 1024) / 2); fit < want {
		fmt.Fprintf(os.Stderr, "open-file limit %d: holding %d sockets instead of %d\n", lim.Cur, fit, want)
		return fit
	}
	return want
}
