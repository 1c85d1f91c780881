package proxy

import (
	"context"
	"sync"
	"time"

	"github.com/fasthttp/websocket"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// exchange is a long-lived proxied exchange: a WebSocket or a streamed
// response. Credentials are checked when it starts; live re-checks them
// while it lasts, so a logout, a deletion or a recreate on any edge ends it.
type exchange struct {
	id auth.Identity
	// pod is the pod it goes to: when that sandbox is suspended the
	// exchange ends, a WebSocket with 4408 and why.
	pod string
	// ws is the browser's side of a WebSocket; cancel aborts a streamed
	// response (its upstream request).
	ws     *websocket.Conn
	cancel context.CancelFunc
}

// live is every exchange open on this edge, by user.
type live struct {
	mu     sync.Mutex
	byUser map[string]map[*exchange]struct{}
}

func (l *live) add(x *exchange) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byUser == nil {
		l.byUser = map[string]map[*exchange]struct{}{}
	}
	xs := l.byUser[x.id.User]
	if xs == nil {
		xs = map[*exchange]struct{}{}
		l.byUser[x.id.User] = xs
	}
	xs[x] = struct{}{}
}

func (l *live) remove(x *exchange) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if xs := l.byUser[x.id.User]; xs != nil {
		delete(xs, x)
		if len(xs) == 0 {
			delete(l.byUser, x.id.User)
		}
	}
}

// of is the open exchanges of users (every user's when all).
func (l *live) of(users map[string]struct{}, all bool) []*exchange {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*exchange
	add := func(xs map[*exchange]struct{}) {
		for x := range xs {
			out = append(out, x)
		}
	}
	if all {
		for _, xs := range l.byUser {
			add(xs)
		}
		return out
	}
	for u := range users {
		add(l.byUser[u])
	}
	return out
}

// Changes collects the users whose credentials changed (a session ended,
// an account or API token changed or went), here or on another edge, for
// the proxy to re-check their open exchanges at once, and only theirs.
// C holds one pending signal at most.
type Changes struct {
	C     chan struct{}
	mu    sync.Mutex
	users map[string]struct{}
	all   bool
}

// maxChanged bounds the users a burst of changes names before the next
// check looks at every exchange instead.
const maxChanged = 4096

// NewChanges is an empty Changes.
func NewChanges() *Changes {
	return &Changes{C: make(chan struct{}, 1), users: map[string]struct{}{}}
}

// User records that user's credentials changed.
func (c *Changes) User(user string) {
	c.mu.Lock()
	if len(c.users) < maxChanged {
		c.users[user] = struct{}{}
	} else {
		c.all = true
	}
	c.mu.Unlock()
	select {
	case c.C <- struct{}{}:
	default:
	}
}

// take is what changed since the last take.
func (c *Changes) take() (map[string]struct{}, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	users, all := c.users, c.all
	c.users, c.all = map[string]struct{}{}, false
	return users, all
}

// revalidate ends the exchanges whose credentials no longer hold
// (WebSockets with 4401: the page signs in again) and those whose sandbox
// is being suspended (4408, with why: the page tells the user rather
// than reconnecting into a sleeping sandbox), streamed responses by
// aborting them. It checks the exchanges of the users a change names
// (Options.Changes) at once, and every exchange every interval in case a
// change was missed; the checks are cache reads.
func (p *Proxy) revalidate(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var changed <-chan struct{}
	if p.o.Changes != nil {
		changed = p.o.Changes.C
	}
	for {
		var users map[string]struct{}
		all := true
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-changed:
			users, all = p.o.Changes.take()
		}
		for _, x := range p.live.of(users, all) {
			code, why := closeUnauthorized, "signed out"
			if p.o.Auth.Valid(x.id) {
				if code, why = p.asleep(x); code == 0 {
					continue
				}
			} else {
				p.m.revoked.Inc()
			}
			p.live.remove(x)
			if x.ws != nil {
				closeWith(x.ws, code, why)
			} else {
				x.cancel()
			}
		}
	}
}

// asleep is 4408 and why for an exchange whose sandbox is being
// suspended (or was, and woke as another pod), 0 otherwise.
func (p *Proxy) asleep(x *exchange) (int, string) {
	e, ok := p.o.Sandboxes.Get(x.id.User)
	return asleep(x, e, ok)
}

// asleepSoon is asleep once the sandboxes cache says so, waiting up to
// suspendNotice: a socket whose pod went away may have gone because of a
// suspend the cache has not brought yet (the pod can stop before this
// edge hears of it).
func (p *Proxy) asleepSoon(x *exchange) (int, string) {
	ctx, cancel := context.WithTimeout(context.Background(), suspendNotice)
	defer cancel()
	e, ok, _ := p.o.Sandboxes.Wait(ctx, x.id.User, func(e kv.Entry[state.Sandbox], ok bool) bool {
		code, _ := asleep(x, e, ok)
		return code != 0
	})
	return asleep(x, e, ok)
}

// suspendNotice bounds how long a lost socket waits to learn it was lost
// to a suspend.
const suspendNotice = 2 * time.Second

func asleep(x *exchange, e kv.Entry[state.Sandbox], ok bool) (int, string) {
	if !ok || x.pod == "" {
		return 0, ""
	}
	switch b := e.Value; {
	case b.Phase == state.PhaseSuspending || b.Phase == state.PhaseSuspended,
		b.Phase == state.PhaseReady && b.PodUID != x.pod && b.LastSuspend != nil:
		// A close reason must fit a control frame: the reason's name,
		// which the page can put in words (the landing page has them).
		why := "sandbox suspended; files kept"
		if b.LastSuspend != nil {
			why = "sandbox suspended (" + b.LastSuspend.Reason + "); files kept"
		}
		return closeSuspended, why
	}
	return 0, ""
}

// closeWith sends a close frame and closes the connection; safe to call
// while the bridge is reading and writing.
func closeWith(c *websocket.Conn, code int, text string) {
	_ = c.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, text), time.Now().Add(time.Second))
	_ = c.Close()
}
