package broker

import (
	"bufio"
	"context"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"time"
)

// A streamed call to a provider over plain HTTP (an in-cluster vLLM,
// Ollama or LiteLLM, the provider stand-in) goes on a connection of its
// own, written and then read by the goroutine that relays it (direct).
// http.Transport keeps two goroutines and its buffers for every HTTP/1.1
// connection with an answer in flight, which an agent's stream holds for
// minutes between tokens; here a waiting stream costs its relay's
// goroutine and 2 KiB. The framing is net/http's own (Request.Write,
// ReadResponse). Providers over TLS keep http.Transport: HTTP/2 carries
// every stream to them on one connection, which costs less still. The
// connection is not reused: a stream lasts seconds to minutes, and a
// connection to a provider in the cluster takes a fraction of a
// millisecond.

// maxResponseHead bounds a provider's status line and headers, as
// http.Transport's MaxResponseHeaderBytes does by default.
const maxResponseHead = 1 << 20

// direct reports whether req goes on a connection of its own: a stream
// to a provider over plain HTTP that no proxy stands in front of.
func (s *Server) direct(req *http.Request, stream bool) bool {
	if !stream || req.URL.Scheme != "http" {
		return false
	}
	proxy, err := s.transport.Proxy(req)
	return err == nil && proxy == nil
}

// roundTripDirect sends req on a new connection and reads the answer's
// head; the body it returns reads the rest from the same connection and
// closes it. ctx ending unblocks the connection at any point, the body's
// reads included. Until the head has come, HeaderTimeout bounds the wait,
// as http.Transport's ResponseHeaderTimeout does.
func (s *Server) roundTripDirect(ctx context.Context, req *http.Request) (*http.Response, error) {
	conn, err := s.dialer.DialContext(ctx, "tcp", hostPort(req))
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (*http.Response, error) {
		stop()
		conn.Close()
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, err
	}
	if err := conn.SetDeadline(time.Now().Add(s.o.HeaderTimeout)); err != nil {
		return fail(err)
	}
	// Connection: close: the connection is the call's alone.
	req.Close = true
	w := bufio.NewWriterSize(conn, 1<<10)
	if err := req.Write(w); err != nil {
		return fail(err)
	}
	if err := w.Flush(); err != nil {
		return fail(err)
	}
	head := &io.LimitedReader{R: conn, N: maxResponseHead}
	br := bufio.NewReaderSize(head, 1<<10)
	resp, err := http.ReadResponse(br, req)
	// Informational answers (103 Early Hints) come before the answer.
	for err == nil && resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
		resp, err = http.ReadResponse(br, req)
	}
	switch {
	case err != nil:
		return fail(err)
	case resp.StatusCode == http.StatusSwitchingProtocols:
		return fail(errors.New("the provider switched protocols"))
	}
	head.N = math.MaxInt64
	// Past the head, the call's own timeout bounds the wait for each token.
	// (A ctx that ended meanwhile has set a deadline in the past; this
	// would undo it, so that is checked after.)
	if err := conn.SetDeadline(time.Time{}); err != nil || ctx.Err() != nil {
		resp.Body.Close()
		return fail(err)
	}
	resp.Body = &directBody{ReadCloser: resp.Body, conn: conn, stop: stop}
	return resp, nil
}

// hostPort is req's host with the scheme's port when it names none.
func hostPort(req *http.Request) string {
	if port := req.URL.Port(); port != "" {
		return net.JoinHostPort(req.URL.Hostname(), port)
	}
	return net.JoinHostPort(req.URL.Hostname(), "80")
}

// directBody is an answer's body on a connection of its own: closing it
// closes the connection.
type directBody struct {
	io.ReadCloser
	conn net.Conn
	stop func() bool
}

func (b *directBody) Close() error {
	b.stop()
	b.ReadCloser.Close()
	return b.conn.Close()
}
