package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
)

// Load is steady traffic from simulated browser users, each with its
// session cookie: small GETs, a server-sent event stream now and then,
// uploads, and one WebSocket echo session that reconnects when it is
// closed, as the DSH web UI does. It counts every outcome.
type Load struct {
	o      LoadOptions
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	r      LoadReport
	// flights are the requests sent and not yet answered.
	flights map[*flight]bool
}

type flight struct {
	method, kind, url string
	start             time.Time
}

// LoadOptions shape a Load.
type LoadOptions struct {
	// Users are signed-in clients (Client.Signup through the same base),
	// by user name.
	Users map[string]*Client
	// Pause is each user's think time between requests (default 100ms).
	Pause time.Duration
	// NoSockets leaves out the WebSocket sessions.
	NoSockets bool
	// Stall is how long a request may go unanswered before it counts as
	// failed (default 10s): from that moment on, so a Report taken while
	// it still hangs counts it, and once, whatever it gets in the end.
	Stall time.Duration
}

// LoadReport is what a Load saw.
type LoadReport struct {
	// Requests counts answers by "METHOD kind status" ("GET small 200",
	// "POST upload 503") and transport failures by "… error".
	Requests map[string]int
	// Sent and Failed count idempotent requests (GETs: small and event
	// streams); a failure is any answer but 200, an error, or a stream
	// cut short.
	Sent, Failed int
	// Uploads and UploadsFailed count POSTs, which no proxy may retry.
	Uploads, UploadsFailed int
	// Sockets counts WebSocket sessions opened; Closed their ends by close
	// code (-1: the connection broke without one), Reconnected the
	// sessions opened again after an end. Unanswered counts messages sent
	// just before a 1001 close (the closing side may send nothing after
	// its close frame, so the page sends them again on its new socket);
	// Lost counts messages never answered otherwise.
	Sockets     int
	Closed      map[int]int
	Reconnected int
	Unanswered  int
	Lost        int
	// Stalled counts requests unanswered for longer than Stall (among the
	// failed ones); Slowest is the longest any request has waited so far,
	// answered or not.
	Stalled int
	Slowest time.Duration
	// Failures are the first few failed requests, with what they got.
	Failures []string
}

// StartLoad starts the traffic against base (http://host:port); Stop
// ends it.
func StartLoad(t testing.TB, base string, o LoadOptions) *Load {
	if o.Pause == 0 {
		o.Pause = 100 * time.Millisecond
	}
	if o.Stall == 0 {
		o.Stall = 10 * time.Second
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &Load{o: o, cancel: cancel, r: LoadReport{Requests: map[string]int{}, Closed: map[int]int{}}, flights: map[*flight]bool{}}
	t.Cleanup(l.Stop)
	for user, c := range o.Users {
		l.wg.Go(func() { l.browse(ctx, base, user, c) })
		if !o.NoSockets {
			l.wg.Go(func() { l.socket(ctx, base, user, c) })
		}
	}
	return l
}

// Stop ends the traffic and waits for every user to finish.
func (l *Load) Stop() {
	l.cancel()
	l.wg.Wait()
}

// Report is a copy of the counts so far.
func (l *Load) Report() LoadReport {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.r
	r.Requests, r.Closed, r.Failures = map[string]int{}, map[int]int{}, slices.Clone(l.r.Failures)
	for k, v := range l.r.Requests {
		r.Requests[k] = v
	}
	for k, v := range l.r.Closed {
		r.Closed[k] = v
	}
	now := time.Now()
	for f := range l.flights {
		waited := now.Sub(f.start)
		r.Slowest = max(r.Slowest, waited)
		if waited > l.o.Stall {
			r.tally(f.method, f.kind, f.url, "stalled", fmt.Sprintf("still unanswered after %s", waited.Round(time.Millisecond)), now)
		}
	}
	return r
}

func (l *Load) count(fn func(r *LoadReport)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fn(&l.r)
}

// uploadBody is what each upload sends.
var uploadBody = bytes.Repeat([]byte("u"), 32<<10)

func (l *Load) browse(ctx context.Context, base, user string, c *Client) {
	prefix := base + "/u/" + user
	for i := 0; ctx.Err() == nil; i++ {
		switch {
		case i%5 == 4:
			l.request(c, base, http.MethodPost, "upload", prefix+"/api/echo", uploadBody, nil)
		case i%7 == 6:
			l.request(c, base, http.MethodGet, "events", prefix+"/api/events?interval=20&count=3", nil, func(b []byte) error {
				if n := bytes.Count(b, []byte("event: tick")); n != 3 {
					return fmt.Errorf("%d of 3 events", n)
				}
				return nil
			})
		default:
			l.request(c, base, http.MethodGet, "small", prefix+"/api/files", nil, nil)
		}
		select {
		case <-ctx.Done():
		case <-time.After(l.o.Pause):
		}
	}
}

// request sends one request; a request is counted once it is answered,
// or once it has waited Stall, even if the Load stops meanwhile (the
// client never gives up on it: an answer that never comes is a failure
// the scenario must see).
func (l *Load) request(c *Client, base, method, kind, u string, body []byte, check func([]byte) error) {
	req, _ := http.NewRequest(method, u, bytes.NewReader(body))
	if method != http.MethodGet {
		req.Header.Set("Origin", base)
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	f := &flight{method: method, kind: kind, url: u, start: time.Now()}
	l.count(func(*LoadReport) { l.flights[f] = true })
	resp, err := c.HTTP.Do(req)
	outcome, detail := "error", fmt.Sprint(err)
	if err == nil {
		b, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		outcome = fmt.Sprint(resp.StatusCode)
		if resp.StatusCode == http.StatusOK && check != nil {
			rerr = errors.Join(rerr, check(b))
		}
		if rerr != nil {
			outcome = "cut"
		}
		detail = fmt.Sprintf("%s %.300s %v", resp.Status, b, rerr)
	}
	now := time.Now()
	waited := now.Sub(f.start)
	if waited > l.o.Stall {
		outcome, detail = "stalled", fmt.Sprintf("answered after %s: %s", waited.Round(time.Millisecond), detail)
	}
	l.count(func(r *LoadReport) {
		delete(l.flights, f)
		r.Slowest = max(r.Slowest, waited)
		r.tally(method, kind, u, outcome, detail, now)
	})
}

// tally counts one request's outcome.
func (r *LoadReport) tally(method, kind, u, outcome, detail string, at time.Time) {
	r.Requests[method+" "+kind+" "+outcome]++
	failed := outcome != "200"
	if failed && len(r.Failures) < 10 {
		r.Failures = append(r.Failures, fmt.Sprintf("%s %s at %s: %s", method, u, at.Format("15:04:05.000"), detail))
	}
	if outcome == "stalled" {
		r.Stalled++
	}
	if method == http.MethodGet {
		r.Sent++
		if failed {
			r.Failed++
		}
	} else {
		r.Uploads++
		if failed {
			r.UploadsFailed++
		}
	}
}

// socket keeps a WebSocket echo session open, sending a message every
// 200ms; when the session ends it counts how and opens it again.
func (l *Load) socket(ctx context.Context, base, user string, c *Client) {
	u, _ := url.Parse(base)
	h := http.Header{"Origin": {base}}
	for _, ck := range c.HTTP.Jar.Cookies(u) {
		h.Add("Cookie", ck.Name+"="+ck.Value)
	}
	d := websocket.Dialer{HandshakeTimeout: 30 * time.Second}
	wsURL := strings.Replace(base, "http://", "ws://", 1) + "/u/" + user + "/api/ws"
	opened := 0
	for ctx.Err() == nil {
		conn, resp, err := d.DialContext(ctx, wsURL, h)
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		if err != nil {
			if ctx.Err() == nil {
				l.count(func(r *LoadReport) { r.Requests["GET socket error"]++ })
				time.Sleep(200 * time.Millisecond)
			}
			continue
		}
		opened++
		l.count(func(r *LoadReport) {
			r.Sockets++
			if opened > 1 {
				r.Reconnected++
			}
		})
		code, lost := echo(ctx, conn)
		conn.Close()
		if ctx.Err() == nil || code != 0 {
			l.count(func(r *LoadReport) {
				if code == websocket.CloseGoingAway {
					r.Unanswered += lost
				} else {
					r.Lost += lost
				}
				if code != 0 {
					r.Closed[code]++
				}
			})
		}
	}
}

// echo runs one session until ctx ends (code 0) or the session does (its
// close code, -1 without one); lost is 1 if a sent message got no echo.
func echo(ctx context.Context, conn *websocket.Conn) (code, lost int) {
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			_ = conn.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
			return 0, 0
		case <-time.After(200 * time.Millisecond):
		}
		msg := fmt.Sprintf("ping %d", i)
		if err := conn.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
			return closeCode(err), 0
		}
		_ = conn.SetReadDeadline(time.Now().Add(15 * time.Second))
		_, got, err := conn.ReadMessage()
		if err != nil {
			return closeCode(err), 1
		}
		if string(got) != msg {
			return -2, 1
		}
	}
}

func closeCode(err error) int {
	var ce *websocket.CloseError
	if errors.As(err, &ce) {
		return ce.Code
	}
	return -1
}

// Table formats rows of (name, value) as an aligned two-column table.
func Table(title string, rows [][2]string) string {
	w := 0
	for _, r := range rows {
		w = max(w, len(r[0]))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n%s\n", title)
	for _, r := range rows {
		fmt.Fprintf(&b, "  %-*s  %s\n", w, r[0], r[1])
	}
	return b.String()
}

// Rows are the report's rows for Table.
func (r LoadReport) Rows() [][2]string {
	rows := [][2]string{
		{"idempotent requests sent", fmt.Sprint(r.Sent)},
		{"idempotent requests failed", fmt.Sprint(r.Failed)},
		{"uploads sent / failed", fmt.Sprintf("%d / %d", r.Uploads, r.UploadsFailed)},
		{"slowest answer (or wait so far)", r.Slowest.Round(time.Millisecond).String()},
	}
	var keys []string
	for k := range r.Requests {
		if !strings.HasSuffix(k, " 200") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		rows = append(rows, [2]string{"  " + k, fmt.Sprint(r.Requests[k])})
	}
	var codes []string
	for c, n := range r.Closed {
		codes = append(codes, fmt.Sprintf("%d×%d", n, c))
	}
	sort.Strings(codes)
	closed := strings.Join(codes, ", ")
	if closed == "" {
		closed = "none"
	}
	rows = append(rows,
		[2]string{"websocket sessions opened", fmt.Sprint(r.Sockets)},
		[2]string{"websockets closed (count×code)", closed},
		[2]string{"websockets reconnected", fmt.Sprint(r.Reconnected)},
		[2]string{"websocket messages in flight at a 1001 close", fmt.Sprint(r.Unanswered)},
		[2]string{"websocket messages lost otherwise", fmt.Sprint(r.Lost)},
	)
	return rows
}
