package proxy

import (
	"bytes"
	"errors"
	"net/http"
	"net/url"
	"strings"
)

// hopByHop are the headers that describe one connection, not the message
// (RFC 9110 §7.6.1), plus the legacy ones every proxy strips.
var hopByHop = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// headerPolicy decides which browser request headers reach DSH and which
// of DSH's response headers reach the browser.
type headerPolicy struct {
	// allow, when non-empty, is the only set of headers passed on.
	allow map[string]bool
	// identity are the SSO headers, stripped like any other identity header.
	identity map[string]bool
}

func newHeaderPolicy(allowlist, identity []string) headerPolicy {
	p := headerPolicy{identity: map[string]bool{}}
	for _, h := range identity {
		if h != "" {
			p.identity[http.CanonicalHeaderKey(h)] = true
		}
	}
	if len(allowlist) > 0 {
		p.allow = map[string]bool{}
		for _, h := range allowlist {
			p.allow[http.CanonicalHeaderKey(h)] = true
		}
	}
	return p
}

// pass reports whether a browser request header may reach DSH. Whatever
// identifies or authenticates the browser to us, or claims to say who the
// client is, is ours to set and never forwarded.
func (p headerPolicy) pass(name string) bool {
	switch {
	case name == "Cookie", name == "Authorization", name == "Host", name == "Forwarded",
		name == "Content-Length", name == "Expect", name == "X-Real-Ip",
		name == "True-Client-Ip", name == "X-Client-Ip", name == "Cf-Connecting-Ip", name == "X-Cluster-Client-Ip",
		name == "X-Original-Url", name == "X-Rewrite-Url", name == "X-Original-Host",
		p.identity[name],
		strings.HasPrefix(name, "X-Forwarded-"), strings.HasPrefix(name, "X-Auth-Request-"),
		strings.HasPrefix(name, "Sec-Websocket-"):
		return false
	case strings.ContainsRune(name, '_'):
		// Some servers read X_Forwarded_User as X-Forwarded-User; no
		// browser sends underscores, so nothing is lost.
		return false
	}
	if p.allow != nil {
		return p.allow[name]
	}
	return true
}

// connectionTokens are the extra hop-by-hop headers a message names in its
// Connection headers (all of them count); nil when they name none beyond
// keep-alive and close, as nearly all do.
func connectionTokens(values [][]byte) map[string]bool {
	var out map[string]bool
	for _, v := range values {
		for t := range strings.SplitSeq(string(v), ",") {
			t = strings.TrimSpace(t)
			if t == "" || strings.EqualFold(t, "keep-alive") || strings.EqualFold(t, "close") {
				continue
			}
			if out == nil {
				out = map[string]bool{}
			}
			out[http.CanonicalHeaderKey(t)] = true
		}
	}
	return out
}

func isHopByHop(name string, extra map[string]bool) bool {
	for _, h := range hopByHop {
		if name == h {
			return true
		}
	}
	return extra[name]
}

// originWide are response headers that act on the whole origin, not on
// the response: a tenant must not set them for the gateway's host (a
// root-scoped service worker, wiped storage of every user's pages, HSTS or
// alternative services for the host, reporting endpoints). Set-Cookie goes
// too: DSH's cookies are the gateway's secret, and the browser holds only
// ours.
var originWide = map[string]bool{
	"Set-Cookie": true, "Set-Cookie2": true, "Service-Worker-Allowed": true, "Clear-Site-Data": true,
	"Strict-Transport-Security": true, "Alt-Svc": true, "Public-Key-Pins": true, "Public-Key-Pins-Report-Only": true,
	"Report-To": true, "Reporting-Endpoints": true, "Nel": true, "Origin-Agent-Cluster": true,
	"Content-Length": true, // fasthttp frames the body itself
}

// errForeignRedirect: DSH sent a redirect the gateway will not follow.
var errForeignRedirect = errors.New("it redirects to a protocol-relative URL, which the gateway does not follow")

// response passes DSH's response headers (visit calls its argument for
// each) to add: hop-by-hop headers (including every name any Connection
// header lists), origin-wide and X-Accel-* (instructions to an nginx in
// front) headers are dropped, Location and Refresh are kept inside the
// user's prefix. Nothing is added unless all of it is acceptable. It runs
// on every response, so it works on the bytes as fasthttp parsed them.
func (p headerPolicy) response(visit func(func(k, v []byte)), loc location, add func(k, v []byte)) error {
	var conn [][]byte
	var location, refresh []byte
	err := error(nil)
	visit(func(k, v []byte) {
		switch string(k) {
		case "Connection":
			conn = append(conn, v)
		case "Location", "Refresh":
			// Rewritten here, once: a (malformed) second one is sent
			// with the first one's value.
			r, ok := "", true
			if string(k) == "Location" && location == nil {
				r, ok = loc.rewrite(string(v))
				location = []byte(r)
			} else if string(k) == "Refresh" && refresh == nil {
				r, ok = loc.refresh(string(v))
				refresh = []byte(r)
			}
			if !ok {
				err = errForeignRedirect
			}
		}
	})
	if err != nil {
		return err
	}
	extra := connectionTokens(conn)
	visit(func(k, v []byte) {
		name := string(k)
		switch {
		case dropped(k, extra):
		case name == "Location":
			add(k, location)
		case name == "Refresh":
			add(k, refresh)
		default:
			add(k, v)
		}
	})
	return nil
}

// dropped: a response header that never reaches the browser.
func dropped(k []byte, extra map[string]bool) bool {
	if originWide[string(k)] || extra[string(k)] || bytes.HasPrefix(k, accelPrefix) {
		return true
	}
	for _, h := range hopByHop {
		if string(k) == h {
			return true
		}
	}
	return false
}

var accelPrefix = []byte("X-Accel-")

// location is where a user's DSH may send the browser: paths under
// prefix on the gateway's host; DSH's own address (which browsers cannot
// reach) is moved under the prefix.
type location struct {
	prefix, host, upstream string
}

// rewrite keeps a redirect inside the user's prefix: a root-absolute path,
// or an absolute URL on the gateway's host or on DSH's address, is moved
// under /u/<user>. Relative and foreign absolute URLs pass. A
// protocol-relative URL ("//host/…", or with backslashes, which browsers
// read as slashes) is refused: DSH has no business naming hosts that way.
func (l location) rewrite(loc string) (string, bool) {
	if loc == "" {
		return loc, true
	}
	if len(loc) > 1 && (loc[0] == '/' || loc[0] == '\\') && (loc[1] == '/' || loc[1] == '\\') {
		return "", false
	}
	if strings.HasPrefix(loc, "/") {
		if loc == l.prefix || strings.HasPrefix(loc, l.prefix+"/") {
			return loc, true
		}
		return l.prefix + loc, true
	}
	u, err := url.Parse(loc)
	if err != nil || !u.IsAbs() || (u.Scheme != "http" && u.Scheme != "https") {
		return loc, true
	}
	switch {
	case strings.EqualFold(u.Host, l.host):
		if u.Path == l.prefix || strings.HasPrefix(u.Path, l.prefix+"/") {
			return loc, true
		}
		u.Path = l.prefix + ensureSlash(u.Path)
		u.RawPath = ""
		return u.String(), true
	case strings.EqualFold(u.Host, l.upstream):
		// DSH named its own address: the browser cannot reach it.
		rel := l.prefix + ensureSlash(u.EscapedPath())
		if u.RawQuery != "" {
			rel += "?" + u.RawQuery
		}
		return rel, true
	}
	return loc, true
}

// refresh rewrites the URL of a Refresh header ("5; url=/next") the way
// rewrite does a Location.
func (l location) refresh(v string) (string, bool) {
	i := strings.IndexAny(v, ";,")
	if i < 0 {
		return v, true
	}
	delay, target := v[:i], strings.TrimSpace(v[i+1:])
	if len(target) >= 4 && strings.EqualFold(target[:4], "url=") {
		target = strings.TrimSpace(target[4:])
	}
	target = strings.Trim(target, `"'`)
	r, ok := l.rewrite(target)
	if !ok {
		return "", false
	}
	return delay + "; url=" + r, true
}

func ensureSlash(p string) string {
	if strings.HasPrefix(p, "/") {
		return p
	}
	return "/" + p
}
