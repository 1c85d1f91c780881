package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/procstat"
	"github.com/aaas-project/aaas/internal/events"
)

// sweeperFigures are the real sweeper's, against the filled server.
type sweeperFigures struct {
	ready    time.Duration
	rss      int64
	rssSwept int64
	// live is the heap right after a collection: what it holds, where the
	// RSS also has what the collector has yet to reclaim.
	live int64
	// first is the first sweep of a term of leadership, which decides for
	// every Ready sandbox once (a takeover's); tick is the mean of the
	// sweeps after it while beacons come, and decided what each decided
	// for on average.
	first, tick time.Duration
	decided     float64
}

// churnFor is how long beacons come while steady sweeps are measured.
const churnFor = 5 * time.Second

// churnRate is beacons per second, each of a user whose work just ended
// (no work in flight): each puts its sandbox in for the next sweep.
const churnRate = 2000

// sweepEvery is the sweeper's SWEEP_INTERVAL here: more sweeps to
// average over than the default (a tenth of IDLE_TIMEOUT, at most 30 s).
const sweepEvery = 250 * time.Millisecond

// sweeper starts the real sweeper against the filled server (IDLE_TIMEOUT
// long enough that nothing falls due, so nothing it asks changes the
// records), and measures its start, its memory, its first sweep and its
// sweeps while the active users' beacons come.
func (w *world) sweeper(ctx context.Context, n int) (sweeperFigures, error) {
	var f sweeperFigures
	port, err := embednats.FreePort()
	if err != nil {
		return f, err
	}
	metrics := fmt.Sprintf("127.0.0.1:%d", port)
	start := time.Now()
	// The same INSTANCE_ID at every size: the lease the last size's
	// sweeper held is its own again, not waited out.
	p, err := child.Start(child.Options{Name: "sweeper", Path: filepath.Join(w.o.bin, "sweeper"), Log: filepath.Join(w.dir, "sweeper.log"), Env: child.Environ(map[string]string{
		"PATH": os.Getenv("PATH"), "NATS_URL": w.url, "NATS_ALLOW_ANONYMOUS": "true",
		"METRICS_ADDR": metrics, "INSTANCE_ID": "sweeper-scale", "LOG_LEVEL": "warn",
		"IDLE_TIMEOUT": "24h", "SWEEP_INTERVAL": sweepEvery.String(), "PPROF": "true",
	})})
	if err != nil {
		return f, err
	}
	defer p.Stop(10 * time.Second)
	if err := waitReady(p, metrics, start); err != nil {
		return f, err
	}
	f.ready = time.Since(start)
	if f.rss, err = procstat.RSS(p.PID()); err != nil {
		return f, err
	}
	var first map[string]float64
	for first["aaas_sweeper_tick_seconds_count"] < 1 {
		if time.Since(start) > 5*time.Minute {
			return f, fmt.Errorf("the sweeper never swept: %s", p.LogTail(20))
		}
		time.Sleep(sweepEvery / 5)
		if first, err = scrape(metrics); err != nil {
			return f, err
		}
	}
	// The sweeps read here: the first, and any that came before this
	// read, which, with nothing due or changed, cost microseconds.
	f.first = seconds(first["aaas_sweeper_tick_seconds_sum"])
	pub := events.NewPublisher(w.js, "edge-churn", slog.New(slog.DiscardHandler))
	active := len(w.tokens)
	every := time.Second / churnRate
	for i, end := 0, time.Now().Add(churnFor); time.Now().Before(end); i++ {
		now := time.Now()
		if _, err := pub.Beacon(events.Beacon{User: user(i % active), LastActive: now, SentAt: now, TTL: time.Minute}); err != nil {
			return f, err
		}
		time.Sleep(every)
	}
	<-w.js.PublishAsyncComplete()
	// Two sweeps more: the last beacons' is among them.
	churned, err := scrape(metrics)
	if err != nil {
		return f, err
	}
	last := churned
	for last["aaas_sweeper_tick_seconds_count"] < churned["aaas_sweeper_tick_seconds_count"]+2 {
		if p.Exited() {
			return f, fmt.Errorf("the sweeper exited: %s", p.LogTail(20))
		}
		time.Sleep(sweepEvery / 5)
		if last, err = scrape(metrics); err != nil {
			return f, err
		}
	}
	ticks := last["aaas_sweeper_tick_seconds_count"] - first["aaas_sweeper_tick_seconds_count"]
	if ticks < 1 {
		return f, fmt.Errorf("no sweep while the beacons came: %s", p.LogTail(20))
	}
	f.tick = seconds((last["aaas_sweeper_tick_seconds_sum"] - first["aaas_sweeper_tick_seconds_sum"]) / ticks)
	f.decided = (last["aaas_sweeper_decisions_total"] - first["aaas_sweeper_decisions_total"]) / ticks
	if f.rssSwept, err = procstat.RSS(p.PID()); err != nil {
		return f, err
	}
	f.live, err = w.liveHeap(metrics, fmt.Sprintf("sweeper-%d.heap", n))
	return f, err
}

// liveHeap collects the garbage of the process serving metrics (a heap
// profile asked for with gc=1, kept in -profiles as name when that is
// set) and reads the heap left.
func (w *world) liveHeap(metrics, name string) (int64, error) {
	resp, err := client.Get("http://" + metrics + "/debug/pprof/heap?gc=1")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var out io.Writer = io.Discard
	if w.o.profiles != "" {
		f, err := os.Create(filepath.Join(w.o.profiles, name))
		if err != nil {
			return 0, err
		}
		defer f.Close()
		out = f
	}
	if _, err := io.Copy(out, resp.Body); err != nil {
		return 0, err
	}
	m, err := scrape(metrics)
	return int64(m["go_memstats_heap_alloc_bytes"]), err
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// waitReady waits for p's /readyz on metrics to answer 200.
func waitReady(p *child.Process, metrics string, start time.Time) error {
	for {
		resp, err := client.Get("http://" + metrics + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if p.Exited() || time.Since(start) > 5*time.Minute {
			return fmt.Errorf("not ready after %s: %s", time.Since(start).Round(time.Second), p.LogTail(20))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// scrape reads the metrics at addr, each name's samples summed over
// their labels.
func scrape(addr string) (map[string]float64, error) {
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "#") {
			continue
		}
		series, v, ok := strings.Cut(l, " ")
		if !ok {
			continue
		}
		name, _, _ := strings.Cut(series, "{")
		if f, err := strconv.ParseFloat(v, 64); err == nil {
			out[name] += f
		}
	}
	return out, sc.Err()
}
