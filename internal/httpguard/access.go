// Every request's id and its line in the access log.

package httpguard

import (
	"context"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/gofiber/fiber/v2"
)

// scope is one request's: its id, client (Info), start, logger, access
// line, and its context, which the scope is itself (a context.Context):
// ended when the client leaves while the handler runs, when the handler
// returns, or when whoever took it over (Detach) ends it. Scopes are
// pooled, so that a cached proxied request allocates nothing; a scope
// goes back to the pool only when nothing can still hold it (see
// recyclable).
type scope struct {
	scopeRequest
	// The context's state, under mu.
	mu sync.Mutex
	scopeContext
	// Bound once per scope, not per request.
	stopAfter func() bool
	cancel    context.CancelFunc
}

// scopeRequest is what a scope knows of its request.
type scopeRequest struct {
	start time.Time
	log   *slog.Logger
	info  Info
	// infoSet: Middleware filled info (else Get builds one).
	infoSet bool
	user    string
	// id is the request id's bytes; idString its string, made on first
	// use (most requests only write it to a header and a log line).
	id       [ident.MaxRequestID]byte
	idLen    int
	idString string
	// conn is the client's connection, watched for departure while the
	// handler runs (once the context is asked for); detached: the
	// handler took over ending the context.
	conn     net.Conn
	watch    *departures
	ctxUsed  bool
	detached bool
	// deferred: the handler writes the line itself when the answer ends
	// (a streamed proxied answer, whose size and end come after the
	// handler returns).
	deferred bool
	// tenant: the answer is a sandbox's own (TenantAnswer).
	tenant bool
	line   Line
}

// scopeContext is the scope's context state. gen changes each time the
// scope is reused, so a departure noticed for one request never ends the
// next.
type scopeContext struct {
	gen   uint64
	err   error
	done  chan struct{}
	after func()
	more  []*func()
}

var scopes = sync.Pool{New: func() any {
	s := &scope{}
	s.stopAfter, s.cancel = s.stopFirst, s.end
	return s
}}

// newScope is a reset scope for a request starting now.
func newScope(log *slog.Logger, watch *departures) *scope {
	s := scopes.Get().(*scope)
	s.reset(log, watch)
	return s
}

// reset makes s serve a new request: a new generation, nothing ended.
func (s *scope) reset(log *slog.Logger, watch *departures) {
	s.scopeRequest = scopeRequest{start: time.Now(), log: log, watch: watch}
	s.mu.Lock()
	s.scopeContext = scopeContext{gen: s.gen + 1}
	s.mu.Unlock()
}

// recyclable: nothing can hold the scope once its handler returned. Its
// context was never handed out, or it was detached and ended before the
// handler returned, and its Done channel was never made, so no one waits
// on it (Detach's contract: the context is not used after its end).
func (s *scope) recyclable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.deferred && s.done == nil && (!s.ctxUsed || s.detached && s.err != nil)
}

const scopeKey = "aaas.scope"

func scopeOf(c *fiber.Ctx) *scope {
	if s, ok := c.Locals(scopeKey).(*scope); ok {
		return s
	}
	return nil
}

// RequestID is the request's id: the trusted ingress's (Policy.Access),
// else one of ours, set on the answer as X-Request-Id. Logs, commands and
// audit events quote it, so one grep follows a request across processes.
// Without Access (a unit test's app) it makes one on first use.
func RequestID(c *fiber.Ctx) string { return scopeFor(c).requestID() }

func (s *scope) requestID() string {
	if s.idString == "" {
		s.idString = string(s.id[:s.idLen])
	}
	return s.idString
}

// Context is the request's context, for every wait, publish and call out
// its handler makes: it carries the request id (ident.RequestIDOf, which
// commands quote) and ends when the client leaves while the handler runs
// (Policy.Run notices within a poll) or when the request ends: when the
// handler returns, or when whoever took it over (Detach) says.
func Context(c *fiber.Ctx) context.Context {
	return scopeFor(c).context(c)
}

// Detach is the request's context, whose end it hands to the caller, for
// an answer that may outlive the handler (a stream, a WebSocket): it
// calls end when the answer is over, and uses ctx no more after that.
// From the handler's return on, the departure watch stops: a client that
// leaves is noticed by the failing write.
func Detach(c *fiber.Ctx) (ctx context.Context, end context.CancelFunc) {
	s := scopeFor(c)
	ctx = s.context(c)
	s.detached = true
	return ctx, s.cancel
}

// scopeFor is c's scope; without Access (a unit test's app) one of its
// own, made on first use and never pooled.
func scopeFor(c *fiber.Ctx) *scope {
	if s := scopeOf(c); s != nil {
		return s
	}
	s := &scope{scopeRequest: scopeRequest{start: time.Now()}}
	s.stopAfter, s.cancel = s.stopFirst, s.end
	s.idLen = len(ident.AppendRequestID(s.id[:0], nil))
	c.Locals(scopeKey, s)
	c.Response().Header.SetBytesV(ident.HeaderRequestID, s.id[:s.idLen])
	return s
}

func (s *scope) context(c *fiber.Ctx) context.Context {
	if !s.ctxUsed {
		s.ctxUsed = true
		if s.watch != nil {
			s.conn = c.Context().Conn()
			s.watch.add(s)
		}
	}
	return s
}

// close ends what the scope holds once its handler has returned.
func (s *scope) close() {
	if !s.ctxUsed {
		return
	}
	if s.watch != nil {
		s.watch.remove(s)
	}
	if !s.detached {
		s.end()
	}
}

// The scope as the request's context.

func (s *scope) Deadline() (time.Time, bool) { return time.Time{}, false }

// Done is made on first use: most requests never wait on their context.
func (s *scope) Done() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done == nil {
		s.done = make(chan struct{})
		if s.err != nil {
			close(s.done)
		}
	}
	return s.done
}

func (s *scope) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

func (s *scope) Value(key any) any {
	if ident.IsRequestIDKey(key) {
		return s.requestID()
	}
	return nil
}

// AfterFunc arranges to call f in its own goroutine once the context
// ends, as context.AfterFunc does (which uses it, so contexts made from
// the scope end with it). The first watcher at a time takes a slot bound
// to the scope and allocates nothing: the proxy's upstream exchange,
// once per request.
func (s *scope) AfterFunc(f func()) (stop func() bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		go f()
		return stopped
	}
	if s.after == nil {
		s.after = f
		return s.stopAfter
	}
	g := f // a copy, so that f itself does not move to the heap
	p := &g
	s.more = append(s.more, p)
	return func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		i := slices.Index(s.more, p)
		if i >= 0 {
			s.more = slices.Delete(s.more, i, i+1)
		}
		return i >= 0
	}
}

func stopped() bool { return false }

func (s *scope) stopFirst() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ok := s.after != nil
	s.after = nil
	return ok
}

// end ends the context (a CancelFunc: idempotent).
func (s *scope) end() { s.endIf(0) }

// endIf ends the context if the scope still serves request generation gen
// (0: whichever it serves).
func (s *scope) endIf(gen uint64) {
	s.mu.Lock()
	if s.err != nil || gen != 0 && gen != s.gen {
		s.mu.Unlock()
		return
	}
	s.err = context.Canceled
	if s.done != nil {
		close(s.done)
	}
	after, more := s.after, s.more
	s.after, s.more = nil, nil
	s.mu.Unlock()
	if after != nil {
		go after()
	}
	for _, f := range more {
		go (*f)()
	}
}

// Logger is the edge's logger for c's handler (the one Access was given;
// the default one without Access). Lines about the request name its
// request_id.
func Logger(c *fiber.Ctx) *slog.Logger {
	if s := scopeOf(c); s != nil && s.log != nil {
		return s.log
	}
	return slog.Default()
}

// SetUser records whom the request was authenticated as, for its access
// line.
func SetUser(c *fiber.Ctx, user string) {
	if s := scopeOf(c); s != nil {
		s.user = user
	}
}

// DeferAccess says the handler writes the request's access line itself
// (Line.Log) once its answer has ended: Access then writes none.
func DeferAccess(c *fiber.Ctx) {
	if s := scopeOf(c); s != nil {
		s.deferred = true
	}
}

// Line is one request in the access log. It names the route by its
// class, never the path or query, which may carry sign-in codes.
type Line struct {
	Method, Route string
	Status        int
	// Bytes is the answer's body length; -1 for a stream whose end the
	// line does not wait for.
	Bytes     int64
	Took      time.Duration
	User      string
	RequestID string
	// attrs hold the fields for slog while the line is written: a
	// record keeps five attributes without allocating, and a line has
	// seven, so they go as one inlined group (LogValue). The duration is
	// whole microseconds: slog's JSON handler boxes a float to write it.
	attrs [7]slog.Attr
}

// Log writes the line at info (debug for health probes, which would
// drown the rest).
func (l *Line) Log(log *slog.Logger) {
	level := lineLevel(l.Route)
	if !log.Enabled(context.Background(), level) {
		return
	}
	log.LogAttrs(context.Background(), level, "request", slog.Any("", l))
}

func lineLevel(route string) slog.Level {
	if route == RouteProbe {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

// LogValue is the line's fields as a group without a key, which handlers
// write inline, as if each were an attribute of the record.
func (l *Line) LogValue() slog.Value {
	l.attrs = [...]slog.Attr{slog.String("method", l.Method), slog.String("route", l.Route), slog.Int("status", l.Status),
		slog.Int64("bytes", l.Bytes), slog.Int64("duration_us", l.Took.Microseconds()),
		slog.String("user", l.User), slog.String("request_id", l.RequestID)}
	return slog.GroupValue(l.attrs[:]...)
}

// Route classes of the access log.
const (
	RouteProbe   = "probe"
	RouteSandbox = "sandbox"
	RouteAdmin   = "admin"
	RouteStatus  = "status"
	RouteStatic  = "static"
	RouteAccount = "account"
)

// RouteOf classes a request by its path (and whether it came to a
// sandbox origin, whose every path is the tenant's).
func RouteOf(path string, onSandboxDomain bool) string {
	switch {
	case onSandboxDomain || strings.HasPrefix(path, "/u/"):
		return RouteSandbox
	case path == "/healthz" || path == "/readyz":
		return RouteProbe
	case path == "/_/admin" || strings.HasPrefix(path, "/_/admin/"):
		return RouteAdmin
	case strings.HasPrefix(path, "/_/status"),
		strings.HasPrefix(path, "/_/sandboxes/") && (strings.HasSuffix(path, "/status") || strings.HasSuffix(path, "/status/stream")):
		return RouteStatus
	case strings.HasPrefix(path, "/_/static/"):
		return RouteStatic
	}
	return RouteAccount
}

// Access runs outermost: it gives the request its id (a trusted
// ingress's valid X-Request-Id, else ours), runs the rest, turns an error
// into its answer with the app's error handler (so the line has the
// status the client gets), and writes the request's access line, unless
// the handler deferred it.
func (p *Policy) Access(log *slog.Logger) fiber.Handler {
	return func(c *fiber.Ctx) error {
		s := newScope(log, &p.departures)
		var ingress []byte
		if id := c.Request().Header.Peek(ident.HeaderRequestID); len(id) > 0 && p.trustedPeer(addrOf(c.Context().RemoteAddr())) {
			ingress = id
		}
		s.idLen = len(ident.AppendRequestID(s.id[:0], ingress))
		c.Locals(scopeKey, s)
		c.Response().Header.SetBytesV(ident.HeaderRequestID, s.id[:s.idLen])
		err := c.Next()
		s.close()
		if err != nil {
			if herr := c.App().ErrorHandler(c, err); herr != nil {
				_ = c.SendStatus(fiber.StatusInternalServerError)
			}
		}
		// The line is made only when it is written: its request id is a
		// string of its own, the one allocation a cached proxied request
		// makes with the access log on.
		if route := RouteOf(c.Path(), s.infoSet && s.info.OnSandboxDomain); !s.deferred && log.Enabled(context.Background(), lineLevel(route)) {
			// Body would read a stream whole: its size is not known here.
			bytes := int64(-1)
			if !c.Response().IsBodyStream() {
				bytes = int64(len(c.Response().Body()))
			}
			s.line = Line{Method: c.Method(), Route: route, Status: c.Response().StatusCode(), Bytes: bytes,
				Took: time.Since(s.start), User: s.user, RequestID: s.requestID()}
			s.line.Log(log)
		}
		// fasthttp keeps the locals until the connection's next request:
		// a recycled scope must not be reachable from this one's.
		c.Locals(scopeKey, nil)
		c.Locals(localsKey, nil)
		if s.recyclable() {
			scopes.Put(s)
		}
		return nil
	}
}

// departures ends the contexts of requests whose clients have gone. One
// goroutine (Policy.Run) checks every request in flight that asked for
// its context every poll, with a non-consuming peek at its connection;
// waits and calls out just watch their context.
type departures struct {
	mu sync.Mutex
	m  map[*scope]struct{}
}

// poll is how often departures checks that clients are still there.
const poll = 250 * time.Millisecond

func (d *departures) add(s *scope) {
	d.mu.Lock()
	if d.m == nil {
		d.m = map[*scope]struct{}{}
	}
	d.m[s] = struct{}{}
	d.mu.Unlock()
}

func (d *departures) remove(s *scope) {
	d.mu.Lock()
	delete(d.m, s)
	d.mu.Unlock()
}

// Run watches the requests in flight for clients that left, until ctx
// ends.
func (p *Policy) Run(ctx context.Context) {
	t := time.NewTicker(poll)
	defer t.Stop()
	// Each scope is seen with its request's generation, read while the
	// request is in flight (in the map): by the time the check runs, the
	// scope may serve another request, which endIf leaves alone.
	type watched struct {
		s    *scope
		gen  uint64
		conn net.Conn
	}
	var check []watched
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// A request younger than poll is not worth a syscall yet.
		old := time.Now().Add(-poll)
		check = check[:0]
		p.departures.mu.Lock()
		for s := range p.departures.m {
			if s.start.Before(old) {
				check = append(check, watched{s, s.gen, s.conn})
			}
		}
		p.departures.mu.Unlock()
		for _, w := range check {
			if Gone(w.conn) {
				w.s.endIf(w.gen)
			}
		}
		clear(check)
	}
}
