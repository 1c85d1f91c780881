package httpguard

import (
	"errors"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// Gone reports whether the peer has closed its side of conn, without
// consuming anything: a non-blocking MSG_PEEK reads zero bytes only at EOF.
// fasthttp has no per-request cancellation, so waits (wake, handshake,
// upstream headers) poll this to stop working for a client that left.
func Gone(conn net.Conn) bool {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	_ = raw.Control(func(fd uintptr) {
		var b [1]byte
		n, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		gone = n == 0 && err == nil || errors.Is(err, unix.ECONNRESET)
	})
	return gone
}
