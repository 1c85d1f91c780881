// Package handshake performs DSH Web's launch-token handshake on behalf of
// the browser: it finds the launch tokens in the pod's log, trades the
// newest that DSH accepts for its auth cookie, and seals that cookie so that
// reading NATS is not enough to impersonate a user. Neither a token nor the
// cookie appears in any error this package returns. The log is the
// tenant's to write: a line that only looks like the token must cost a
// retry at most, never the handshake.
package handshake

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"
)

// ErrNoToken means the log holds no launch-token line: DSH rotated it out
// of the tail, printed it in a new format, or has not started.
var ErrNoToken = errors.New("missing launch token")

var (
	ansi      = regexp.MustCompile(`\x1b\[[0-9;?]*[ -/]*[@-~]`)
	tokenLine = regexp.MustCompile(`dsh web: https?://[^\s/]+/\?token=([A-Za-z0-9_-]{16,})(?:\s|$)`)
)

// MaxCandidates bounds how many token lines are tried, newest first: a
// tenant printing fake lines can make a handshake try that many, no more.
const MaxCandidates = 8

// TokensFromLog returns the tokens of the `dsh web: http://…/?token=…`
// lines, newest first and without repeats, at most MaxCandidates, ignoring
// ANSI colour codes and any other output around them.
func TokensFromLog(log []byte) ([]string, error) {
	lines := strings.Split(ansi.ReplaceAllString(string(log), ""), "\n")
	var tokens []string
	for i := len(lines) - 1; i >= 0 && len(tokens) < MaxCandidates; i-- {
		if m := tokenLine.FindStringSubmatch(strings.TrimRight(lines[i], "\r")); m != nil && !slices.Contains(tokens, m[1]) {
			tokens = append(tokens, m[1])
		}
	}
	if len(tokens) == 0 {
		return nil, ErrNoToken
	}
	return tokens, nil
}

// TokenFromLog returns the newest token line's token.
func TokenFromLog(log []byte) (string, error) {
	tokens, err := TokensFromLog(log)
	if err != nil {
		return "", err
	}
	return tokens[0], nil
}

// Request describes one handshake: where DSH listens and what the browser's
// request looked like, since DSH checks the Host and keys nothing else.
type Request struct {
	// Address is DSH's host:port (pod IP or Service name).
	Address string
	Token   string
	// Host is the browser's Host header, which DSH must trust.
	Host   string
	Proto  string
	Prefix string
}

// Error is a handshake failure with a reason fit for users and logs.
type Error struct {
	// Status is DSH's HTTP status, 0 when it could not be reached.
	Status int
	Reason string
}

func (e *Error) Error() string { return e.Reason }

// Exchange sends GET /?token=… to DSH and returns its auth cookie as
// "name=value". client must not follow redirects (Client does not).
func Exchange(ctx context.Context, client *http.Client, r Request) (string, error) {
	u := "http://" + r.Address + "/?token=" + url.QueryEscape(r.Token)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return "", &Error{Reason: "handshake request could not be built"}
	}
	req.Host = r.Host
	if r.Proto != "" {
		req.Header.Set("X-Forwarded-Proto", r.Proto)
	}
	req.Header.Set("X-Forwarded-Host", r.Host)
	if r.Prefix != "" {
		req.Header.Set("X-Forwarded-Prefix", r.Prefix)
	}
	resp, err := client.Do(req)
	if err != nil {
		// *url.Error carries the URL, and with it the token: keep only the cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return "", &Error{Reason: fmt.Sprintf("DSH at %s unreachable: %v", r.Address, err)}
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusUnauthorized:
		return "", &Error{Status: resp.StatusCode, Reason: "DSH rejected the launch token (401)"}
	case resp.StatusCode == http.StatusForbidden:
		return "", &Error{Status: resp.StatusCode, Reason: fmt.Sprintf("DSH does not trust host %q (403): add it to DSH_TRUSTED_HOSTS", r.Host)}
	case resp.StatusCode >= 400:
		return "", &Error{Status: resp.StatusCode, Reason: fmt.Sprintf("DSH answered the handshake with %d", resp.StatusCode)}
	}
	for _, c := range resp.Cookies() {
		if strings.HasPrefix(c.Name, "dsh-auth-") && c.Value != "" {
			if n := len(c.Name) + 1 + len(c.Value); n > MaxCookieLen {
				return "", &Error{Status: resp.StatusCode, Reason: fmt.Sprintf("DSH set a dsh-auth cookie of %d bytes; the gateway keeps at most %d", n, MaxCookieLen)}
			}
			return c.Name + "=" + c.Value, nil
		}
	}
	return "", &Error{Status: resp.StatusCode, Reason: fmt.Sprintf("DSH answered the handshake with %d but set no dsh-auth cookie", resp.StatusCode)}
}

// MaxCookieLen bounds the auth cookie a handshake keeps (name=value).
// DSH's is a short token; the pod answering is the tenant's, and what it
// sets is sealed into the shared handshakes bucket, whose cap is sized
// per record (state's capacities).
const MaxCookieLen = 512

// Timeout bounds one exchange: DSH answers a handshake at once, and a pod
// that accepts the connection and stays silent must not hold a worker.
const Timeout = 10 * time.Second

// Client is an HTTP client suited to Exchange: it does not follow
// redirects (the 303 is the answer), keeps no cookie jar, and gives up
// after Timeout.
func Client() *http.Client {
	return &http.Client{Timeout: Timeout, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}
