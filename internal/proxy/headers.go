package proxy

import (
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

// headerPolicy decides which browser request headers reach DSH.
type headerPolicy struct {
	// allow, when non-empty, is the only set of headers passed on.
	allow map[string]bool
	// identity is AUTH_PROXY_HEADER, stripped like any other identity header.
	identity string
}

func newHeaderPolicy(allowlist []string, identity string) headerPolicy {
	p := headerPolicy{identity: http.CanonicalHeaderKey(identity)}
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
		name == p.identity,
		strings.HasPrefix(name, "X-Forwarded-"), strings.HasPrefix(name, "X-Auth-Request-"),
		strings.HasPrefix(name, "Sec-Websocket-"):
		return false
	}
	if p.allow != nil {
		return p.allow[name]
	}
	return true
}

// connectionTokens are the extra hop-by-hop headers a message names in its
// Connection header.
func connectionTokens(values []string) map[string]bool {
	out := map[string]bool{}
	for _, v := range values {
		for _, t := range strings.Split(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				out[http.CanonicalHeaderKey(t)] = true
			}
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

// rewriteLocation keeps DSH's redirects inside the user's prefix: a
// root-absolute path, or an absolute URL on the browser's own host or on
// DSH's address, is moved under /u/<user>. Relative and foreign URLs pass.
func rewriteLocation(loc, prefix, host, upstream string) string {
	if loc == "" {
		return loc
	}
	if strings.HasPrefix(loc, "/") && !strings.HasPrefix(loc, "//") {
		if loc == prefix || strings.HasPrefix(loc, prefix+"/") {
			return loc
		}
		return prefix + loc
	}
	u, err := url.Parse(loc)
	if err != nil || !u.IsAbs() || (u.Scheme != "http" && u.Scheme != "https") {
		return loc
	}
	switch {
	case strings.EqualFold(u.Host, host):
		if u.Path == prefix || strings.HasPrefix(u.Path, prefix+"/") {
			return loc
		}
		u.Path = prefix + ensureSlash(u.Path)
		u.RawPath = ""
		return u.String()
	case strings.EqualFold(u.Host, upstream):
		// DSH named its own address: the browser cannot reach it.
		rel := prefix + ensureSlash(u.EscapedPath())
		if u.RawQuery != "" {
			rel += "?" + u.RawQuery
		}
		return rel
	}
	return loc
}

func ensureSlash(p string) string {
	if strings.HasPrefix(p, "/") {
		return p
	}
	return "/" + p
}
