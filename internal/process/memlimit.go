package process

import (
	"bytes"
	"os"
	"runtime/debug"
	"strconv"
)

// The container's memory limit, as cgroup v2 and v1 give it.
var cgroupLimitFiles = []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}

// softShare is the part of the container's memory limit the Go heap may
// grow to before the collector works harder: the rest is the runtime's
// own, the stacks and what the kernel counts besides the heap.
const softShare = 0.9

// limitMemory sets Go's soft memory limit to softShare of the container's
// memory limit, unless GOMEMLIMIT says otherwise or there is no limit.
// Without it the heap of a process that holds a lot (the sweeper's and
// lifecycle's copies of every sandbox) grows to twice what it holds
// before a collection, and the kernel kills the container at its limit
// while half of that is garbage. It returns the limit set (0: none).
func limitMemory(getenv func(string) string, read func(string) ([]byte, error)) int64 {
	if getenv("GOMEMLIMIT") != "" {
		return 0 // the runtime read it already
	}
	for _, f := range cgroupLimitFiles {
		data, err := read(f)
		if err != nil {
			continue
		}
		limit, ok := cgroupLimit(data)
		if !ok {
			return 0
		}
		soft := int64(float64(limit) * softShare)
		debug.SetMemoryLimit(soft)
		return soft
	}
	return 0
}

// cgroupLimit reads a cgroup memory limit file: "max" (v2) or a figure
// beyond any machine (v1's unset limit) is none.
func cgroupLimit(data []byte) (int64, bool) {
	s := string(bytes.TrimSpace(data))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n >= 1<<62 {
		return 0, false
	}
	return n, true
}

// limitMemoryFromCgroup is limitMemory of this process's environment.
func limitMemoryFromCgroup() int64 { return limitMemory(os.Getenv, os.ReadFile) }
