package proxy

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// statusClientClosed is nginx's 499: the client left before the response.
const statusClientClosed = 499

// proxyError is every way a proxied request can fail, with what the
// browser is told: the status, a title and a readable detail. Err is the
// cause, for the log only (addresses, transport errors); the browser gets
// the request id to quote instead.
type proxyError struct {
	Status int
	Title  string
	Detail string
	Err    error
}

func (e *proxyError) Error() string {
	if e.Err != nil {
		return e.Detail + ": " + e.Err.Error()
	}
	return e.Detail
}

func (e *proxyError) Unwrap() error { return e.Err }

// noControlPlane is errNotRunning caused by err (a command that could
// not be published), which the log gets.
func noControlPlane(err error) *proxyError {
	pe := *errNotRunning
	pe.Err = err
	return &pe
}

// asProxyError maps any error of the request to the one the browser
// gets: a proxyError as it is, a context ended by the client's departure
// as 499, anything else (a cause the browser must not see) as 502.
func asProxyError(err error) *proxyError {
	var pe *proxyError
	switch {
	case errors.As(err, &pe):
		return pe
	case errors.Is(err, errClientGone), errors.Is(err, context.Canceled):
		return &proxyError{Status: statusClientClosed, Title: "Client closed request", Detail: "the client left", Err: err}
	}
	return &proxyError{Status: http.StatusBadGateway, Title: "Sandbox unreachable", Detail: "Your sandbox did not answer. Try again in a moment.", Err: err}
}

var errClientGone = errors.New("client closed the request")

// The failures the proxy names itself.
var (
	errNotRunning = &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable",
		Detail: "Your sandbox cannot be started right now: the gateway cannot reach its control plane. Try again shortly."}
	errDeleting         = &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox being deleted", Detail: "This sandbox is being deleted."}
	errHandshakeTimeout = &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox not answering",
		Detail: "The handshake with your sandbox timed out; try again."}
	errUnsealable = &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable",
		Detail: "The gateway cannot read its sandbox credentials (lifecycle seals with a key missing from this edge's HANDSHAKE_KEYS)."}
	errRefusedTwice = &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable",
		Detail: "The gateway could not sign in to your sandbox: DSH kept refusing its auth cookie."}
	errDraining = &proxyError{Status: http.StatusServiceUnavailable, Title: "Edge shutting down",
		Detail: "This gateway replica is shutting down; reconnect."}
	errBusy = &proxyError{Status: http.StatusServiceUnavailable, Title: "Too many requests",
		Detail: "Too many requests to your sandbox are in flight; retry shortly."}
	errStale = &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox unreachable for now",
		Detail: "This gateway has lost touch with its state store for too long to be sure where your sandbox is, so it sends it nothing; try again shortly."}
	errNotYours       = &proxyError{Status: http.StatusForbidden, Title: "Not your sandbox", Detail: "This sandbox belongs to another user."}
	errNotYourPreview = &proxyError{Status: http.StatusForbidden, Title: "Not your preview",
		Detail: "This preview belongs to another user's sandbox, and this gateway shows previews to their owner only (PREVIEW_ACCESS=owner)."}
	errCrossSite = &proxyError{Status: http.StatusForbidden, Title: "Cross-site request refused",
		Detail: "Requests that change something must come from this gateway's own pages."}
	errNoSandbox = &proxyError{Status: http.StatusNotFound, Title: "No such sandbox", Detail: "There is no sandbox at this address."}
)

func handshakeFailed(reason string) error {
	return &proxyError{Status: http.StatusServiceUnavailable, Title: "Sandbox unavailable", Detail: "The gateway could not sign in to your sandbox: " + reason}
}

func tooLarge(max int64) error {
	return &proxyError{Status: http.StatusRequestEntityTooLarge, Title: "Upload too large",
		Detail: "Request bodies are limited to " + strconv.FormatInt(max>>20, 10) + " MiB.", Err: errBodyTooLarge}
}

// authFailed is a refused authentication: 401 unless the authenticator's
// error names its status (HTTPStatus() int), as SSO refusals do (403).
func authFailed(err error) *proxyError {
	status := http.StatusUnauthorized
	var s interface{ HTTPStatus() int }
	if errors.As(err, &s) {
		status = s.HTTPStatus()
	}
	title := "Please sign in"
	switch status {
	case http.StatusUnauthorized:
	case http.StatusServiceUnavailable:
		title = "Try again shortly"
	default:
		title = "Not allowed"
	}
	return &proxyError{Status: status, Title: title, Detail: err.Error()}
}

// responseRefused: DSH's answer broke a rule (a redirect out of the
// gateway), so nothing of it was sent.
func responseRefused(err error) error {
	return &proxyError{Status: http.StatusBadGateway, Title: "Response refused",
		Detail: "Your sandbox's answer was not passed on: " + err.Error() + "."}
}

const titlePaused = "Sandbox paused"

// paused answers a page's background request to a sandbox the gateway
// put to sleep for want of use (Resolver.ready): it stays asleep until
// the user comes back to it.
func paused(why *state.Suspension) *proxyError {
	return &proxyError{Status: http.StatusServiceUnavailable, Title: titlePaused,
		Detail: web.Slept(why) + " Reload the page to wake it."}
}
