package main

import (
	"bufio"
	"bytes"
	"cmp"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// profiles is where the edge's time goes, measured after the measured
// runs (a traced process is slower, so these runs measure nothing else):
// the system calls per 1 KiB request of the edge and of nginx under
// `strace -c`, and the edge's CPU profile over a wrk run.
type profiles struct {
	// syscalls: target → syscall → calls per request.
	syscalls map[string]map[string]float64
	order    []string // targets traced
	// pprof is `go tool pprof -top` of the edge's profile.
	pprof string
	dur   time.Duration
}

// profile traces the edge and nginx (when measured) and profiles the edge.
func (r *results) profile(e *env, order []*target) error {
	p := &profiles{syscalls: map[string]map[string]float64{}, dur: r.opts.dur}
	for _, t := range order {
		if t.name != "edge" && t.name != "nginx" {
			continue
		}
		fmt.Fprintf(os.Stderr, "strace -c: %s, 1 KiB, %s\n", t.name, r.opts.dur)
		calls, err := straceCalls(t, r.opts.dur)
		if err != nil {
			return err
		}
		p.syscalls[t.name] = calls
		p.order = append(p.order, t.name)
	}
	if e.edge != nil && r.opts.targets["edge"] {
		fmt.Fprintf(os.Stderr, "pprof: edge, 1 KiB, %s\n", r.opts.dur)
		top, err := edgeProfile(e, r.opts.bin, r.opts.dur)
		if err != nil {
			return err
		}
		p.pprof = top
	}
	r.profiles = p
	return nil
}

// straceCalls runs wrk for d at 1 KiB against t with `strace -c -f`
// attached to t's process and its children (nginx's workers) and returns
// each system call's count per request.
func straceCalls(t *target, d time.Duration) (map[string]float64, error) {
	pids := append([]int{t.pid}, children(t.pid)...)
	out := filepath.Join(os.TempDir(), fmt.Sprintf("aaas-bench-strace-%s-%d", t.name, os.Getpid()))
	defer os.Remove(out)
	args := []string{"-c", "-f", "-o", out}
	for _, pid := range pids {
		args = append(args, "-p", strconv.Itoa(pid))
	}
	cmd := exec.Command("strace", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("strace: %w", err)
	}
	// strace says "Process N attached" once per thread it holds.
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(stderr.String(), "attached") && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	res, werr := wrk(t, "/api/files/1k.bin", d)
	_ = cmd.Process.Signal(syscall.SIGINT)
	_ = cmd.Wait()
	if werr != nil {
		return nil, werr
	}
	f, err := os.Open(out)
	if err != nil {
		return nil, fmt.Errorf("strace wrote nothing (%v): %s", err, stderr.String())
	}
	defer f.Close()
	counts, err := parseStraceSummary(f)
	if err != nil {
		return nil, err
	}
	per := map[string]float64{}
	for name, n := range counts {
		per[name] = float64(n) / max(res.requests, 1)
	}
	return per, nil
}

// parseStraceSummary reads `strace -c`'s table: each syscall's calls.
func parseStraceSummary(r io.Reader) (map[string]int, error) {
	counts := map[string]int{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// % time, seconds, usecs/call, calls, [errors,] syscall
		if len(f) < 5 || f[len(f)-1] == "total" || f[len(f)-1] == "syscall" {
			continue
		}
		n, err := strconv.Atoi(f[3])
		if err != nil {
			continue
		}
		counts[f[len(f)-1]] = n
	}
	if len(counts) == 0 {
		return nil, fmt.Errorf("no syscalls in strace's summary")
	}
	return counts, sc.Err()
}

// children are pid's child processes (nginx's workers), from /proc.
func children(pid int) []int {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	var out []int
	for _, task := range tasks {
		b, _ := os.ReadFile(task)
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}

// edgeProfile takes the edge's CPU profile (PPROF on its metrics
// listener) over a wrk run at 1 KiB and returns pprof's top functions.
func edgeProfile(e *env, bin string, d time.Duration) (string, error) {
	secs := max(int(d.Seconds()), 1)
	got := make(chan error, 1)
	file := filepath.Join(os.TempDir(), fmt.Sprintf("aaas-bench-edge-%d.pprof", os.Getpid()))
	defer os.Remove(file)
	go func() {
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", e.metrics, secs))
		if err != nil {
			got <- err
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			got <- fmt.Errorf("pprof: %s", resp.Status)
			return
		}
		b, err := io.ReadAll(resp.Body)
		if err == nil {
			err = os.WriteFile(file, b, 0o644)
		}
		got <- err
	}()
	// The load outlasts the profile by a second on each side.
	if _, err := wrk(e.edge, "/api/files/1k.bin", time.Duration(secs+2)*time.Second); err != nil {
		return "", err
	}
	if err := <-got; err != nil {
		return "", err
	}
	out, err := exec.Command("go", "tool", "pprof", "-top", "-nodecount=30", filepath.Join(bin, "edge"), file).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go tool pprof: %v\n%s", err, out)
	}
	// The header names temporary files: the table and the samples' total
	// ("Showing nodes accounting for …") are what matter.
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if i := slices.IndexFunc(lines, func(l string) bool { return strings.HasPrefix(l, "Showing nodes") }); i >= 0 {
		lines = slices.DeleteFunc(lines[i:], func(l string) bool { return strings.HasPrefix(l, "Dropped ") })
	}
	return strings.Join(lines, "\n") + "\n", nil
}

// tables writes the section.
func (p *profiles) tables(w *bytes.Buffer) {
	if p == nil {
		return
	}
	fmt.Fprintf(w, "\n## Where the edge's time goes (1 KiB)\n\nAfter the measured runs, one wrk run of %s per traced target (the same command as above) with `strace -c -f` attached to the process and its children: its system calls per request. A traced process is slowed by the tracing, so these runs count calls and measure nothing else.\n\n", p.dur)
	if len(p.order) > 0 {
		names := map[string]bool{}
		for _, t := range p.order {
			for name, per := range p.syscalls[t] {
				if per >= 0.01 {
					names[name] = true
				}
			}
		}
		rows := slices.Collect(maps.Keys(names))
		both := func(n string) float64 { return p.syscalls["edge"][n] + p.syscalls["nginx"][n] }
		slices.SortFunc(rows, func(a, b string) int { return cmp.Or(cmp.Compare(both(b), both(a)), strings.Compare(a, b)) })
		fmt.Fprintf(w, "| system call |")
		for _, t := range p.order {
			fmt.Fprintf(w, " %s, per request |", peerTitle(t))
		}
		fmt.Fprintf(w, "\n|---|")
		for range p.order {
			fmt.Fprintf(w, "---|")
		}
		fmt.Fprintln(w)
		totals := make([]float64, len(p.order))
		for _, n := range rows {
			fmt.Fprintf(w, "| %s |", n)
			for i, t := range p.order {
				fmt.Fprintf(w, " %.2f |", p.syscalls[t][n])
				totals[i] += p.syscalls[t][n]
			}
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "| **all** |")
		for _, v := range totals {
			fmt.Fprintf(w, " **%.2f** |", v)
		}
		fmt.Fprintln(w)
	}
	if p.pprof != "" {
		fmt.Fprintf(w, "\nThe edge's CPU profile (`PPROF=true`, `/debug/pprof/profile` over %s of the same load, untraced), `go tool pprof -top`:\n\n```\n%s```\n", p.dur, p.pprof)
	}
}
