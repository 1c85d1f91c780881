package embednats

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// A port FreePort hands out is below the kernel's ephemeral range, is
// handed out once, and is refused to another process while this one
// lives (another open file's lock stands in for the other process: flock
// locks belong to the open file, not the process).
func TestFreePortIsReservedAcrossProcesses(t *testing.T) {
	seen := map[int]bool{}
	for range 20 {
		p, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		if p < 20000 || p >= 30000 || seen[p] {
			t.Fatalf("port %d (handed out before: %v)", p, seen[p])
		}
		seen[p] = true
		if _, ok := reserve(filepath.Join(os.TempDir(), "aaas-ports"), p); ok {
			t.Fatalf("port %d was reserved again while this process holds it", p)
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatalf("the port handed out is not free: %v", err)
		}
		l.Close()
	}
	// The positive control: a port nobody holds can be reserved.
	dir := t.TempDir()
	if f, ok := reserve(dir, 1); !ok {
		t.Fatal("an unheld port could not be reserved")
	} else {
		f.Close()
	}
}
