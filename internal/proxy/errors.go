package proxy

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// noControlPlane is errNotRunning caused by err (a command that could
// not be published), which the log gets.
func noControlPlane(err error) *web.Error { return errNotRunning.Because(err) }

// asProxyError maps any error of a proxied request to the one the browser
// gets: web.AsError's mapping, except that the client's departure is 499
// and a cause of no known kind is the sandbox's failure, 502.
func asProxyError(err error) *web.Error {
	var e *web.Error
	switch {
	case errors.As(err, &e):
		return e
	case errors.Is(err, errClientGone), errors.Is(err, context.Canceled):
		return &web.Error{Status: web.StatusClientClosed, Detail: "the client left", Cause: err}
	}
	return errUnreachable.Because(err)
}

var errClientGone = errors.New("client closed the request")

// The failures the proxy names itself.
var (
	errUnreachable = &web.Error{Status: http.StatusBadGateway, Title: "Sandbox unreachable", Detail: "Your sandbox did not answer. Try again in a moment."}
	errNotRunning  = &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable",
		Detail: "Your sandbox cannot be started right now: the gateway cannot reach its control plane. Try again shortly."}
	errDeleting         = &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox being deleted", Detail: "This sandbox is being deleted."}
	errHandshakeTimeout = &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox not answering",
		Detail: "The handshake with your sandbox timed out; try again."}
	errUnsealable = &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable",
		Detail: "The gateway cannot read its sandbox credentials (lifecycle seals with a key missing from this edge's HANDSHAKE_KEYS)."}
	errRefusedTwice = &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable",
		Detail: "The gateway could not sign in to your sandbox: DSH kept refusing its auth cookie."}
	errDraining = &web.Error{Status: http.StatusServiceUnavailable, Title: "Edge shutting down",
		Detail: "This gateway replica is shutting down; reconnect."}
	errBusy = &web.Error{Status: http.StatusServiceUnavailable, Title: "Too many requests",
		Detail: "Too many requests to your sandbox are in flight; retry shortly."}
	errStale = &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox unreachable for now",
		Detail: "This gateway has lost touch with its state store for too long to be sure where your sandbox is, so it sends it nothing; try again shortly."}
	errNotYours       = &web.Error{Status: http.StatusForbidden, Title: "Not your sandbox", Detail: "This sandbox belongs to another user."}
	errNotYourPreview = &web.Error{Status: http.StatusForbidden, Title: "Not your preview",
		Detail: "This preview belongs to another user's sandbox, and this gateway shows previews to their owner only (PREVIEW_ACCESS=owner)."}
	errCrossSite = &web.Error{Status: http.StatusForbidden, Title: "Cross-site request refused",
		Detail: "Requests that change something must come from this gateway's own pages."}
	errNoSandbox = &web.Error{Status: http.StatusNotFound, Title: "No such sandbox", Detail: "There is no sandbox at this address."}
)

func handshakeFailed(reason string) error {
	return &web.Error{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable", Detail: "The gateway could not sign in to your sandbox: " + reason}
}

func tooLarge(max int64) error {
	return &web.Error{Status: http.StatusRequestEntityTooLarge, Title: "Upload too large",
		Detail: "Request bodies are limited to " + strconv.FormatInt(max>>20, 10) + " MiB.", Cause: errBodyTooLarge}
}

// responseRefused: DSH's answer broke a rule (a redirect out of the
// gateway), so nothing of it was sent.
func responseRefused(err error) error {
	return &web.Error{Status: http.StatusBadGateway, Title: "Response refused",
		Detail: "Your sandbox's answer was not passed on: " + err.Error() + "."}
}

const titlePaused = "Sandbox paused"

// paused answers a page's background request to a sandbox the gateway
// put to sleep for want of use (Resolver.ready): it stays asleep until
// the user comes back to it.
func paused(why *state.Suspension) *web.Error {
	return &web.Error{Status: http.StatusServiceUnavailable, Title: titlePaused,
		Detail: web.Slept(why) + " Reload the page to wake it."}
}
