package proxy

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Commander publishes lifecycle commands (events.Publisher).
type Commander interface {
	Command(ctx context.Context, c events.Command) (duplicate bool, err error)
}

// Target is what a request asks for: user's DSH, as seen from the
// browser's host and scheme (DSH's auth cookie is per host). Origin: the
// request came to the user's sandbox origin (subdomain mode).
type Target struct {
	User, Host, Scheme string
	Origin             bool
	// Background: a page's own request (a fetch, a WebSocket), not the
	// user's navigation (background).
	Background bool
}

// Upstream is where a request goes and the cookie it carries.
type Upstream struct {
	Address string
	PodUID  string
	Cookie  string
	// Host is the Host header DSH gets, the one its handshake was made
	// for (see upstreamHost).
	Host string
	// rev is the handshake's revision: Refresh asks for a newer one.
	rev uint64
}

// sandboxStarting answers a browser navigation while the sandbox wakes:
// the starting page, which follows the sandbox's phase live, rather than a
// wait with a blank tab.
type sandboxStarting struct {
	User   string
	Phase  state.Phase
	Reason string
	// Slept is the sandbox's last suspend, which the page explains.
	Slept *state.Suspension
}

func (e *sandboxStarting) Error() string { return "sandbox " + string(e.Phase) }

// Resolver finds where a user's requests go: the sandbox's address once it
// is Ready (waking it when it is not) and DSH's auth cookie for the pod
// and host (asking lifecycle for a handshake when none is cached). HTTP
// and WebSocket share it. The cached path, a Ready sandbox with a cached
// handshake, is two cache reads and one decryption.
type Resolver struct {
	Sandboxes        *kv.Cache[state.Sandbox]
	Queue            capacity.Queue
	Handshakes       *kv.Cache[state.Handshake]
	Commands         Commander
	Sealer           *handshake.Sealer
	WakeTimeout      time.Duration
	HandshakeTimeout time.Duration
	// MaxStaleness is ROUTE_MAX_STALENESS: an address is used only while
	// Sandboxes was confirmed current within it (0: always, for tests).
	MaxStaleness time.Duration
	m            *metrics

	// opened keeps decrypted cookies while the handshakes cache has not
	// changed since (its update count), so the cached path neither builds
	// the handshake key nor decrypts.
	mu     sync.RWMutex
	opened map[cookieKey]openedCookie

	// refreshes paces this edge's refreshes of each (user, pod, host);
	// made on first use.
	refreshOnce sync.Once
	refreshes   *handshake.Backoff
}

type cookieKey struct{ user, pod, host string }

// maxOpened bounds opened; past it, it starts afresh.
const maxOpened = 1 << 16

type openedCookie struct {
	cookie  string
	rev     uint64
	updates uint64
}

// Resolve returns t's upstream. With wait false (a browser navigation) a
// sandbox that is not Ready is woken and answered with *sandboxStarting at
// once; otherwise Resolve waits up to WakeTimeout for it. Every wait ends
// with ctx.
//
// A handshake fails when the pod it was for went away meanwhile (the
// sweeper suspended the sandbox, or its pod was replaced): that request is
// answered once more from the sandbox's new state, so a navigation wakes
// it instead of showing the failure of a pod that is gone.
func (r *Resolver) Resolve(ctx context.Context, t Target, wait bool) (Upstream, error) {
	for again := true; ; again = false {
		box, err := r.ready(ctx, t.User, wait, t.Background)
		if err != nil {
			return Upstream{}, err
		}
		if err := r.fresh(); err != nil {
			return Upstream{}, err
		}
		up, err := r.cookie(ctx, t, box, 0)
		if err != nil && again && r.moved(t.User, box) {
			continue
		}
		return up, err
	}
}

// moved reports whether user's sandbox is no longer the Ready pod box
// was.
func (r *Resolver) moved(user string, box state.Sandbox) bool {
	e, ok := r.Sandboxes.Get(user)
	return !usable(e, ok) || e.Value.PodUID != box.PodUID
}

// fresh refuses to route from a copy of the sandboxes bucket that has not
// been confirmed current for longer than MaxStaleness (security review
// S8). A pod at a recorded address cannot prove it is the recorded pod: it
// may be another tenant's that was given the address since, and it can
// answer anything. What the edge can know is how old its knowledge is, so
// it stops sending requests, bodies and DSH cookies to addresses it has
// not been able to check for that long.
func (r *Resolver) fresh() error {
	if r.MaxStaleness <= 0 || time.Since(r.Sandboxes.Current()) <= r.MaxStaleness {
		return nil
	}
	r.m.staleRefusals.Inc()
	return errStale
}

// Refresh returns up with a fresh cookie, after DSH refused up.Cookie.
// Refreshes of one (user, pod, host) are paced (handshake.EdgeRefreshes):
// a DSH that refuses every cookie gets a handshake now and then, not one
// per request, and in between its requests are answered as refused.
func (r *Resolver) Refresh(ctx context.Context, t Target, up Upstream) (Upstream, error) {
	r.refreshOnce.Do(func() {
		if r.refreshes == nil {
			r.refreshes = handshake.EdgeRefreshes()
		}
	})
	if r.refreshes.Next(state.HandshakeKey(t.User, up.PodUID, up.Host), time.Now()) > 0 {
		return Upstream{}, errRefusedTwice
	}
	return r.cookie(ctx, t, state.Sandbox{Address: up.Address, PodUID: up.PodUID}, up.rev)
}

func usable(e kv.Entry[state.Sandbox], ok bool) bool {
	return ok && e.Value.Phase == state.PhaseReady && e.Value.Address != ""
}

// ready returns user's sandbox once it is Ready. A page's background
// request does not wake a sandbox the gateway put to sleep for want of use
// (idle.Reason.Inactive): a forgotten tab reconnecting would undo the
// suspend it caused. It is told the sandbox is paused; the user's
// navigation wakes it.
func (r *Resolver) ready(ctx context.Context, user string, wait, background bool) (state.Sandbox, error) {
	e, ok := r.Sandboxes.Load(ctx, user)
	if usable(e, ok) {
		return e.Value, nil
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, r.WakeTimeout)
	defer cancel()
	woken := uint64(0)
	for {
		switch e.Value.Phase {
		case state.PhaseReady:
			if e.Value.Address != "" {
				r.m.wakes.WithLabelValues("ready").Inc()
				r.m.wakeDuration.Observe(time.Since(start).Seconds())
				return e.Value, nil
			}
		case state.PhaseFailed:
			r.m.wakes.WithLabelValues("failed").Inc()
			return state.Sandbox{}, &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox failed", Detail: "Your sandbox failed to start: " + e.Value.Reason}
		case state.PhaseDeleting:
			return state.Sandbox{}, errDeleting
		case state.PhaseSuspended, state.PhaseSuspending:
			if ls := e.Value.LastSuspend; background && ls != nil && idle.Reason(ls.Reason).Inactive() {
				r.m.wakes.WithLabelValues("paused").Inc()
				return state.Sandbox{}, paused(ls)
			}
			// Wake it; the command's ID is derived from this revision, so
			// every edge asking about the same state publishes one wake.
			if e.Revision != woken {
				if _, err := r.Commands.Command(ctx, events.NewWake(user, e.Revision)); err != nil {
					r.m.wakes.WithLabelValues("unavailable").Inc()
					return state.Sandbox{}, noControlPlane(err)
				}
				woken = e.Revision
			}
		}
		if !wait {
			shown := r.Queue.Describe(e.Value)
			return state.Sandbox{}, &sandboxStarting{User: user, Phase: shown.Phase, Reason: shown.Reason, Slept: e.Value.LastSuspend}
		}
		rev := e.Revision
		var err error
		e, _, err = r.Sandboxes.Wait(ctx, user, func(n kv.Entry[state.Sandbox], ok bool) bool { return ok && n.Revision != rev })
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			r.m.wakes.WithLabelValues("timeout").Inc()
			shown := r.Queue.Describe(e.Value)
			return state.Sandbox{}, &web.Error{Status: http.StatusGatewayTimeout, Title: "Sandbox not ready",
				Detail: strings.TrimSpace("Your sandbox did not become ready within "+r.WakeTimeout.String()+" (it is "+string(shown.Phase)+"). "+shown.Reason) + " Try again in a moment."}
		case err != nil:
			r.m.wakes.WithLabelValues("abandoned").Inc()
			return state.Sandbox{}, err
		}
	}
}

// freshFailure is how long a recorded handshake failure is taken as the
// answer rather than a reason to try again.
const freshFailure = 5 * time.Second

// cookie returns DSH's auth cookie for (user, pod, host), asking lifecycle
// for one when none is cached or the cached one (revision stale) was
// refused.
func (r *Resolver) cookie(ctx context.Context, t Target, box state.Sandbox, stale uint64) (Upstream, error) {
	host := upstreamHost(t, box.Address)
	up := Upstream{Address: box.Address, PodUID: box.PodUID, Host: host}
	ck := cookieKey{t.User, box.PodUID, host}
	updates := r.Handshakes.Updates()
	r.mu.RLock()
	o, ok := r.opened[ck]
	r.mu.RUnlock()
	if ok && o.updates == updates && o.rev > stale {
		up.Cookie, up.rev = o.cookie, o.rev
		return up, nil
	}
	key := state.HandshakeKey(t.User, box.PodUID, host)
	e, ok := r.Handshakes.Load(ctx, key)
	if ok && e.Revision > stale {
		if e.Value.Error == "" {
			if c, err := r.Sealer.Open(e.Value.Sealed, []byte(key)); err == nil {
				up.Cookie, up.rev = string(c), e.Revision
				r.mu.Lock()
				if r.opened == nil || len(r.opened) >= maxOpened {
					r.opened = map[cookieKey]openedCookie{} // old pods' and hosts' entries go too
				}
				r.opened[ck] = openedCookie{cookie: up.Cookie, rev: up.rev, updates: updates}
				r.mu.Unlock()
				return up, nil
			}
			// Sealed with a key this edge no longer has (a rotation
			// retired it): as good as no cookie. Ask for a fresh one.
		} else if time.Since(e.Value.At) < freshFailure {
			return Upstream{}, handshakeFailed(e.Value.Error)
		}
		stale = e.Revision
	}
	if _, err := r.Commands.Command(ctx, events.NewHandshake(t.User, events.HandshakeArgs{
		PodUID: box.PodUID, Host: host, Proto: t.Scheme, Prefix: t.prefix(), StaleRevision: stale,
	})); err != nil {
		if ctx.Err() != nil {
			return Upstream{}, ctx.Err()
		}
		return Upstream{}, noControlPlane(err)
	}
	wctx, cancel := context.WithTimeout(ctx, r.HandshakeTimeout)
	defer cancel()
	e, _, err := r.Handshakes.Wait(wctx, key, func(n kv.Entry[state.Handshake], ok bool) bool { return ok && n.Revision > stale })
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return Upstream{}, errHandshakeTimeout
	case err != nil:
		return Upstream{}, err
	case e.Value.Error != "":
		return Upstream{}, handshakeFailed(e.Value.Error)
	}
	c, err := r.Sealer.Open(e.Value.Sealed, []byte(key))
	if err != nil {
		return Upstream{}, errUnsealable
	}
	up.Cookie, up.rev = string(c), e.Revision
	return up, nil
}

// upstreamHost is the Host DSH gets for t at address; the handshake is
// made for that Host (and told the prefix, Target.prefix) and keyed on it.
// In path mode it is the browser's (a public host, which
// DSH_TRUSTED_HOSTS lists). On a sandbox origin it is localhost:<pod
// port>, which DSH always trusts whatever its DSH_TRUSTED_HOSTS
// (UPSTREAM.md): no per-user host needs trusting, one handshake per pod
// serves every way the sandbox is reached, and the browser's host goes
// along as X-Forwarded-Host.
func upstreamHost(t Target, address string) string {
	if !t.Origin {
		return t.Host
	}
	if _, port, err := net.SplitHostPort(address); err == nil && port != "" {
		return localhosts.of(port)
	}
	return "localhost"
}

// prefix is where DSH is told it is served: /u/<user> in path mode, and
// at the root ("") on a sandbox origin.
func (t Target) prefix() string {
	if t.Origin {
		return ""
	}
	return "/u/" + t.User
}

// localhosts interns "localhost:<port>" per port: the pods' ports are few,
// and the Host is made on every request to a sandbox origin.
var localhosts = internedHosts{m: map[string]string{}}

type internedHosts struct {
	mu sync.RWMutex
	m  map[string]string
}

func (h *internedHosts) of(port string) string {
	h.mu.RLock()
	v, ok := h.m[port]
	h.mu.RUnlock()
	if ok {
		return v
	}
	v = "localhost:" + port
	h.mu.Lock()
	if len(h.m) < 1024 { // bounded: a pod's port is the template's
		h.m[port] = v
	}
	h.mu.Unlock()
	return v
}
