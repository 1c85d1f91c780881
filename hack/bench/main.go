// Command bench measures the edge's proxy against talking to DSH directly,
// in one run on one machine: throughput and added p99 latency for 1 KiB
// and 1 MiB responses (wrk), WebSocket echo round trips, memory per idle
// WebSocket, and NATS operations per 10k requests. It starts the whole
// stack (as `make run` does), writes docs/BENCHMARKS.md, and prints it.
//
// Usage (from `make bench`): go run ./hack/bench -bin bin -out docs/BENCHMARKS.md
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"runtime"
	"sort"
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

	"github.com/aaas-project/aaas/internal/devstack"
	"github.com/aaas-project/aaas/internal/embednats"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

func main() {
	bin := flag.String("bin", "bin", "directory of the aaas binaries")
	out := flag.String("out", "docs/BENCHMARKS.md", "report file")
	dur := flag.Duration("d", 10*time.Second, "duration of each wrk run")
	sockets := flag.Int("ws", 10000, "idle WebSockets to hold open")
	flag.Parse()
	if err := run(*bin, *out, *dur, *sockets); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type env struct {
	activity  jetstream.Stream
	edge      string // http://localhost:port
	edgePID   int
	metrics   string // edge metrics address
	sid       string
	direct    string // http://podIP:3080
	dshCookie string
}

func run(bin, out string, dur time.Duration, sockets int) error {
	if _, err := exec.LookPath("wrk"); err != nil {
		return errors.New("wrk not installed: run `make bench` (it installs it)")
	}
	asked := sockets
	sockets = raiseFileLimit(sockets)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	ports := make([]int, 2)
	for i := range ports {
		p, err := embednats.FreePort()
		if err != nil {
			return err
		}
		ports[i] = p
	}
	ready := make(chan devstack.Info, 1)
	stackDone := make(chan error, 1)
	sctx, stopStack := context.WithCancel(ctx)
	go func() {
		stackDone <- devstack.Run(sctx, devstack.Options{
			StateDir: ".run-bench", NATSPort: ports[0], EdgePorts: []int{ports[1]},
			BinDir: bin, Out: os.Stderr, Log: slog.New(slog.DiscardHandler), Ready: func(i devstack.Info) { ready <- i },
			// One user holds every socket of the memory test; sweeping is
			// not measured here.
			Env: map[string]string{"MAX_IN_FLIGHT_PER_USER": "100000", "LOG_LEVEL": "warn", "IDLE_TIMEOUT": "24h"},
		})
	}()
	var info devstack.Info
	select {
	case info = <-ready:
	case err := <-stackDone:
		stopStack()
		return fmt.Errorf("stack: %v", err)
	case <-ctx.Done():
		stopStack()
		<-stackDone
		return ctx.Err()
	}
	defer func() { stopStack(); <-stackDone }()
	fmt.Fprintln(os.Stderr, "stack up; preparing")
	e, err := prepare(ctx, info)
	if err != nil {
		return err
	}

	var report bytes.Buffer
	fmt.Fprintf(&report, "# Benchmarks\n\nMeasured by `make bench` (`hack/bench`) on %s, %d cores, %s. Direct means wrk talks to the dshsim pod itself (with its auth cookie); proxied means through one edge (session cookie, handshake cached). Both run in the same invocation on the same machine; wrk uses 1 thread and 32 connections for %s per run.\n\n",
		time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), runtime.Version(), dur)
	fmt.Fprintln(&report, "| response | direct req/s | proxied req/s | ratio | direct p99 | proxied p99 | added p99 |")
	fmt.Fprintln(&report, "|---|---|---|---|---|---|---|")
	var natsReqs, natsMsgs, natsBeacons float64
	lastSeq := func() float64 {
		info, err := e.activity.Info(ctx)
		if err != nil {
			return 0
		}
		return float64(info.State.LastSeq)
	}
	for _, size := range []struct {
		name, file string
	}{{"1 KiB", "1k.bin"}, {"1 MiB", "1m.bin"}} {
		fmt.Fprintf(os.Stderr, "wrk %s direct\n", size.name)
		d, err := wrk(e.direct+"/api/files/"+size.file, dur, "Cookie: "+e.dshCookie, "Host: localhost")
		if err != nil {
			return err
		}
		before, _ := metric(e.metrics, "aaas_nats_out_msgs_total")
		beaconsBefore := lastSeq()
		fmt.Fprintf(os.Stderr, "wrk %s proxied\n", size.name)
		p, err := wrk(e.edge+"/u/bench/api/files/"+size.file, dur, "Cookie: dsh_gw_session="+e.sid)
		if err != nil {
			return err
		}
		after, _ := metric(e.metrics, "aaas_nats_out_msgs_total")
		natsReqs += p.requests
		natsMsgs += after - before
		natsBeacons += lastSeq() - beaconsBefore
		fmt.Fprintf(&report, "| %s | %.0f | %.0f | %.2f | %s | %s | %s |\n", size.name, d.rps, p.rps, p.rps/d.rps,
			ms(d.p99), ms(p.p99), ms(p.p99-d.p99))
	}

	fmt.Fprintln(os.Stderr, "websocket round trips")
	directRTT, err := wsRTT(strings.Replace(e.direct, "http", "ws", 1)+"/api/ws", http.Header{"Cookie": {e.dshCookie}, "Host": {"localhost"}}, 2000)
	if err != nil {
		return err
	}
	proxiedRTT, err := wsRTT(strings.Replace(e.edge, "http", "ws", 1)+"/u/bench/api/ws", http.Header{"Cookie": {"dsh_gw_session=" + e.sid}}, 2000)
	if err != nil {
		return err
	}
	fmt.Fprintf(&report, "\n| WebSocket echo (2000 round trips, 16 B) | direct | proxied | added |\n|---|---|---|---|\n")
	fmt.Fprintf(&report, "| p50 | %s | %s | %s |\n", us(directRTT[0]), us(proxiedRTT[0]), us(proxiedRTT[0]-directRTT[0]))
	fmt.Fprintf(&report, "| p99 | %s | %s | %s |\n", us(directRTT[1]), us(proxiedRTT[1]), us(proxiedRTT[1]-directRTT[1]))

	fmt.Fprintf(os.Stderr, "%d idle websockets\n", sockets)
	perSocket, err := idleSockets(e, sockets)
	if err != nil {
		return err
	}
	fmt.Fprintf(&report, "\n| idle WebSockets held by one edge | edge RSS per socket |\n|---|---|\n| %d | %.1f KiB |\n", sockets, perSocket/1024)
	if sockets < asked {
		fmt.Fprintf(&report, "\nThe machine's open-file limit allowed %d of the %d sockets asked for (the edge needs two descriptors per socket: browser side and DSH side).\n", sockets, asked)
	}

	fmt.Fprintf(&report, "\n| NATS messages sent by the edge while proxying %.0f requests | per 10k requests |\n|---|---|\n| all | %.1f |\n| of which activity beacons | %.1f |\n", natsReqs, 10000*natsMsgs/natsReqs, 10000*natsBeacons/natsReqs)
	fmt.Fprintf(&report, "\nThe edge publishes at most about one activity beacon per user per second, so the count above scales with time, not with requests.\n")

	if err := os.WriteFile(out, report.Bytes(), 0o644); err != nil {
		return err
	}
	fmt.Print(report.String())
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }
func us(d time.Duration) string { return fmt.Sprintf("%d µs", d.Microseconds()) }

// prepare signs up a bench user, uploads the response files, and performs
// the DSH handshake for direct access.
func prepare(ctx context.Context, info devstack.Info) (*env, error) {
	e := &env{edge: info.EdgeURLs[0], metrics: info.Metrics["edge-a"]}
	req, _ := http.NewRequest("POST", e.edge+"/users", strings.NewReader("user=bench&invite="+info.Invite))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Accept", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return nil, fmt.Errorf("signup: %s", resp.Status)
	}
	for _, c := range resp.Cookies() {
		if c.Name == "dsh_gw_session" {
			e.sid = c.Value
		}
	}
	for name, size := range map[string]int{"1k.bin": 1 << 10, "1m.bin": 1 << 20} {
		req, _ := http.NewRequest("PUT", e.edge+"/u/bench/api/files/"+name, bytes.NewReader(bytes.Repeat([]byte("x"), size)))
		req.Header.Set("Cookie", "dsh_gw_session="+e.sid)
		req.Header.Set("Origin", e.edge)
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
	boxes, err := kv.Open[state.Sandbox](ctx, js, state.BucketSandboxes)
	if err != nil {
		return nil, err
	}
	box, err := boxes.Get(ctx, "bench")
	if err != nil {
		return nil, err
	}
	e.direct = "http://" + box.Value.Address
	rc, err := clientcmd.BuildConfigFromFlags("", info.Kubeconfig)
	if err != nil {
		return nil, err
	}
	kc := kubernetes.NewForConfigOrDie(rc)
	logs, err := kc.CoreV1().Pods("dsh-demo").GetLogs(box.Value.PodName, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	token, err := handshake.TokenFromLog(logs)
	if err != nil {
		return nil, err
	}
	e.dshCookie, err = handshake.Exchange(ctx, handshake.Client(), handshake.Request{Address: box.Value.Address, Token: token, Host: "localhost"})
	if err != nil {
		return nil, err
	}
	e.edgePID = info.PIDs["edge-a"]
	return e, nil
}

type wrkResult struct {
	rps      float64
	p99      time.Duration
	requests float64
}

var (
	rpsRE = regexp.MustCompile(`Requests/sec:\s+([\d.]+)`)
	p99RE = regexp.MustCompile(`\s99%\s+([\d.]+)(us|ms|s)`)
	reqRE = regexp.MustCompile(`(\d+) requests in`)
)

func wrk(url string, d time.Duration, headers ...string) (wrkResult, error) {
	args := []string{"-t1", "-c32", "-d" + d.String(), "--latency"}
	for _, h := range headers {
		args = append(args, "-H", h)
	}
	outb, err := exec.Command("wrk", append(args, url)...).CombinedOutput()
	if err != nil {
		return wrkResult{}, fmt.Errorf("wrk: %v\n%s", err, outb)
	}
	out := string(outb)
	if strings.Contains(out, "Non-2xx") {
		return wrkResult{}, fmt.Errorf("wrk saw errors:\n%s", out)
	}
	var r wrkResult
	if m := rpsRE.FindStringSubmatch(out); m != nil {
		r.rps, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reqRE.FindStringSubmatch(out); m != nil {
		r.requests, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := p99RE.FindStringSubmatch(out); m != nil {
		v, _ := strconv.ParseFloat(m[1], 64)
		unit := map[string]time.Duration{"us": time.Microsecond, "ms": time.Millisecond, "s": time.Second}[m[2]]
		r.p99 = time.Duration(v * float64(unit))
	}
	if r.rps == 0 {
		return r, fmt.Errorf("wrk output not understood:\n%s", out)
	}
	return r, nil
}

// wsRTT returns the p50 and p99 of n echo round trips.
func wsRTT(url string, h http.Header, n int) ([2]time.Duration, error) {
	var d websocket.Dialer
	c, _, err := d.Dial(url, h)
	if err != nil {
		return [2]time.Duration{}, fmt.Errorf("dial %s: %w", url, err)
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
	sort.Slice(rtts, func(i, j int) bool { return rtts[i] < rtts[j] })
	return [2]time.Duration{rtts[n/2], rtts[n*99/100]}, nil
}

// idleSockets opens n WebSockets through the edge and returns the edge's
// RSS growth per socket.
func idleSockets(e *env, n int) (float64, error) {
	runtime.GC()
	before, err := rss(e.edgePID)
	if err != nil {
		return 0, err
	}
	d := websocket.Dialer{HandshakeTimeout: time.Minute, ReadBufferSize: 512, WriteBufferSize: 512}
	url := strings.Replace(e.edge, "http", "ws", 1) + "/u/bench/api/ws"
	h := http.Header{"Cookie": {"dsh_gw_session=" + e.sid}}
	conns := make([]*websocket.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < n; i++ {
		c, _, err := d.Dial(url, h)
		if err != nil {
			return 0, fmt.Errorf("socket %d: %w", i, err)
		}
		conns = append(conns, c)
	}
	time.Sleep(2 * time.Second) // let the edge settle its buffers
	after, err := rss(e.edgePID)
	if err != nil {
		return 0, err
	}
	return float64(after-before) / float64(n), nil
}

func rss(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if fs := strings.Fields(s.Text()); len(fs) >= 2 && fs[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(fs[1], 10, 64)
			return kb << 10, nil
		}
	}
	return 0, errors.New("no VmRSS")
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
