// Package smoke is the chart's `helm test`: the checks `setup smoke` runs
// from a pod against an installed aaas. Signup creates an account through
// the front door (or the edge Service), reads its status and deletes it
// again; SignInRedirect checks that an SSO front door sends an anonymous
// browser to its provider instead of to the edge; Blocked checks that a
// pod outside the exposure cannot reach the edge at all, spoofed identity
// header or not (the preflight of the SSO exposure, and of any exposure
// whose NetworkPolicy guards the edge).
package smoke

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"
)

// Options say where the checks connect and as whom.
type Options struct {
	// URL is where requests go (http://aaas-edge:8080, or the front
	// door's https://host:port); Host is the gateway's public host name,
	// sent as Host (and as TLS server name).
	URL, Host string
	// CAFile verifies an https front door; empty skips verification (the
	// check is of the path, not of the certificate).
	CAFile string
	// Invite is the invite code (SIGNUP_INVITE_CODE), empty for open signup.
	Invite string
	// Timeout bounds each request (and, for Blocked, the connection).
	Timeout time.Duration
}

func (o Options) client() (*http.Client, error) {
	// Without a CA the check is of the path, not of the certificate (Options).
	tc := &tls.Config{ServerName: o.Host, InsecureSkipVerify: o.CAFile == ""}
	if o.CAFile != "" {
		pem, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s holds no PEM certificate", o.CAFile)
		}
		tc.RootCAs = pool
	}
	return &http.Client{
		Timeout:   o.Timeout,
		Transport: &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true},
		// Every answer is judged as it comes, redirects included.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}, nil
}

func (o Options) request(ctx context.Context, method, path string, body io.Reader) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(o.URL, "/")+path, body)
	if err != nil {
		return nil, err
	}
	req.Host = o.Host
	// The edge believes the scheme from the private ranges (its
	// TRUSTED_PROXIES), as it does from the ingress controller.
	if strings.HasPrefix(o.URL, "http://") {
		req.Header.Set("X-Forwarded-Proto", "https")
	}
	req.Header.Set("Accept", "application/json")
	return req, nil
}

// Signup signs up a fresh account (smoke-<random>), checks that its status
// answers and deletes it, reporting each step on log. The account is
// deleted even when the status check fails.
func Signup(ctx context.Context, o Options, log io.Writer) error {
	c, err := o.client()
	if err != nil {
		return err
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	user := "smoke-" + hex.EncodeToString(b)
	form := url.Values{"user": {user}, "invite": {o.Invite}}
	req, err := o.request(ctx, http.MethodPost, "/users", strings.NewReader(form.Encode()))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("signup: %w", err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusAccepted {
		return fmt.Errorf("signup of %s answered %d: %s", user, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	var created struct{ Token string }
	if err := json.Unmarshal(body, &created); err != nil || created.Token == "" {
		return fmt.Errorf("signup of %s answered %d without a token", user, resp.StatusCode)
	}
	fmt.Fprintf(log, "ok: signed up %s (%d)\n", user, resp.StatusCode)
	authed := func(method, path string) (int, error) {
		req, err := o.request(ctx, method, path, nil)
		if err != nil {
			return 0, err
		}
		req.Header.Set("Authorization", "Bearer "+created.Token)
		resp, err := c.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	status, statusErr := authed(http.MethodGet, "/_/status")
	if statusErr == nil && status != http.StatusOK {
		statusErr = fmt.Errorf("answered %d", status)
	}
	deleted, err := authed(http.MethodDelete, "/users/"+user)
	if err == nil && deleted != http.StatusNoContent {
		err = fmt.Errorf("answered %d", deleted)
	}
	if err != nil {
		return errors.Join(wrap("status of "+user, statusErr), fmt.Errorf("deleting %s: %w (delete it from the admin view)", user, err))
	}
	fmt.Fprintf(log, "ok: deleted %s\n", user)
	if statusErr != nil {
		return wrap("status of "+user, statusErr)
	}
	fmt.Fprintf(log, "ok: status of %s answered\n", user)
	return nil
}

func wrap(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

// SignInRedirect asks the front door for the start page without a
// session: an SSO front door answers with a redirect to its provider's
// sign-in, never with a page of the gateway's.
func SignInRedirect(ctx context.Context, o Options, log io.Writer) error {
	c, err := o.client()
	if err != nil {
		return err
	}
	req, err := o.request(ctx, http.MethodGet, "/", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "text/html")
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("front door: %w", err)
	}
	resp.Body.Close()
	loc, _ := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode/100 != 3 || loc == nil || loc.Host == "" || loc.Hostname() == o.Host {
		return fmt.Errorf("an anonymous request for / answered %d (Location %q), not a redirect to the sign-in provider", resp.StatusCode, resp.Header.Get("Location"))
	}
	fmt.Fprintf(log, "ok: an anonymous browser is sent to %s to sign in\n", loc.Host)
	return nil
}

// ErrReached is Blocked's failure: the edge answered a pod the exposure
// does not admit.
var ErrReached = errors.New("the edge answered a pod its NetworkPolicy should stop")

// ErrUntested is Blocked's inconclusive result: the connection failed for
// another reason than being blocked (no such Service, no DNS).
var ErrUntested = errors.New("could not test")

// Blocked connects to the edge Service from this pod and sends it a
// spoofed X-Forwarded-User. It returns nil when the connection times out
// or is refused (what an enforcing CNI does to a denied pod), ErrReached
// when any HTTP answer comes back, and ErrUntested otherwise.
func Blocked(ctx context.Context, o Options, log io.Writer) error {
	c, err := o.client()
	if err != nil {
		return err
	}
	req, err := o.request(ctx, http.MethodGet, "/_/status", nil)
	if err != nil {
		return err
	}
	req.Header.Set("X-Forwarded-User", "preflight-spoofed-admin")
	resp, err := c.Do(req)
	if err == nil {
		resp.Body.Close()
		return fmt.Errorf("%w: %s answered %d", ErrReached, o.URL, resp.StatusCode)
	}
	var nerr net.Error
	var dnsErr *net.DNSError
	switch {
	case errors.As(err, &dnsErr):
		return fmt.Errorf("%w: %v", ErrUntested, err)
	case errors.Is(err, syscall.ECONNREFUSED), errors.As(err, &nerr) && nerr.Timeout():
		fmt.Fprintf(log, "ok: %s is unreachable from this pod (%v)\n", o.URL, errors.Unwrap(err))
		return nil
	}
	return fmt.Errorf("%w: %v", ErrUntested, err)
}
