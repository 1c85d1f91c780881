package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/web"
)

// Close codes sent to browsers: 4401 asks the page to sign in again, 4403
// refuses a cross-site socket, 4408 says the sandbox was suspended (the
// reason says why; the page should not reconnect by itself), 1011 covers
// every upstream failure and the per-user cap, 1009 a message from DSH
// above WS_MAX_MESSAGE_BYTES.
const (
	closeUnauthorized = 4401
	closeForbidden    = 4403
	closeSuspended    = 4408
)

// WebSocket buffers: reads go through a small buffer per socket (an idle
// socket holds little; messages are copied through it frame by frame
// anyway), writes borrow one from a pool for the time of a message.
const (
	wsReadBufferSize  = 1 << 10
	wsWriteBufferSize = 32 << 10
)

var wsWriteBuffers = &sync.Pool{}

// closeCode is the close code a browser gets for a refusal: 4401 asks the
// page to sign in again (also when it is signed in as another user), 4403
// says it may not, 1001 sends it to another edge, 1011 covers the rest.
func closeCode(pe *web.Error) int {
	switch pe {
	case errNotYours: // signed in as someone else: sign in again
		return closeUnauthorized
	case errDraining: // this edge is going away; reconnect elsewhere
		return websocket.CloseGoingAway
	}
	if pe.Title == titlePaused {
		return closeSuspended
	}
	switch pe.Status {
	case fiber.StatusUnauthorized:
		return closeUnauthorized
	case fiber.StatusForbidden:
		return closeForbidden
	}
	return websocket.CloseInternalServerErr
}

// serveWebSocket bridges a browser WebSocket that holds a slot to DSH.
// Failures before the bridge exists are reported the way browsers can see
// them: the upgrade succeeds and is closed at once with a code and reason.
func (p *Proxy) serveWebSocket(r *request) error {
	up, err := p.resolve(r, true)
	var conn *websocket.Conn
	if err == nil {
		var resp *http.Response
		conn, resp, err = p.dial(r, up)
		if r.port == 0 && resp != nil && resp.StatusCode == http.StatusUnauthorized {
			if up, err = p.resolver.Refresh(r.ctx, r.target(), up); err == nil {
				conn, _, err = p.dial(r, up)
			}
		}
		// A refresh that failed says why itself (a handshake that timed
		// out or was refused); only the dial's own failures are the
		// sandbox not accepting.
		var pe *web.Error
		if err != nil && r.ctx.Err() == nil && !errors.As(err, &pe) {
			p.m.upstreamErrors.WithLabelValues("websocket_dial").Inc()
			if err = r.unreachable(err); !errors.As(err, &pe) {
				err = &web.Error{Status: http.StatusBadGateway, Detail: "your sandbox did not accept the connection", Cause: err}
			}
		}
	}
	if err != nil {
		r.cancel()
		p.o.Slots.Release(r.user)
		pe := asProxyError(err)
		p.m.count(fiber.StatusSwitchingProtocols, sourceGateway)
		if pe.Cause != nil && pe.Status >= 500 {
			p.o.Log.Warn("websocket refused", "request_id", httpguard.RequestID(r.c), "user", r.user, "err", pe.Cause)
		}
		return p.closeAtOnce(r.c, closeCode(pe), pe.Detail)
	}
	conn.SetReadLimit(p.o.WSMaxMessage)
	st := p.tracker.open(r.user)
	p.m.inFlight.Inc()
	p.m.count(fiber.StatusSwitchingProtocols, sourceTenant)
	done := func() {
		r.cancel()
		p.m.inFlight.Dec()
		st.close()
		p.o.Slots.Release(r.user)
	}
	if err := p.upgrade(r.c, conn.Subprotocol(), func(down *websocket.Conn) {
		defer done()
		if down == nil { // the upgrader refused the handshake
			conn.Close()
			return
		}
		p.bridge(r.id, up.PodUID, st, down, conn)
	}); err != nil {
		conn.Close()
		done()
	}
	return nil
}

// upgrade answers the browser's handshake and runs bridge with its socket
// in a goroutine of its own (with nil when the upgrader refused it). The socket reads the client's connection
// itself: fasthttp hands a hijacked connection its request reader (the
// server's ReadBufferSize, 16 KiB) for the connection's life, which made
// it most of an idle socket's memory. The handler returns at once, so
// fasthttp drops that reader; the server keeps hijacked connections open
// (newApp's KeepHijackedConns) and bridge closes them. Bytes a client
// sent before the handshake's answer, which browsers never do, are lost
// with the reader: that client's socket fails, and nothing else. An
// invalid handshake gets its 4xx before anything is hijacked.
func (p *Proxy) upgrade(c *fiber.Ctx, subprotocol string, bridge func(*websocket.Conn)) error {
	req, err := handshakeRequest(c)
	if err != nil {
		return err
	}
	upgrader := websocket.Upgrader{
		ReadBufferSize: wsReadBufferSize, WriteBufferSize: wsWriteBufferSize, WriteBufferPool: wsWriteBuffers,
		CheckOrigin: func(*http.Request) bool { return true }, // checked by serve
	}
	if subprotocol != "" {
		upgrader.Subprotocols = []string{subprotocol}
	}
	raw := c.Context().Conn()
	c.Status(fiber.StatusSwitchingProtocols) // for the access line; the upgrader answers
	c.Context().HijackSetNoResponse(true)
	c.Context().Hijack(func(net.Conn) {
		w := &hijacker{conn: raw}
		down, err := upgrader.Upgrade(w, req, nil)
		if err != nil {
			_ = raw.Close()
			go bridge(nil)
			return
		}
		go bridge(down)
	})
	return nil
}

// handshakeRequest is the browser's handshake as net/http's upgrader
// reads it; a request that is not one is refused here, with fasthttp's
// answer, before anything is hijacked.
func handshakeRequest(c *fiber.Ctx) (*http.Request, error) {
	h := &c.Request().Header
	req := &http.Request{Method: string(h.Method()), Header: http.Header{}, Host: string(h.Host())}
	for _, name := range []string{"Connection", "Upgrade", "Sec-Websocket-Version", "Sec-Websocket-Key", "Sec-Websocket-Protocol", "Sec-Websocket-Extensions"} {
		for _, v := range h.PeekAll(name) {
			req.Header.Add(name, string(v))
		}
	}
	if !websocket.IsWebSocketUpgrade(req) || req.Method != http.MethodGet || req.Header.Get("Sec-Websocket-Version") != "13" || req.Header.Get("Sec-Websocket-Key") == "" {
		_ = c.Status(fiber.StatusBadRequest).SendString("not a WebSocket handshake")
		return nil, errNotHandshake
	}
	return req, nil
}

var errNotHandshake = errors.New("not a WebSocket handshake")

// hijacker gives net/http's upgrader the client's connection: it writes
// the handshake's answer (101, or its refusal) on it directly.
type hijacker struct {
	conn   net.Conn
	header http.Header
}

func (h *hijacker) Header() http.Header {
	if h.header == nil {
		h.header = http.Header{}
	}
	return h.header
}

// WriteHeader and Write carry the upgrader's refusals, which happen only
// for handshakes handshakeRequest let through and the library does not
// accept: the connection is closed after them.
func (h *hijacker) WriteHeader(status int) {
	fmt.Fprintf(h.conn, "HTTP/1.1 %d %s\r\nConnection: close\r\n\r\n", status, http.StatusText(status))
}

func (h *hijacker) Write(b []byte) (int, error) { return h.conn.Write(b) }

func (h *hijacker) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	// The smallest buffers bufio makes: the upgrader reads nothing through
	// them (ReadBufferSize is set) and writes its answer on the connection.
	return h.conn, bufio.NewReadWriter(bufio.NewReaderSize(h.conn, 16), bufio.NewWriterSize(h.conn, 16)), nil
}

// closeAtOnce completes the upgrade and closes at once with code, because
// a browser cannot read the status of a failed upgrade.
func (p *Proxy) closeAtOnce(c *fiber.Ctx, code int, text string) error {
	upgrader := websocket.FastHTTPUpgrader{CheckOrigin: func(*fasthttp.RequestCtx) bool { return true }}
	if len(text) > 120 { // a close reason must fit a control frame
		text = text[:120]
	}
	return upgrader.Upgrade(c.Context(), func(conn *websocket.Conn) {
		_ = conn.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, text), time.Now().Add(time.Second))
		_ = conn.Close()
	})
}

func (p *Proxy) dial(r *request, up Upstream) (*websocket.Conn, *http.Response, error) {
	// The headers HTTP requests get, read back from their wire form.
	h := http.Header{}
	o := p.outgoing(r, up, nil)
	for line := range bytes.SplitSeq(o.header, []byte("\r\n")) {
		if k, v, ok := bytes.Cut(line, []byte(": ")); ok {
			h.Add(string(k), string(v))
		}
	}
	outgoings.Put(o)
	if sp := r.c.Get("Sec-WebSocket-Protocol"); sp != "" {
		h.Set("Sec-WebSocket-Protocol", sp)
	}
	conn, resp, err := p.dialer.DialContext(r.ctx, "ws://"+up.Address+string(r.appendURI(nil)), h)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	return conn, resp, err
}

// bridge copies messages both ways, frame by frame (a 16 MiB message is
// never held whole), passes pings, pongs and close codes through, and
// counts the browser's messages as its input on st (DSH's are not: a page
// that only receives is a tab nobody may be looking at). It lasts while
// id's credentials hold and pod's sandbox is awake.
func (p *Proxy) bridge(id auth.Identity, pod string, st *stream, down, up *websocket.Conn) {
	x := &exchange{id: id, pod: pod, ws: down}
	p.live.add(x)
	p.m.websockets.Inc()
	defer func() {
		p.live.remove(x)
		p.m.websockets.Dec()
		down.Close()
		up.Close()
	}()
	down.SetReadLimit(p.o.WSMaxMessage)
	forwardControl(down, up)
	forwardControl(up, down)

	// Browser to DSH in a goroutine, DSH to browser in this one: two
	// goroutines per socket, not three (an idle socket is mostly stacks).
	upDone := make(chan struct{})
	var browserLeft atomic.Bool
	go func() {
		defer close(upDone)
		_ = p.pump(st.browserInput, p.m.bytesUp, up, down, closeFor)
		// The browser's side ended; closing DSH's ends the other pump.
		browserLeft.Store(true)
		up.Close()
	}()
	_ = p.pump(nil, p.m.bytesDown, down, up, func(err error) []byte {
		// The sandbox went away because its user was signed out (a
		// deletion, a recreate) or it is being suspended: tell the page
		// so, not "lost".
		if !p.o.Auth.Valid(id) {
			return websocket.FormatCloseMessage(closeUnauthorized, "signed out")
		}
		var ce *websocket.CloseError
		if lost := !errors.As(err, &ce) || ce.Code == websocket.CloseAbnormalClosure; lost && !browserLeft.Load() {
			if code, why := p.asleepSoon(x); code != 0 {
				return websocket.FormatCloseMessage(code, why)
			}
		}
		return closeFor(err)
	})
	// DSH's side ended; closing the browser's ends the other pump.
	down.Close()
	<-upDone
}

// forwardControl relays pings and pongs read on from to to.
func forwardControl(from, to *websocket.Conn) {
	from.SetPingHandler(func(data string) error {
		return to.WriteControl(websocket.PingMessage, []byte(data), time.Now().Add(time.Second))
	})
	from.SetPongHandler(func(data string) error {
		return to.WriteControl(websocket.PongMessage, []byte(data), time.Now().Add(time.Second))
	})
}

// pump copies messages read from src to dst until src ends, then tells dst
// why with closing(err) (1009 when src sent too much; the library has
// already told src). bytes counts what passes in this direction; input,
// when set, is told of each message.
func (p *Proxy) pump(input func(), bytes prometheus.Counter, dst, src *websocket.Conn, closing func(error) []byte) error {
	for {
		typ, r, err := src.NextReader()
		if err != nil {
			_ = dst.WriteControl(websocket.CloseMessage, closing(err), time.Now().Add(time.Second))
			return err
		}
		w, err := dst.NextWriter(typ)
		if err != nil {
			return err
		}
		n, err := io.Copy(deadlineWriter{w: w, c: dst, d: p.o.WriteTimeout}, r)
		bytes.Add(float64(n))
		if err != nil {
			// Not w.Close(): that would deliver the truncated part as a
			// whole message. A close frame now aborts it mid-message.
			if errors.Is(err, websocket.ErrReadLimit) {
				_ = dst.WriteControl(websocket.CloseMessage, closeFor(err), time.Now().Add(time.Second))
			}
			return err
		}
		_ = dst.SetWriteDeadline(time.Now().Add(p.o.WriteTimeout))
		if err := w.Close(); err != nil {
			return err
		}
		if input != nil {
			input()
		}
	}
}

// closeFor turns the error that ended a read into the close frame for the
// other side: the same code when the peer closed, 1009 for an oversized
// message, 1011 otherwise. 1005 and 1006 cannot be sent and become 1000
// and 1011.
func closeFor(err error) []byte {
	var ce *websocket.CloseError
	switch {
	case errors.As(err, &ce) && ce.Code == websocket.CloseNoStatusReceived:
		return websocket.FormatCloseMessage(websocket.CloseNormalClosure, "")
	case errors.As(err, &ce) && ce.Code != websocket.CloseAbnormalClosure:
		return websocket.FormatCloseMessage(ce.Code, ce.Text)
	case errors.Is(err, websocket.ErrReadLimit):
		return websocket.FormatCloseMessage(websocket.CloseMessageTooBig, "message too big")
	}
	return websocket.FormatCloseMessage(websocket.CloseInternalServerErr, "connection to the sandbox lost")
}

// deadlineWriter gives each chunk of a message a fresh write deadline: a
// peer that stops reading is dropped after HTTP_WRITE_TIMEOUT, however long
// the socket has been open or the message is.
type deadlineWriter struct {
	w io.Writer
	c *websocket.Conn
	d time.Duration
}

func (w deadlineWriter) Write(b []byte) (int, error) {
	_ = w.c.SetWriteDeadline(time.Now().Add(w.d))
	return w.w.Write(b)
}
