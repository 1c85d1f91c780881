package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/dev/procstat"
)

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
		if f := procstat.StatFields(b); len(f) > 19 {
			ppid, _ := strconv.Atoi(f[1])
			s.procs[pid] = procTimes{ppid: ppid, start: f[19], cpu: procstat.Ticks(f[11:15]...)}
		}
	}
	// The machine lost steal time just the same.
	b, _ := os.ReadFile("/proc/stat")
	line, _, _ := strings.Cut(string(b), "\n")
	if f := strings.Fields(line); len(f) > 8 {
		s.steal = procstat.Ticks(f[8])
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
