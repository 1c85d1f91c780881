package testenv

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"
	"time"
)

// Client is a browser-like HTTP client for an edge: it keeps cookies,
// does not follow redirects, and sends a same-origin Origin on mutations
// unless told otherwise.
type Client struct {
	t    testing.TB
	Base string
	HTTP *http.Client
}

// Response is a read response.
type Response struct {
	*http.Response
	Body []byte
}

// JSON decodes the body as an object.
func (r *Response) JSON() map[string]any {
	m := map[string]any{}
	_ = json.Unmarshal(r.Body, &m)
	return m
}

// NewClient returns a client for base (http://host:port).
func NewClient(t testing.TB, base string) *Client {
	jar, _ := cookiejar.New(nil)
	c := NoRedirects()
	c.Jar = jar
	return &Client{t: t, Base: base, HTTP: c}
}

// Do sends a request; headers are name, value pairs.
func (c *Client) Do(method, path string, body io.Reader, headers ...string) *Response {
	c.t.Helper()
	req, err := http.NewRequest(method, c.Base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	if method != http.MethodGet && method != http.MethodHead {
		req.Header.Set("Origin", c.Base)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i+1] == "" {
			req.Header.Del(headers[i])
		} else {
			req.Header.Set(headers[i], headers[i+1])
		}
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		// Without the query, which may carry a sign-in code, and without
		// url.Error's copy of the whole URL.
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		p, _, _ := strings.Cut(path, "?")
		c.t.Fatalf("%s %s: %v", method, p, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return &Response{Response: resp, Body: b}
}

// Form posts url-encoded fields (name, value pairs) asking for JSON.
func (c *Client) Form(path string, fields ...string) *Response {
	c.t.Helper()
	v := url.Values{}
	for i := 0; i+1 < len(fields); i += 2 {
		v.Set(fields[i], fields[i+1])
	}
	return c.Do(http.MethodPost, path, strings.NewReader(v.Encode()),
		"Content-Type", "application/x-www-form-urlencoded", "Accept", "application/json")
}

// Signup creates user through the JSON API and returns the bearer token;
// the client keeps the session cookie.
func (c *Client) Signup(user, invite string) string {
	c.t.Helper()
	r := c.Form("/users", "user", user, "invite", invite)
	if r.StatusCode != http.StatusCreated && r.StatusCode != http.StatusAccepted {
		c.t.Fatalf("signup %s: %d %s", user, r.StatusCode, r.Body)
	}
	tok, _ := r.JSON()["token"].(string)
	if tok == "" {
		c.t.Fatalf("signup %s: no token in %s", user, r.Body)
	}
	return tok
}

// Cookie returns the named cookie the client holds for its base URL.
func (c *Client) Cookie(name string) *http.Cookie {
	u, _ := url.Parse(c.Base)
	for _, ck := range c.HTTP.Jar.Cookies(u) {
		if ck.Name == name {
			return ck
		}
	}
	return nil
}

// From makes the client connect from the loopback address ip (127.0.0.2,
// 127.0.0.3, …: Linux routes all of 127/8 to lo), so one test can be many
// clients to an edge that keys them by address.
func (c *Client) From(ip string) *Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 10 * time.Second}
	c.HTTP.Transport = &http.Transport{DialContext: d.DialContext, MaxIdleConnsPerHost: 64}
	return c
}

// WithTimeout sets the client timeout.
func (c *Client) WithTimeout(d time.Duration) *Client { c.HTTP.Timeout = d; return c }

// At is a client with the same cookies and connections for another base
// URL (an edge's own address instead of the front's).
func (c *Client) At(base string) *Client { return &Client{t: c.t, Base: base, HTTP: c.HTTP} }
