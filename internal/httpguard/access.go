// Every request's id and its line in the access log.

package httpguard

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/gofiber/fiber/v2"
)

// scope is what the edge keeps about a request for its access line.
type scope struct {
	id    string
	user  string
	start time.Time
	log   *slog.Logger
	// ctx is the request's context, made on first use (Context); end
	// ends it. conn is the client's connection, watched for departure
	// while the handler runs; detached: the handler took over ending ctx.
	ctx      context.Context
	end      context.CancelFunc
	conn     net.Conn
	watch    *departures
	detached bool
	// deferred: the handler writes the line itself when the answer ends
	// (a streamed proxied answer, whose size and end come after the
	// handler returns).
	deferred bool
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
func RequestID(c *fiber.Ctx) string { return scopeFor(c).id }

// Context is the request's context, for every wait, publish and call out
// its handler makes: it carries the request id (ident.RequestIDOf, which
// commands quote) and ends when the client leaves while the handler runs
// (Policy.Run notices within a poll) or when the request ends: when the
// handler returns, or when whoever took it over (Detach) says.
func Context(c *fiber.Ctx) context.Context {
	return scopeFor(c).context(c)
}

// Detach is the request's context, whose end it hands to the caller, for an
// answer that outlives the handler (a stream, a WebSocket): it calls end
// when the answer is over. From the handler's return on, the departure
// watch stops: a client that leaves is noticed by the failing write.
func Detach(c *fiber.Ctx) (ctx context.Context, end context.CancelFunc) {
	s := scopeFor(c)
	ctx = s.context(c)
	s.detached = true
	return ctx, s.end
}

// scopeFor is c's scope; without Access (a unit test's app) one of its
// own, made on first use.
func scopeFor(c *fiber.Ctx) *scope {
	if s := scopeOf(c); s != nil {
		return s
	}
	s := &scope{id: ident.NewRequestID(), start: time.Now()}
	c.Locals(scopeKey, s)
	c.Set(ident.HeaderRequestID, s.id)
	return s
}

func (s *scope) context(c *fiber.Ctx) context.Context {
	if s.ctx == nil {
		s.ctx, s.end = context.WithCancel(ident.WithRequestID(context.Background(), s.id))
		if s.watch != nil {
			s.conn = c.Context().Conn()
			s.watch.add(s)
		}
	}
	return s.ctx
}

// close ends what the scope holds once its handler has returned.
func (s *scope) close() {
	if s.ctx == nil {
		return
	}
	if s.watch != nil {
		s.watch.remove(s)
	}
	if !s.detached {
		s.end()
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
}

// Log writes the line at info (debug for health probes, which would
// drown the rest).
func (l Line) Log(log *slog.Logger) {
	level := slog.LevelInfo
	if l.Route == RouteProbe {
		level = slog.LevelDebug
	}
	if !log.Enabled(context.Background(), level) {
		return
	}
	log.LogAttrs(context.Background(), level, "request",
		slog.String("method", l.Method), slog.String("route", l.Route), slog.Int("status", l.Status),
		slog.Int64("bytes", l.Bytes), slog.Float64("duration_ms", float64(l.Took.Microseconds())/1000),
		slog.String("user", l.User), slog.String("request_id", l.RequestID))
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
	case strings.HasPrefix(path, "/_/status"):
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
		s := &scope{start: time.Now(), log: log, watch: &p.departures}
		if id := c.Request().Header.Peek(ident.HeaderRequestID); len(id) > 0 && p.trustedPeer(addrOf(c.Context().RemoteAddr())) {
			s.id = ident.AdoptRequestID(string(id))
		} else {
			s.id = ident.NewRequestID()
		}
		c.Locals(scopeKey, s)
		c.Set(ident.HeaderRequestID, s.id)
		err := c.Next()
		s.close()
		if err != nil {
			if herr := c.App().ErrorHandler(c, err); herr != nil {
				_ = c.SendStatus(fiber.StatusInternalServerError)
			}
		}
		if s.deferred {
			return nil
		}
		// Body would read a stream whole: its size is not known here.
		bytes := int64(-1)
		if !c.Response().IsBodyStream() {
			bytes = int64(len(c.Response().Body()))
		}
		onSandbox := false
		if i, ok := c.Locals(localsKey).(*Info); ok {
			onSandbox = i.OnSandboxDomain
		}
		Line{Method: c.Method(), Route: RouteOf(c.Path(), onSandbox), Status: c.Response().StatusCode(), Bytes: bytes,
			Took: time.Since(s.start), User: s.user, RequestID: s.id}.Log(log)
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
	var check []*scope
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
				check = append(check, s)
			}
		}
		p.departures.mu.Unlock()
		for _, s := range check {
			if Gone(s.conn) {
				s.end()
			}
		}
	}
}
