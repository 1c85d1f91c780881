package faults

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// TestSoak is `make soak` (not in make test): SOAK (e.g. 30m) of traffic
// from SOAK_USERS users (default 200) with a fault every few minutes — an
// edge cut off from NATS, a NATS node killed and brought back, a lifecycle
// worker killed and restarted, an edge restarted — and the memory of the
// processes no fault restarts (edge-a, edge-b, nats-0, nats-1) sampled
// every 30 s. It fails if requests fail or a process's memory grows by
// more than 64 MiB an hour after the first third (warm-up), and reports
// the slopes.
func TestSoak(t *testing.T) {
	d, err := time.ParseDuration(os.Getenv("SOAK"))
	if err != nil {
		t.Skip("SOAK (a duration) not set: make soak runs this")
	}
	users := 200
	if v, err := strconv.Atoi(os.Getenv("SOAK_USERS")); err == nil {
		users = v
	}
	s := newSystem(t, systemOptions{users: users, noSweepers: true})
	load := s.load(testenv.LoadOptions{Pause: 500 * time.Millisecond})
	watched := map[string]func() int{
		"edge-a": s.edges[0].PID, "edge-b": s.edges[1].PID,
		"nats-0": s.Cluster.Nodes[0].PID, "nats-1": s.Cluster.Nodes[1].PID,
	}
	samples := map[string][]point{}
	start := time.Now()
	sample := func() {
		for name, pid := range watched {
			samples[name] = append(samples[name], point{time.Since(start).Hours(), rssMiB(t, pid())})
		}
	}
	faults := []struct {
		name string
		do   func()
	}{
		{"edge-c cut off from NATS for 30 s", func() {
			s.Faults.Cut("edge-c")
			time.Sleep(30 * time.Second)
			s.Faults.Restore("edge-c")
		}},
		{"nats-2 SIGKILLed, back after 20 s", func() {
			s.Cluster.Nodes[2].Kill()
			time.Sleep(20 * time.Second)
			s.Cluster.Nodes[2].Restart(t)
			s.Cluster.WaitCurrent(t, 2*time.Minute)
		}},
		{"lifecycle lc-a SIGKILLed and restarted", func() {
			s.lifecycles[0].Kill()
			time.Sleep(5 * time.Second)
			s.lifecycles[0].Restart(t)
			s.lifecycles[0].WaitReady(t, time.Minute)
		}},
		{"edge-c restarted (SIGTERM)", func() {
			s.edges[2].Stop()
			s.edges[2].Restart(t)
			s.edges[2].WaitReady(t, time.Minute)
		}},
	}
	every := 3 * time.Minute
	next := start.Add(every)
	var done []string
	for i := 0; time.Since(start) < d; {
		sample()
		if time.Now().After(next) {
			f := faults[i%len(faults)]
			f.do()
			done = append(done, f.name)
			i++
			next = time.Now().Add(every)
		}
		time.Sleep(30 * time.Second)
	}
	sample()
	load.Stop()
	r := load.Report()
	rows := [][2]string{row("duration", d), row("users", users), row("faults injected", len(done))}
	// The first third is warm-up (caches filling, pools growing); the
	// slope is of the rest.
	for name, ps := range samples {
		samples[name] = ps[len(ps)/3:]
	}
	for _, name := range sortedKeys(samples) {
		ps := samples[name]
		rows = append(rows, row(name+" RSS after warm-up: first / last / slope", fmt.Sprintf("%.0f / %.0f MiB, %+.1f MiB/h", ps[0].v, ps[len(ps)-1].v, slope(ps))))
	}
	report(t, "Soak", rows, r.Rows(), [][2]string{row("faults", strings.Join(done, "; "))})
	if r.Failed != 0 {
		t.Errorf("%d of %d requests failed\n%s", r.Failed, r.Sent, strings.Join(r.Failures, "\n"))
	}
	for name, ps := range samples {
		if m := slope(ps); m > 64 {
			t.Errorf("%s grows %.1f MiB an hour", name, m)
		}
	}
}

type point struct{ h, v float64 }

// slope is the least-squares slope of v over h.
func slope(ps []point) float64 {
	var sh, sv, shh, shv float64
	n := float64(len(ps))
	for _, p := range ps {
		sh += p.h
		sv += p.v
		shh += p.h * p.h
		shv += p.h * p.v
	}
	if d := n*shh - sh*sh; d != 0 {
		return (n*shv - sh*sv) / d
	}
	return 0
}

// rssMiB is a process's resident memory.
func rssMiB(t *testing.T, pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 64)
			return kb / 1024
		}
	}
	t.Fatalf("no VmRSS for %d", pid)
	return 0
}
