package tcplb_test

import (
	"io"
	"net"
	"testing"

	"github.com/aaas-project/aaas/internal/dev/tcplb"
)

// A connection is relayed to the next live backend, from the client's own
// loopback address, as a Service keeps the source address; a dead
// backend is skipped.
func TestRelaysFromTheClientsAddress(t *testing.T) {
	back, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	seen := make(chan string, 4)
	go func() {
		for {
			c, err := back.Accept()
			if err != nil {
				return
			}
			host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
			seen <- host
			_, _ = io.WriteString(c, "hi")
			c.Close()
		}
	}()
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	dead.Close()
	lb, err := tcplb.Listen("127.0.0.1:0", deadAddr, back.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	for _, from := range []string{"127.0.0.7", "127.0.0.9", "127.0.0.7"} {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		c, err := d.Dial("tcp", lb.Addr())
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(got) != "hi" {
			t.Fatalf("from %s: %q %v", from, got, err)
		}
		if host := <-seen; host != from {
			t.Fatalf("the backend saw %s, the client was %s", host, from)
		}
	}
}
