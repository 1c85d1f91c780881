package web

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
)

// StatusClientClosed is nginx's 499: the client left before the answer.
const StatusClientClosed = 499

// Error is every failure the edge answers itself, whichever route: the
// status, a title and a readable detail for the client, when to retry,
// and the cause, which only the log gets (addresses, transport and bus
// errors); the client gets the request id to quote instead.
type Error struct {
	Status int
	// Title is the page's heading; "" is the status's usual one (Title).
	Title  string
	Detail string
	// RetryAfter is sent as Retry-After; 0 on a 503 means 2 s (what the
	// bus or the cluster could not do now is worth retrying shortly).
	RetryAfter time.Duration
	Cause      error
}

func (e *Error) Error() string {
	if e.Cause != nil {
		return e.Detail + ": " + e.Cause.Error()
	}
	return e.Detail
}

func (e *Error) Unwrap() error { return e.Cause }

// Because is e with cause: the same answer, and the cause in the log.
func (e *Error) Because(cause error) *Error {
	c := *e
	c.Cause = cause
	return &c
}

// Refuse is an Error of status saying detail.
func Refuse(status int, detail string) *Error { return &Error{Status: status, Detail: detail} }

// Unavailable is a 503 for a failure to reach what the edge depends on
// (the bus, the cluster); the cause goes to the log only.
func Unavailable(cause error) *Error {
	if errors.Is(cause, kv.ErrFull) {
		// Asking again soon changes nothing: an operator grows the store
		// (AaasNATSStreamNearlyFull warned at 80 %).
		return &Error{Status: http.StatusServiceUnavailable, Detail: "the gateway's store for this is full, so nothing new can be saved; its operator has been alerted", Cause: cause}
	}
	return &Error{Status: http.StatusServiceUnavailable, Detail: "the gateway cannot reach its message bus; try again shortly", Cause: cause}
}

// Title is the usual heading of an answer of status.
func Title(status int) string {
	switch status {
	case http.StatusUnauthorized:
		return "Please sign in"
	case http.StatusForbidden:
		return "Not allowed"
	case http.StatusNotFound:
		return "Not found"
	case http.StatusTooManyRequests:
		return "Too many attempts"
	case http.StatusServiceUnavailable:
		return "Try again shortly"
	case StatusClientClosed:
		return "Client closed request"
	}
	if status >= 500 {
		return "Something went wrong"
	}
	return "Not possible"
}

// AsError maps any error of a request to the Error the client gets: an
// *Error as it is, a *fiber.Error (the framework's own refusals) by its
// code and message, a context ended by the client's departure as 499,
// anything else (a cause the client must not see) as 500.
func AsError(err error) *Error {
	var e *Error
	var fe *fiber.Error
	switch {
	case errors.As(err, &e):
		return e
	case errors.As(err, &fe):
		return &Error{Status: fe.Code, Detail: fe.Message}
	case errors.Is(err, context.Canceled):
		return &Error{Status: StatusClientClosed, Detail: "the client left", Cause: err}
	}
	return &Error{Status: http.StatusInternalServerError, Detail: "The gateway could not answer.", Cause: err}
}

// Fail is the one error path of the edge: err becomes the status, the
// Retry-After and the page or problem document the client gets (by
// WantsHTML); its cause is logged once, with the request id the client
// is shown on a 5xx. A client that left gets nothing but its status.
func Fail(c *fiber.Ctx, err error) error {
	e := AsError(err)
	rid := httpguard.RequestID(c)
	log := httpguard.Logger(c)
	switch {
	case e.Status == StatusClientClosed:
		log.Info("client closed request", "request_id", rid, "method", c.Method())
		c.Status(StatusClientClosed)
		return nil
	case e.Cause != nil:
		level := slog.LevelInfo
		if e.Status >= 500 {
			level = slog.LevelWarn
		}
		log.Log(c.UserContext(), level, "request failed", "request_id", rid, "status", e.Status, "err", e.Cause)
	}
	SetRetryAfter(c, e)
	title, detail := e.Title, e.Detail
	if title == "" {
		title = Title(e.Status)
	}
	if e.Status >= 500 {
		detail += " (request " + rid + ")"
	}
	return WriteProblem(c, Problem{Status: e.Status, Title: title, Detail: detail, SignIn: e.Status == http.StatusUnauthorized})
}

// SetRetryAfter says when to retry e, unless the answer says so already.
func SetRetryAfter(c *fiber.Ctx, e *Error) {
	retry := e.RetryAfter
	if retry == 0 && e.Status == http.StatusServiceUnavailable {
		retry = 2 * time.Second
	}
	if retry > 0 && len(c.Response().Header.Peek(fiber.HeaderRetryAfter)) == 0 {
		c.Set(fiber.HeaderRetryAfter, strconv.Itoa(int((retry+time.Second-1)/time.Second)))
	}
}
