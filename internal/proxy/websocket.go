package proxy

import (
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/gofiber/fiber/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/aaas-project/aaas/internal/clientinfo"
	"github.com/aaas-project/aaas/internal/kv"
)

// Close codes sent to browsers: 4401 asks the page to sign in again, 4403
// refuses a cross-site socket, 1011 covers every upstream failure and the
// per-user cap, 1009 a message from DSH above WS_MAX_MESSAGE_BYTES.
const (
	closeUnauthorized = 4401
	closeForbidden    = 4403
)

// serveWebSocket bridges a browser WebSocket to DSH. Failures before the
// bridge exists are reported the way browsers can see them: the upgrade
// succeeds and is closed at once with a code and reason.
func (p *Proxy) serveWebSocket(c *fiber.Ctx, user, rest string) error {
	id, status, err := p.authenticate(c)
	switch {
	case status == fiber.StatusUnauthorized:
		return p.refuse(c, closeUnauthorized, "sign in again")
	case err != nil:
		return p.refuse(c, closeForbidden, err.Error())
	case id.User != user:
		return p.refuse(c, closeUnauthorized, "this sandbox belongs to another user")
	case id.Ambient && c.Get(fiber.HeaderOrigin) != "" && !clientinfo.SameOrigin(c):
		return p.refuse(c, closeForbidden, "cross-site WebSocket refused")
	}
	if !p.o.Slots.Acquire(user) {
		return p.refuse(c, websocket.CloseInternalServerErr, "too many connections to this sandbox")
	}
	release := func() { p.o.Slots.Release(user) }
	box, _, err := p.ready(c, user, false)
	if err != nil {
		release()
		return p.refuse(c, websocket.CloseInternalServerErr, reason(err))
	}
	cookie, rev, err := p.handshakeCookie(c, user, box, 0)
	if err != nil {
		release()
		return p.refuse(c, websocket.CloseInternalServerErr, reason(err))
	}
	up, resp, err := p.dial(c, user, rest, box, cookie)
	if resp != nil && resp.StatusCode == http.StatusUnauthorized {
		if cookie, _, err = p.handshakeCookie(c, user, box, rev); err == nil {
			up, _, err = p.dial(c, user, rest, box, cookie)
		}
	}
	if err != nil {
		release()
		p.m.upstreamErrors.WithLabelValues("websocket_dial").Inc()
		return p.refuse(c, websocket.CloseInternalServerErr, "your sandbox did not accept the connection")
	}
	up.SetReadLimit(p.o.WSMaxMessage)

	upgrader := websocket.FastHTTPUpgrader{
		ReadBufferSize: 32 << 10, WriteBufferSize: 32 << 10,
		CheckOrigin: func(*fasthttp.RequestCtx) bool { return true }, // checked above
	}
	if sp := up.Subprotocol(); sp != "" {
		upgrader.Subprotocols = []string{sp}
	}
	p.tracker.begin(user)
	p.m.inFlight.Inc()
	err = upgrader.Upgrade(c.Context(), func(down *websocket.Conn) {
		defer func() {
			p.m.inFlight.Dec()
			p.tracker.end(user)
			release()
		}()
		p.bridge(id, down, up)
	})
	if err != nil {
		up.Close()
		p.m.inFlight.Dec()
		p.tracker.end(user)
		release()
	}
	return nil
}

func reason(err error) string {
	var we *waitError
	if errors.As(err, &we) {
		return we.detail
	}
	return err.Error()
}

// refuse completes the upgrade and closes at once with code, because a
// browser cannot read the status of a failed upgrade.
func (p *Proxy) refuse(c *fiber.Ctx, code int, text string) error {
	p.m.requests.WithLabelValues("1xx").Inc()
	upgrader := websocket.FastHTTPUpgrader{CheckOrigin: func(*fasthttp.RequestCtx) bool { return true }}
	if len(text) > 120 { // a close reason must fit a control frame
		text = text[:120]
	}
	return upgrader.Upgrade(c.Context(), func(conn *websocket.Conn) {
		_ = conn.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, text), time.Now().Add(time.Second))
		_ = conn.Close()
	})
}

func (p *Proxy) dial(c *fiber.Ctx, user, rest string, box kv.Sandbox, cookie string) (*websocket.Conn, *http.Response, error) {
	u := "ws://" + box.Address + rest
	if q := c.Request().URI().QueryString(); len(q) > 0 {
		u += "?" + string(q)
	}
	h := http.Header{}
	p.upstreamHeaders(c, user, cookie, h)
	h.Set("Host", clientinfo.Host(c))
	if sp := c.Get("Sec-WebSocket-Protocol"); sp != "" {
		h.Set("Sec-WebSocket-Protocol", sp)
	}
	conn, resp, err := p.dialer.Dial(u, h)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	return conn, resp, err
}

// bridge copies messages both ways, frame by frame (a 16 MiB message is
// never held whole), passes pings, pongs and close codes through, and
// counts messages as activity. It lasts while id's credentials hold.
func (p *Proxy) bridge(id Identity, down, up *websocket.Conn) {
	user := id.User
	x := &exchange{valid: id.Valid, ws: down}
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

	errs := make(chan error, 2)
	go func() { errs <- p.pump(user, p.m.bytesUp, up, down, closeFor) }()
	go func() {
		errs <- p.pump(user, p.m.bytesDown, down, up, func(err error) []byte {
			// The sandbox went away because its user was signed out (a
			// deletion, a recreate): tell the page so, not "lost".
			if id.Valid != nil && !id.Valid() {
				return websocket.FormatCloseMessage(closeUnauthorized, "signed out")
			}
			return closeFor(err)
		})
	}()
	<-errs
	// One side ended; the close it caused ends the other pump.
	down.Close()
	up.Close()
	<-errs
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
// already told src). bytes counts what passes in this direction.
func (p *Proxy) pump(user string, bytes prometheus.Counter, dst, src *websocket.Conn, closing func(error) []byte) error {
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
		p.tracker.touch(user)
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
