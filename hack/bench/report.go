package main

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"
)

// results is everything one invocation measured.
type results struct {
	opts                options
	versions            map[string]string
	loadBefore          string                            // with the stack and the peers up, idle
	edgeBuild           string                            // which edge binary ran
	wrk                 map[string]map[string][]wrkResult // size → target → one per round
	rate                float64                           // of the fixed-rate runs
	open                map[string][]rateResult           // target → fixed-rate runs, one per round
	repeated, disturbed int                               // measured runs repeated for other load, and kept despite it
	wsDirect, wsEdge    [2]time.Duration
	perSocket           float64
	natsReqs, natsMsgs  float64
	natsBeacons         float64
	models              *modelResults // nil without -models
	profiles            *profiles     // nil without -profile
	notes               []string
}

// medianOf returns the median, lowest and highest of vs.
func medianOf(vs []float64) (med, lo, hi float64) {
	if len(vs) == 0 {
		return 0, 0, 0
	}
	vs = slices.Sorted(slices.Values(vs))
	n := len(vs)
	med = vs[n/2]
	if n%2 == 0 {
		med = (vs[n/2-1] + vs[n/2]) / 2
	}
	return med, vs[0], vs[n-1]
}

// over applies f to every run.
func over[R any](runs []R, f func(R) float64) []float64 {
	vs := make([]float64, len(runs))
	for i, x := range runs {
		vs[i] = f(x)
	}
	return vs
}

// median is medianOf f over target's wrk runs for size.
func (r *results) median(size, target string, f func(wrkResult) float64) (med, lo, hi float64) {
	return medianOf(over(r.wrk[size][target], f))
}

// rps is target's median req/s for size, 0 when it did not run.
func (r *results) rps(size, target string) float64 {
	m, _, _ := r.median(size, target, func(w wrkResult) float64 { return w.rps })
	return m
}

// cpuPerRequest is the proxy CPU time target used per request for size,
// the median over the rounds in ns, 0 when it did not run.
func (r *results) cpuPerRequest(size, target string) float64 {
	m, _, _ := r.median(size, target, func(w wrkResult) float64 { return float64(w.cpu) / w.requests })
	return m
}

// bestPeer is the fastest of peers for size, by median req/s: its name
// and req/s, or "" and 0 when none of them ran.
func (r *results) bestPeer(size string, peers ...string) (string, float64) {
	name, best := "", 0.0
	for _, p := range peers {
		if v := r.rps(size, p); v > best {
			name, best = p, v
		}
	}
	return name, best
}

// ratio formats a/b, or — when either is missing.
func ratio(a, b float64) string {
	if a == 0 || b == 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

// goal is one line of the goals table.
// goal writes a row of the goals table: met or not when ok; else not
// measured, or not judged for the reason unjudged gives.
func goal(w *bytes.Buffer, what, want string, measured string, met, ok bool, unjudged ...string) {
	verdict := "not measured"
	switch {
	case ok && met:
		verdict = "**met**"
	case ok:
		verdict = "**not met**"
	case len(unjudged) > 0:
		verdict = "not judged: " + unjudged[0]
	}
	fmt.Fprintf(w, "| %s | %s | %s | %s |\n", what, want, measured, verdict)
}

func (r *results) report() []byte {
	var w bytes.Buffer
	o := r.opts
	fmt.Fprintf(&w, "# Benchmarks\n\nMeasured by `make bench` (`hack/bench`) on %s, %d cores (%s), %s. Load average (1, 5, 15 min) %s before the runs, with everything up and idle; during the runs it counts the benchmark's own processes, so what other processes used is measured per run instead (Other load on the machine, below). The rest of the stack (NATS, the control plane, lifecycle, the sweeper) stays up and idle throughout, the same for every target.\n\n",
		time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), cpuModel(), runtime.Version(), r.loadBefore)
	fmt.Fprintf(&w, "One invocation reaches one dshsim pod (the DSH Web stand-in) these ways, one after another; only one target is under load at any time:\n\n")
	for _, t := range allTargets {
		if !o.targets[t] {
			continue
		}
		switch t {
		case "direct":
			fmt.Fprintf(&w, "- **direct**: the client talks to the pod itself, with its DSH auth cookie.\n")
		case "nginx", "haproxy", "caddy", "traefik":
			fmt.Fprintf(&w, "- **%s** %s: a reverse proxy in front of the pod (configuration below); the client sends the pod's auth cookie and Host, and %s forwards them.\n", peerTitle(t), r.versions[t], peerTitle(t))
		case "chp":
			fmt.Fprintf(&w, "- **configurable-http-proxy** (%s), JupyterHub's proxy: `--default-target http://<pod>`; the client sends the pod's auth cookie and Host, and it forwards them.\n", r.versions[t])
		case "edge":
			fmt.Fprintf(&w, "- **edge**: the aaas edge, with the bench user's session cookie (handshake cached): it resolves the session, the sandbox and the sealed DSH cookie from its watch caches and forwards with the DSH cookie swapped in.\n")
		}
	}
	fmt.Fprintf(&w, "\nClosed loop: %s, `wrk %s -d%s`, each measured run after a %s warm-up run on the same URL; %d round(s) over all targets, the order rotating by one each round; figures are medians over the rounds, [lowest–highest] beside req/s. Proxy CPU is the CPU time (user + system, all processes and threads) the proxy used during the measured run, per request.\n\n",
		r.versions["wrk"], strings.Join(wrkArgs, " "), o.dur, o.warmup, o.rounds)

	r.goals(&w)
	r.throughputTable(&w)
	r.ratioTable(&w)
	r.latencyTable(&w)
	r.machineTable(&w)
	r.websocketTables(&w)
	r.profiles.tables(&w)
	r.models.tables(&w, o.rounds)
	r.setup(&w)
	if len(r.notes) > 0 {
		fmt.Fprintf(&w, "\n## Notes\n\n")
		for _, n := range r.notes {
			fmt.Fprintf(&w, "- %s\n", n)
		}
	}
	return w.Bytes()
}

func (r *results) goals(w *bytes.Buffer) {
	fmt.Fprintf(w, "## Goals\n\nThe targets, judged on this run's figures.\n\n| goal | target | measured | |\n|---|---|---|---|\n")
	edge1k, edge1m, chp := r.rps("1 KiB", "edge"), r.rps("1 MiB", "edge"), r.rps("1 KiB", "chp")
	peer1k, best1k := r.bestPeer("1 KiB", "nginx", "haproxy")
	goPeer1k, goBest1k := r.bestPeer("1 KiB", "caddy", "traefik")
	peer1m, best1m := r.bestPeer("1 MiB", peerNames...)
	best := func(name string) string { return " (best: " + orDash(peerTitle(name)) + ")" }
	goal(w, "edge req/s ÷ best of nginx, haproxy, 1 KiB", "≥ 1.0×", ratio(edge1k, best1k)+best(peer1k), edge1k >= 1.0*best1k, edge1k > 0 && best1k > 0)
	goal(w, "edge req/s ÷ best of Caddy, Traefik, 1 KiB", "≥ 1.5×", ratio(edge1k, goBest1k)+best(goPeer1k), edge1k >= 1.5*goBest1k, edge1k > 0 && goBest1k > 0)
	goal(w, "edge req/s ÷ configurable-http-proxy, 1 KiB", "≥ 5×", ratio(edge1k, chp), edge1k >= 5*chp, edge1k > 0 && chp > 0)
	goal(w, "edge req/s ÷ best of all peers, 1 MiB", "≥ 1.2×", ratio(edge1m, best1m)+best(peer1m), edge1m >= 1.2*best1m, edge1m > 0 && best1m > 0)
	edgeCPU, nginxCPU := r.cpuPerRequest("1 KiB", "edge"), r.cpuPerRequest("1 KiB", "nginx")
	goal(w, "edge CPU per 1 KiB request", "≤ nginx's", fmt.Sprintf("%.1f µs (nginx: %.1f µs)", edgeCPU/1e3, nginxCPU/1e3), edgeCPU <= nginxCPU, edgeCPU > 0 && nginxCPU > 0)
	added, ok := r.added("edge", func(x rateResult) time.Duration { return x.p50 })
	goal(w, fmt.Sprintf("edge added p50 vs direct at %.0f req/s", r.rate), "≤ 0.50 ms", ms(added), added <= 500*time.Microsecond, ok)
	goal(w, "edge RSS per idle proxied WebSocket", "≤ 20 KiB", fmt.Sprintf("%.1f KiB", r.perSocket/1024), r.perSocket <= 20*1024, r.perSocket > 0)
	r.models.goals(w)
}

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

// sizeTable writes a table with a row per target measured and, for each
// response size, the columns named (a %[1]s in a name is the size) filled
// by cells.
func (r *results) sizeTable(w *bytes.Buffer, columns []string, cells func(size, target string) []string) {
	fmt.Fprintf(w, "| target |")
	for _, s := range sizes {
		for _, c := range columns {
			fmt.Fprintf(w, " %s |", fmt.Sprintf(c, s.name))
		}
	}
	fmt.Fprintf(w, "\n|---|%s\n", strings.Repeat("---|", len(columns)*len(sizes)))
	for _, t := range allTargets {
		if !r.opts.targets[t] {
			continue
		}
		fmt.Fprintf(w, "| %s |", peerTitle(t))
		for _, s := range sizes {
			for _, c := range cells(s.name, t) {
				fmt.Fprintf(w, " %s |", c)
			}
		}
		fmt.Fprintln(w)
	}
}

func (r *results) throughputTable(w *bytes.Buffer) {
	fmt.Fprintf(w, "\n## Throughput (wrk, closed loop)\n\n")
	r.sizeTable(w, []string{"%[1]s req/s", "%[1]s wrk p99", "%[1]s proxy CPU per request"}, func(size, t string) []string {
		med, lo, hi := r.median(size, t, func(x wrkResult) float64 { return x.rps })
		p99, _, _ := r.median(size, t, func(x wrkResult) float64 { return float64(x.p99) })
		cpu := r.cpuPerRequest(size, t)
		rps := fmt.Sprintf("%.0f", med)
		if r.opts.rounds > 1 {
			rps += fmt.Sprintf(" [%.0f–%.0f]", lo, hi)
		}
		cpuText := "—"
		if t != "direct" {
			cpuText = fmt.Sprintf("%.0f µs", cpu/1e3)
		}
		return []string{rps, ms(time.Duration(p99)), cpuText}
	})
}

func (r *results) ratioTable(w *bytes.Buffer) {
	fmt.Fprintf(w, "\n## Ratios (of median req/s)\n\n| ratio |")
	for _, s := range sizes {
		fmt.Fprintf(w, " %s |", s.name)
	}
	fmt.Fprintf(w, "\n|---|%s\n", strings.Repeat("---|", len(sizes)))
	row := func(name string, f func(size string) (float64, float64)) {
		fmt.Fprintf(w, "| %s |", name)
		for _, s := range sizes {
			a, b := f(s.name)
			fmt.Fprintf(w, " %s |", ratio(a, b))
		}
		fmt.Fprintln(w)
	}
	row("edge ÷ max(nginx, haproxy)", func(s string) (float64, float64) {
		_, b := r.bestPeer(s, "nginx", "haproxy")
		return r.rps(s, "edge"), b
	})
	row("edge ÷ max(Caddy, Traefik)", func(s string) (float64, float64) {
		_, b := r.bestPeer(s, "caddy", "traefik")
		return r.rps(s, "edge"), b
	})
	row("edge ÷ configurable-http-proxy", func(s string) (float64, float64) { return r.rps(s, "edge"), r.rps(s, "chp") })
	for _, t := range allTargets {
		if t == "direct" {
			continue
		}
		row(peerTitle(t)+" ÷ direct", func(s string) (float64, float64) { return r.rps(s, t), r.rps(s, "direct") })
	}
}

// added is the median over the rounds of f of target's fixed-rate run
// minus f of direct's in the same round.
func (r *results) added(target string, f func(rateResult) time.Duration) (time.Duration, bool) {
	t, d := r.open[target], r.open["direct"]
	if len(t) == 0 || len(t) != len(d) {
		return 0, false
	}
	diffs := make([]float64, len(t))
	for i := range t {
		diffs[i] = float64(f(t[i]) - f(d[i]))
	}
	m, _, _ := medianOf(diffs)
	return time.Duration(m), true
}

func (r *results) latencyTable(w *bytes.Buffer) {
	if len(r.open) == 0 {
		return
	}
	base := "half the best of nginx and haproxy at 1 KiB"
	if r.opts.rate != 0 {
		base = "set by -rate"
	}
	fmt.Fprintf(w, "\n## Latency at a fixed rate (1 KiB, open loop)\n\n%.0f req/s (%s), Poisson arrivals (the same seeded sequence for every target), for %s after a %s warm-up at the same rate, %d round(s) over the targets, the order rotating; figures are medians over the rounds, and \"added\" is the median of the differences to direct within each round. The client is Go, in the bench process: up to 64 kept-alive connections, one request at a time on each, a pacing thread that sleeps with nanosleep and writes each request, fasthttp's parser reading the responses. Latency runs from the moment the generator handles an arrival, including any wait for a free connection, to the last byte of the response.\n\n",
		r.rate, base, r.opts.dur, r.opts.warmup, r.opts.rounds)
	fmt.Fprintf(w, "| target | achieved req/s | errors | p50 | p99 | added p50 vs direct | added p99 vs direct | sent late, p99 | client CPU per request | other processes |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, t := range allTargets {
		runs := r.open[t]
		if len(runs) == 0 {
			continue
		}
		med := func(f func(rateResult) float64) float64 { m, _, _ := medianOf(over(runs, f)); return m }
		dur := func(f func(rateResult) time.Duration) string {
			return ms(time.Duration(med(func(x rateResult) float64 { return float64(f(x)) })))
		}
		errs := 0
		for _, x := range runs {
			errs += x.errors
		}
		a50, a99 := "—", "—"
		if t != "direct" {
			if d, ok := r.added(t, func(x rateResult) time.Duration { return x.p50 }); ok {
				a50 = ms(d)
			}
			if d, ok := r.added(t, func(x rateResult) time.Duration { return x.p99 }); ok {
				a99 = ms(d)
			}
		}
		fmt.Fprintf(w, "| %s | %.0f | %d | %s | %s | %s | %s | %s | %.0f µs | %.2f cores |\n", peerTitle(t),
			med(func(x rateResult) float64 { return x.achieved }), errs,
			dur(func(x rateResult) time.Duration { return x.p50 }), dur(func(x rateResult) time.Duration { return x.p99 }), a50, a99,
			dur(func(x rateResult) time.Duration { return x.lag99 }),
			med(func(x rateResult) float64 { return float64(x.clientCPU) / 1e3 }),
			med(func(x rateResult) float64 { return x.other }))
	}
	fmt.Fprintf(w, "\nAn achieved rate below the offered one means the target could not keep up: requests queued, and its latency is mostly queueing. \"Sent late\" is how far behind schedule the generator sent (it sleeps with nanosleep, tens of µs late on an idle machine); it grows when the machine's two cores are saturated. Client CPU is that of the whole bench process (the generator, and the idle NATS and control plane it hosts) per request: the client takes its share of the same two cores. Other processes: the cores that processes outside the benchmark used during the measured run (below).\n")
}

// machineTable says how much CPU processes outside the benchmark took
// during the measured runs.
func (r *results) machineTable(w *bytes.Buffer) {
	fmt.Fprintf(w, "\n## Other load on the machine\n\nCores used by processes outside the benchmark (its stack, the peers and wrk excluded; steal time included) during each measured run: median over the rounds [highest]. A measured run during which they used more than %.2f cores was repeated, at most twice: %d run(s) were repeated, and %d kept above the limit after two repeats.\n\n", r.opts.maxOther, r.repeated, r.disturbed)
	r.sizeTable(w, []string{"wrk %[1]s"}, func(size, t string) []string {
		m, _, hi := r.median(size, t, func(x wrkResult) float64 { return x.other })
		return []string{fmt.Sprintf("%.2f [%.2f]", m, hi)}
	})
}

func (r *results) websocketTables(w *bytes.Buffer) {
	if !r.opts.targets["edge"] {
		return
	}
	fmt.Fprintf(w, "\n## WebSockets\n\n| WebSocket echo (2000 round trips, 16 B) | direct | edge | added |\n|---|---|---|---|\n")
	for i, p := range []string{"p50", "p99"} {
		d, e := r.wsDirect[i], r.wsEdge[i]
		if r.opts.targets["direct"] {
			fmt.Fprintf(w, "| %s | %s | %s | %s |\n", p, us(d), us(e), us(e-d))
		} else {
			fmt.Fprintf(w, "| %s | — | %s | — |\n", p, us(e))
		}
	}
	if r.opts.sockets > 0 {
		fmt.Fprintf(w, "\n| idle WebSockets held by one edge | edge RSS per socket |\n|---|---|\n| %d | %.1f KiB |\n", r.opts.sockets, r.perSocket/1024)
		if r.opts.sockets < r.opts.socketsAsked {
			fmt.Fprintf(w, "\nThe machine's open-file limit allowed %d of the %d sockets asked for (the edge needs two descriptors per socket: browser side and DSH side).\n", r.opts.sockets, r.opts.socketsAsked)
		}
	}
	if r.natsReqs > 0 {
		fmt.Fprintf(w, "\n## NATS\n\n| NATS messages sent by the edge while proxying %.0f requests (measured wrk runs) | per 10k requests |\n|---|---|\n| all | %.1f |\n| of which activity beacons | %.1f |\n", r.natsReqs, 10000*r.natsMsgs/r.natsReqs, 10000*r.natsBeacons/r.natsReqs)
		fmt.Fprintf(w, "\nThe edge publishes at most about one activity beacon per user per second, so the count above scales with time, not with requests.\n")
	}
}

func (r *results) setup(w *bytes.Buffer) {
	o := r.opts
	fmt.Fprintf(w, "\n## Setup\n\nFairness: every target reaches the same pod, one at a time, from the same clients with the same settings; the peers receive exactly the requests direct receives (path, `Host: localhost`, the pod's cookie) and forward them, the edge receives them on the bench user's sandbox origin (`Host: bench.localhost:<port>`) with that origin's session cookie instead; nothing writes an access log (nginx `access_log off`, haproxy without a `log` line, Caddy and Traefik without an access log, Caddy's log at WARN and Traefik's at ERROR, configurable-http-proxy `--log-level warn`, the edge at `LOG_LEVEL=warn`). CPU: the edge is a Go process whose runtime uses all %d cores, so nginx gets %d worker process(es), haproxy %d thread(s), and Caddy and Traefik, Go programs too, run with `GOMAXPROCS=%d` (all `-peer-threads`); configurable-http-proxy is one Node.js process, as JupyterHub runs it. wrk (one thread), dshsim and the proxy share the same %d cores, so req/s is what the proxy leaves of the machine to the rest; the CPU-per-request column is the proxy's own cost.\n\n",
		runtime.NumCPU(), o.peerThreads, o.peerThreads, o.peerThreads, runtime.NumCPU())
	if o.targets["nginx"] {
		fmt.Fprintf(w, "nginx (`nginx -p <tmp> -c <tmp>/nginx.conf`: its own prefix and configuration in a temporary directory; as root, its workers run as `nobody`; `proxy_buffering` is left at its default, on, so responses larger than its buffers can spill to a temporary file):\n\n```nginx\n%s```\n\n",
			fmt.Sprintf(nginxConf, "<pod>", "127.0.0.1:<port>", o.peerThreads))
	}
	if o.targets["haproxy"] {
		fmt.Fprintf(w, "haproxy (`haproxy -db -f <file>`, one process):\n\n```haproxy\n%s```\n\n", fmt.Sprintf(haproxyConf, "<pod>", "127.0.0.1:<port>", o.peerThreads))
	}
	if o.targets["caddy"] {
		fmt.Fprintf(w, "Caddy (`GOMAXPROCS=%d caddy run --config <tmp>/caddy.json`, with `XDG_CONFIG_HOME` and `XDG_DATA_HOME` in the temporary directory; no admin API, so nothing listens but the server; `reverse_proxy` passes the client's Host through unchanged and adds X-Forwarded-*):\n\n```json\n%s```\n\n",
			o.peerThreads, fmt.Sprintf(caddyConf, "<pod>", "127.0.0.1:<port>", o.peerThreads))
	}
	if o.targets["traefik"] {
		fmt.Fprintf(w, "Traefik (`GOMAXPROCS=%d traefik --configFile=<tmp>/traefik.yml`, run in the temporary directory; no API, dashboard, ping or metrics, so nothing listens but the entry point; X-Forwarded-* added), its static configuration:\n\n```yaml\n%s```\n\nand the dynamic one its file provider reads, `<tmp>/traefik-dynamic.yml`:\n\n```yaml\n%s```\n\n",
			o.peerThreads, fmt.Sprintf(traefikConf, "<pod>", "127.0.0.1:<port>", o.peerThreads), fmt.Sprintf(traefikDynamic, "<pod>", "127.0.0.1:<port>", o.peerThreads))
	}
	if o.targets["chp"] {
		fmt.Fprintf(w, "configurable-http-proxy: `configurable-http-proxy --ip 127.0.0.1 --port <port> --api-ip 127.0.0.1 --api-port <port> --default-target http://<pod> --log-level warn` (its defaults otherwise: kept-alive upstream connections, X-Forwarded-* headers added).\n\n")
	}
	if o.targets["edge"] {
		fmt.Fprintf(w, "The edge, %s, runs as `make run` starts it, with `LOG_LEVEL=warn`, `MAX_IN_FLIGHT_PER_USER=100000` (one user holds every connection) and `IDLE_TIMEOUT=24h`.\n", r.edgeBuild)
	}
}

// loadavg is the first three fields of /proc/loadavg.
func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], ", ")
}

// cpuModel is the first "model name" of /proc/cpuinfo.
func cpuModel() string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}
