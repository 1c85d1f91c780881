package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// rss is a process's resident set size in bytes.
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

// cpuTime is the CPU time pid and its live children have used.
func cpuTime(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	total := procCPU(pid)
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			if child, err := strconv.Atoi(c); err == nil {
				total += procCPU(child)
			}
		}
	}
	return total
}

// procCPU reads utime+stime of one process (all its threads).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if f := statFields(b); err == nil && len(f) > 12 {
		return ticks(f[11:13]...)
	}
	return 0
}

// loadSample is the CPU time of every process at one moment, so that what
// processes outside this one's tree (the stack, the peers, wrk) used in
// between can be told apart. Both sides are counted per process, with the
// same accounting.
type loadSample struct {
	at    time.Time
	procs map[int]procTimes
	steal time.Duration
}

type procTimes struct {
	ppid  int
	start string        // start time, telling a reused pid apart
	cpu   time.Duration // its own and its reaped children's
}

func sampleLoad() loadSample {
	s := loadSample{at: time.Now(), procs: map[int]procTimes{}}
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, d := range dirs {
		b, err := os.ReadFile(d)
		if err != nil {
			continue
		}
		pid, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(d, "/proc/"), "/stat"))
		if f := statFields(b); len(f) > 19 {
			ppid, _ := strconv.Atoi(f[1])
			s.procs[pid] = procTimes{ppid: ppid, start: f[19], cpu: ticks(f[11:15]...)}
		}
	}
	// The machine lost steal time just the same.
	b, _ := os.ReadFile("/proc/stat")
	line, _, _ := strings.Cut(string(b), "\n")
	if f := strings.Fields(line); len(f) > 8 {
		s.steal = ticks(f[8])
	}
	return s
}

// other is how many cores processes outside this process's tree used
// since s.
func (s loadSample) other() float64 {
	n := sampleLoad()
	ours := n.tree(os.Getpid())
	used := n.steal - s.steal
	for pid, p := range n.procs {
		if ours[pid] {
			continue
		}
		used += p.cpu
		if q, ok := s.procs[pid]; ok && q.start == p.start {
			used -= q.cpu
		}
	}
	// A process that ended in between shows up, whole, in its parent's
	// reaped-children time: take off what it had used before.
	for pid, q := range s.procs {
		if p, ok := n.procs[pid]; (!ok || p.start != q.start) && !ours[q.ppid] {
			used -= q.cpu
		}
	}
	return used.Seconds() / n.at.Sub(s.at).Seconds()
}

// tree is root and its descendants.
func (s loadSample) tree(root int) map[int]bool {
	children := map[int][]int{}
	for pid, p := range s.procs {
		children[p.ppid] = append(children[p.ppid], pid)
	}
	in := map[int]bool{}
	for todo := []int{root}; len(todo) > 0; {
		pid := todo[len(todo)-1]
		todo = append(todo[:len(todo)-1], children[pid]...)
		in[pid] = true
	}
	return in
}

// statFields are the fields of /proc/<pid>/stat after the command, from
// the state on (proc(5) numbers them from 3).
func statFields(b []byte) []string {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// ticks sums clock ticks (1/100 s on Linux).
func ticks(fs ...string) time.Duration {
	var n int64
	for _, f := range fs {
		v, _ := strconv.ParseInt(f, 10, 64)
		n += v
	}
	return time.Duration(n) * 10 * time.Millisecond
}
