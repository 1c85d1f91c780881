package proxy

import (
	"context"
	"errors"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/clientinfo"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
)

// waitError is a failure to get a usable sandbox, with the status and
// message the browser gets.
type waitError struct {
	status int
	title  string
	detail string
}

func (e *waitError) Error() string { return e.detail }

var (
	errNotRunning = &waitError{fiber.StatusServiceUnavailable, "Sandbox unavailable", "Your sandbox cannot be started right now: the gateway cannot reach its control plane. Try again shortly."}
	errDeleting   = &waitError{fiber.StatusServiceUnavailable, "Sandbox being deleted", "This sandbox is being deleted."}
)

// poll is how often waits check that the client is still there.
const poll = 250 * time.Millisecond

// until waits on the sandboxes cache for user until done accepts the entry,
// the deadline passes (context.DeadlineExceeded) or the client leaves
// (errClientGone).
func (p *Proxy) until(c *fiber.Ctx, deadline time.Time, user string, done func(kv.Entry[kv.Sandbox], bool) bool) (kv.Entry[kv.Sandbox], error) {
	for {
		ctx, cancel := context.WithDeadline(context.Background(), earlier(deadline, time.Now().Add(poll)))
		e, _, err := p.o.Sandboxes.Wait(ctx, user, done)
		cancel()
		if err == nil {
			return e, nil
		}
		if !time.Now().Before(deadline) {
			return e, context.DeadlineExceeded
		}
		if clientinfo.Gone(c.Context().Conn()) {
			return e, errClientGone
		}
	}
}

// ready returns the user's sandbox once it is Ready, waking it if needed.
// A browser navigation gets the starting page instead of waiting
// (navigated=true means that page was written).
func (p *Proxy) ready(c *fiber.Ctx, user string, navigation bool) (kv.Sandbox, bool, error) {
	e, ok := p.o.Sandboxes.Get(user)
	if ok && e.Value.Phase == kv.PhaseReady && e.Value.Address != "" {
		return e.Value, false, nil
	}
	start := time.Now()
	deadline := start.Add(p.o.WakeTimeout)
	woken := uint64(0)
	for {
		switch e.Value.Phase {
		case kv.PhaseReady:
			if e.Value.Address != "" {
				p.m.wakes.WithLabelValues("ready").Inc()
				p.m.wakeDuration.Observe(time.Since(start).Seconds())
				return e.Value, false, nil
			}
		case kv.PhaseFailed:
			p.m.wakes.WithLabelValues("failed").Inc()
			return e.Value, false, &waitError{fiber.StatusServiceUnavailable, "Sandbox failed", "Your sandbox failed to start: " + e.Value.Reason}
		case kv.PhaseDeleting:
			return e.Value, false, errDeleting
		case kv.PhaseSuspended, kv.PhaseSuspending:
			// Wake it; the command's ID is derived from this revision, so
			// every edge asking about the same state publishes one wake.
			if e.Revision != woken {
				if _, err := p.o.Publisher.Command(context.Background(), events.NewWake(user, e.Revision)); err != nil {
					p.m.wakes.WithLabelValues("unavailable").Inc()
					return e.Value, false, errNotRunning
				}
				woken = e.Revision
			}
		}
		if navigation {
			return e.Value, true, nil
		}
		rev := e.Revision
		var err error
		e, err = p.until(c, deadline, user, func(n kv.Entry[kv.Sandbox], ok bool) bool { return ok && n.Revision != rev })
		switch {
		case errors.Is(err, errClientGone):
			p.m.wakes.WithLabelValues("abandoned").Inc()
			return e.Value, false, err
		case err != nil:
			p.m.wakes.WithLabelValues("timeout").Inc()
			return e.Value, false, &waitError{fiber.StatusGatewayTimeout, "Sandbox not ready", "Your sandbox did not become ready within " + p.o.WakeTimeout.String() + " (it is " + string(e.Value.Phase) + "). Try again in a moment."}
		}
	}
}

// freshFailure is how long a recorded handshake failure is taken as the
// answer rather than a reason to try again.
const freshFailure = 5 * time.Second

// handshakeCookie returns DSH's auth cookie for (user, pod, Host), asking
// lifecycle for one when none is cached or the cached one (revision stale)
// was refused.
func (p *Proxy) handshakeCookie(c *fiber.Ctx, user string, box kv.Sandbox, stale uint64) (string, uint64, error) {
	host := clientinfo.Host(c)
	key := kv.HandshakeKey(user, box.PodUID, events.HostKey(host))
	e, ok := p.o.Handshakes.Get(key)
	if ok && e.Revision > stale {
		if e.Value.Error == "" {
			cookie, err := p.o.Sealer.Open(e.Value.Sealed, []byte(key))
			if err == nil {
				return string(cookie), e.Revision, nil
			}
			// Sealed with a key this edge no longer has (a rotation
			// retired it): as good as no cookie. Ask for a fresh one.
			stale = e.Revision
		} else if time.Since(e.Value.At) < freshFailure {
			return "", 0, handshakeFailed(e.Value.Error)
		}
	}
	if ok && e.Revision > stale {
		stale = e.Revision
	}
	_, err := p.o.Publisher.Command(context.Background(), events.NewHandshake(user, events.HandshakeArgs{
		PodUID: box.PodUID, Host: host, Proto: clientinfo.Scheme(c), Prefix: "/u/" + user, StaleRevision: stale,
	}))
	if err != nil {
		return "", 0, errNotRunning
	}
	deadline := time.Now().Add(p.o.HandshakeTimeout)
	for {
		ctx, cancel := context.WithDeadline(context.Background(), earlier(deadline, time.Now().Add(poll)))
		e, _, err = p.o.Handshakes.Wait(ctx, key, func(n kv.Entry[kv.Handshake], ok bool) bool { return ok && n.Revision > stale })
		cancel()
		if err == nil {
			break
		}
		if !time.Now().Before(deadline) {
			return "", 0, &waitError{fiber.StatusServiceUnavailable, "Sandbox not answering", "The handshake with your sandbox timed out; try again."}
		}
		if clientinfo.Gone(c.Context().Conn()) {
			return "", 0, errClientGone
		}
	}
	if e.Value.Error != "" {
		return "", 0, handshakeFailed(e.Value.Error)
	}
	cookie, err := p.o.Sealer.Open(e.Value.Sealed, []byte(key))
	if err != nil {
		return "", 0, &waitError{fiber.StatusServiceUnavailable, "Sandbox unavailable", "The gateway cannot read its sandbox credentials (lifecycle seals with a key missing from this edge's HANDSHAKE_KEYS)."}
	}
	return string(cookie), e.Revision, nil
}

func handshakeFailed(reason string) error {
	return &waitError{fiber.StatusServiceUnavailable, "Sandbox unavailable", "The gateway could not sign in to your sandbox: " + reason}
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
