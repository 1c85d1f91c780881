// Package procstat reads a process's memory and CPU time from /proc,
// for the benchmarks (hack/bench, hack/scale).
package procstat

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

// RSS is a process's resident set size in bytes.
func RSS(pid int) (int64, error) {
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

// CPUTime is the CPU time pid and its live children have used.
func CPUTime(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	total := ProcCPU(pid)
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			if child, err := strconv.Atoi(c); err == nil {
				total += ProcCPU(child)
			}
		}
	}
	return total
}

// ProcCPU reads utime+stime of one process (all its threads).
func ProcCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if f := StatFields(b); err == nil && len(f) > 12 {
		return Ticks(f[11:13]...)
	}
	return 0
}

// StatFields are the fields of /proc/<pid>/stat after the command, from
// the state on (proc(5) numbers them from 3).
func StatFields(b []byte) []string {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// Ticks sums clock ticks (1/100 s on Linux).
func Ticks(fs ...string) time.Duration {
	var n int64
	for _, f := range fs {
		v, _ := strconv.ParseInt(f, 10, 64)
		n += v
	}
	return time.Duration(n) * 10 * time.Millisecond
}
