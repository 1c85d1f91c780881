package dshsim

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fasthttp/websocket"
)

// A web app an agent started in the sandbox (`npm run dev`, `vite`): what
// the gateway serves as a preview at <port>-<user>.<SANDBOX_DOMAIN>. It
// behaves as dev servers do where the gateway depends on it: it refuses a
// Host that is not localhost or an address (Vite's allowedHosts), builds
// absolute URLs from the Host it got, pushes hot-reload messages over a
// WebSocket, streams, and echoes the request it received, cookies and all,
// so a test sees exactly what reached it.
//
// Routes:
//
//	GET  /           a page that connects to /hmr and reloads on full-reload
//	any  /echo       the method, path, query, host and headers it received
//	GET  /hmr        WebSocket: {"type":"connected"} first, then every text
//	                 message echoed; offers the vite-hmr subprotocol
//	POST /__reload   sends {"type":"full-reload"} to every /hmr socket
//	GET  /events     ?count=n&interval=ms: n server-sent events
//	GET  /redirect   302 to http://<Host>/echo, as a dev server builds it
//	any  other       404
type App struct {
	mu      sync.Mutex
	sockets map[*websocket.Conn]struct{}
	done    chan struct{}
	once    sync.Once
}

// NewApp returns the app; Close ends its sockets and streams.
func NewApp() *App {
	return &App{sockets: map[*websocket.Conn]struct{}{}, done: make(chan struct{})}
}

// Close ends every socket and stream the app has open.
func (a *App) Close() {
	a.once.Do(func() { close(a.done) })
	a.mu.Lock()
	defer a.mu.Unlock()
	for c := range a.sockets {
		_ = c.Close()
	}
}

// hmrUpgrader offers Vite's subprotocol; the app checks no Origin, as dev
// servers do not.
var hmrUpgrader = websocket.Upgrader{Subprotocols: []string{"vite-hmr"}, CheckOrigin: func(*http.Request) bool { return true }}

func (a *App) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !localHost(hostname(r.Host)) {
		http.Error(w, fmt.Sprintf("Blocked request. This host (%q) is not allowed.", r.Host), http.StatusForbidden)
		return
	}
	switch {
	case r.URL.Path == "/" && r.Method == http.MethodGet:
		// The app's own cookie, which the gateway must not let it set on
		// the preview origin (or, with a Domain, on its siblings).
		w.Header().Set("Set-Cookie", "app_session=1; Path=/")
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = fmt.Fprint(w, appPage)
	case r.URL.Path == "/echo":
		writeJSON(w, http.StatusOK, map[string]any{
			"method": r.Method, "path": r.URL.Path, "query": r.URL.RawQuery, "host": r.Host,
			"remote_addr": r.RemoteAddr, "headers": r.Header,
		})
	case r.URL.Path == "/hmr" && r.Method == http.MethodGet:
		a.serveHMR(w, r)
	case r.URL.Path == "/__reload" && r.Method == http.MethodPost:
		writeJSON(w, http.StatusOK, map[string]int{"clients": a.broadcast(`{"type":"full-reload","path":"*"}`)})
	case r.URL.Path == "/events" && r.Method == http.MethodGet:
		a.serveEvents(w, r)
	case r.URL.Path == "/redirect":
		w.Header().Set("Location", "http://"+r.Host+"/echo")
		w.WriteHeader(http.StatusFound)
	default:
		http.NotFound(w, r)
	}
}

// localHost: the hosts a dev server trusts by default.
func localHost(h string) bool {
	if h == "localhost" || strings.HasSuffix(h, ".localhost") {
		return true
	}
	_, err := netip.ParseAddr(h)
	return err == nil
}

func (a *App) serveHMR(w http.ResponseWriter, r *http.Request) {
	conn, err := hmrUpgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	defer conn.Close()
	conn.SetReadLimit(wsReadLimit)
	a.mu.Lock()
	select {
	case <-a.done:
		a.mu.Unlock()
		return
	default:
	}
	a.sockets[conn] = struct{}{}
	// Under mu: broadcast writes under it too, one writer at a time.
	err = conn.WriteMessage(websocket.TextMessage, []byte(`{"type":"connected"}`))
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		delete(a.sockets, conn)
		a.mu.Unlock()
	}()
	for err == nil {
		var kind int
		var data []byte
		if kind, data, err = conn.ReadMessage(); err != nil {
			return
		}
		a.mu.Lock()
		err = conn.WriteMessage(kind, data)
		a.mu.Unlock()
	}
}

// broadcast sends msg to every socket and returns how many got it.
func (a *App) broadcast(msg string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for c := range a.sockets {
		_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if c.WriteMessage(websocket.TextMessage, []byte(msg)) == nil {
			n++
		}
	}
	return n
}

func (a *App) serveEvents(w http.ResponseWriter, r *http.Request) {
	interval, err := queryInt(r, "interval", 100)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	count, err := queryInt(r, "count", 3)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	startSSE(w)
	rc := http.NewResponseController(w)
	t := time.NewTicker(time.Duration(max(interval, 1)) * time.Millisecond)
	defer t.Stop()
	for i := 1; i <= count; i++ {
		if _, err := fmt.Fprintf(w, "data: %d\n\n", i); err != nil || rc.Flush() != nil {
			return
		}
		if i == count {
			return
		}
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		case <-a.done:
			return
		}
	}
}

const appPage = `<!doctype html>
<meta charset="utf-8">
<title>preview app</title>
<p id="status">connecting</p>
<script>
  const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/hmr', 'vite-hmr');
  ws.onmessage = (e) => {
    const m = JSON.parse(e.data);
    if (m.type === 'connected') document.getElementById('status').textContent = 'connected';
    if (m.type === 'full-reload') location.reload();
  };
  ws.onclose = (e) => { document.getElementById('status').textContent = 'closed ' + e.code; };
</script>
`

// apps are the apps a Server started on request (POST /api/apps?port=N).
type apps struct {
	mu      sync.Mutex
	running map[int]runningApp
	closed  bool
}

type runningApp struct {
	hs  *http.Server
	app *App
}

// serveStartApp is POST /api/apps?port=N: an agent starting a dev server
// in the sandbox. 201 when it started, 200 when one already runs there,
// 409 when the port is taken.
func (s *Server) serveStartApp(w http.ResponseWriter, r *http.Request) {
	port, err := strconv.Atoi(r.URL.Query().Get("port"))
	if err != nil || port < 1 || port > 65535 {
		http.Error(w, "port must be a port number", http.StatusBadRequest)
		return
	}
	started, err := s.startApp(port)
	switch {
	case errors.Is(err, errShuttingDown):
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
	case err != nil:
		http.Error(w, err.Error(), http.StatusConflict)
	case started:
		writeJSON(w, http.StatusCreated, map[string]int{"port": port})
	default:
		writeJSON(w, http.StatusOK, map[string]int{"port": port})
	}
}

var errShuttingDown = errors.New("shutting down")

// startApp serves an App on the DSH listener's host at port; started is
// false when one already runs there.
func (s *Server) startApp(port int) (started bool, err error) {
	host, _, _ := net.SplitHostPort(s.opts.Listen)
	s.apps.mu.Lock()
	defer s.apps.mu.Unlock()
	if s.apps.closed {
		return false, errShuttingDown
	}
	if _, ok := s.apps.running[port]; ok {
		return false, nil
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return false, fmt.Errorf("cannot listen: %w", err)
	}
	app := NewApp()
	hs := &http.Server{Handler: app, ReadHeaderTimeout: 30 * time.Second}
	if s.apps.running == nil {
		s.apps.running = map[int]runningApp{}
	}
	s.apps.running[port] = runningApp{hs, app}
	go func() {
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.out.printf("app on port %d: %v", port, err)
		}
	}()
	s.out.printf("app listening on port %d", port)
	return true, nil
}

// stopApps closes every app, its WebSockets too (http.Server.Close
// leaves hijacked connections open); later starts are refused.
func (s *Server) stopApps() {
	s.apps.mu.Lock()
	defer s.apps.mu.Unlock()
	s.apps.closed = true
	for _, a := range s.apps.running {
		_ = a.hs.Close()
		a.app.Close()
	}
}
