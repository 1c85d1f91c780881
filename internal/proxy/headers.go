package proxy

import (
	"bytes"
	"errors"
	"iter"
	"net/http"
	"net/netip"
	"strings"
	"sync"

	"github.com/aaas-project/aaas/internal/ident"
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
var errForeignRedirect = errors.New("it redirects to a protocol-relative or ambiguous URL, which the gateway does not follow")

// response passes DSH's response headers (visit calls its argument for
// each) to add: hop-by-hop headers (including every name any Connection
// header lists), origin-wide and X-Accel-* (instructions to an nginx in
// front) headers are dropped, Location and Refresh are kept inside the
// user's prefix, and the answer is made private to the browser that asked
// (Cache-Control private, Vary: Cookie): it was fetched with the user's
// credentials, and a shared cache in front must never hand it to anyone
// else, whatever DSH says. Nothing is added unless all of it is
// acceptable. It runs on every response, so it works on the bytes as
// fasthttp parsed them.
func (p headerPolicy) response(fields iter.Seq2[[]byte, []byte], loc location, dst headerAdder) error {
	f := responseFilters.Get().(*responseFilter)
	defer f.release()
	f.loc = loc
	fields(f.scan)
	if f.err != nil {
		return f.err
	}
	f.extra, f.dst = connectionTokens(f.conn), dst
	fields(f.emit)
	dst.AddBytesKV(cacheControlName, privateCacheControl(f.cache))
	if !f.varies {
		dst.AddBytesKV(varyName, cookieName)
	}
	return nil
}

// headerAdder is where response adds the headers that pass: the
// browser's answer (*fasthttp.ResponseHeader), or a test's record.
type headerAdder interface{ AddBytesKV(k, v []byte) }

// responseFilter is response's state for one answer, pooled with its two
// passes bound once (scan and emit as method values), so the filter
// allocates nothing per answer: a range-over-func loop here would move
// its state to the heap on every call.
type responseFilter struct {
	loc               location
	conn, cache       [][]byte
	location, refresh []byte
	varies            bool
	err               error
	extra             map[string]bool
	dst               headerAdder
	scan, emit        func(k, v []byte) bool
}

var responseFilters = sync.Pool{New: func() any {
	f := &responseFilter{}
	f.scan, f.emit = f.scanField, f.emitField
	return f
}}

// release forgets the answer (its bytes belong to the upstream's buffers)
// and returns f to the pool.
func (f *responseFilter) release() {
	clear(f.conn)
	clear(f.cache)
	f.loc, f.conn, f.cache, f.location, f.refresh = location{}, f.conn[:0], f.cache[:0], nil, nil
	f.varies, f.err, f.extra, f.dst = false, nil, nil, nil
	responseFilters.Put(f)
}

// scanField is the first pass: what the second needs to know of all the
// fields (Connection's names, Cache-Control, Vary) and the rewritten
// Location and Refresh; a redirect out of the user's prefix stops it.
func (f *responseFilter) scanField(k, v []byte) bool {
	switch string(k) {
	case "Connection":
		f.conn = append(f.conn, v)
	case "Cache-Control":
		f.cache = append(f.cache, v)
	case "Vary":
		f.varies = f.varies || variesOnCookie(v)
	case "Location", "Refresh":
		// Rewritten here, once: a (malformed) second one is sent with
		// the first one's value.
		if f.loc.prefix == "" && !f.loc.local {
			f.loc.prefix = "/u/" + f.loc.user
		}
		r, ok := "", true
		if string(k) == "Location" && f.location == nil {
			r, ok = f.loc.rewrite(string(v))
			f.location = []byte(r)
		} else if string(k) == "Refresh" && f.refresh == nil {
			r, ok = f.loc.refresh(string(v))
			f.refresh = []byte(r)
		}
		if !ok {
			f.err = errForeignRedirect
			return false
		}
	}
	return true
}

// emitField is the second pass: each field that may reach the browser.
func (f *responseFilter) emitField(k, v []byte) bool {
	switch {
	case dropped(k, f.extra), string(k) == "Cache-Control":
	case string(k) == "Location":
		f.dst.AddBytesKV(k, f.location)
	case string(k) == "Refresh":
		if len(f.refresh) > 0 {
			f.dst.AddBytesKV(k, f.refresh)
		}
	default:
		f.dst.AddBytesKV(k, v)
	}
	return true
}

var (
	privateOnly      = []byte("private")
	cacheControlName = []byte("Cache-Control")
	varyName         = []byte("Vary")
	cookieName       = []byte("Cookie")
)

// privateCacheControl is DSH's Cache-Control directives (all its headers'
// values) made private: public and s-maxage, which let a shared cache
// keep the answer, are dropped; private with field names (private only
// for those fields) becomes plain private; private is added unless the
// answer is no-store already. The rest (max-age, no-cache, …) stands, for
// the browser's own cache.
func privateCacheControl(values [][]byte) []byte {
	if len(values) == 0 {
		return privateOnly // the common case, without allocating
	}
	out := make([]byte, 0, 64)
	private := false
	for _, v := range values {
		for _, d := range directives(v) {
			name, _, hasValue := bytes.Cut(d, []byte("="))
			name = bytes.TrimSpace(name)
			switch {
			case bytes.EqualFold(name, []byte("public")), bytes.EqualFold(name, []byte("s-maxage")):
				continue
			case bytes.EqualFold(name, []byte("private")):
				if private {
					continue
				}
				d, private = []byte("private"), true
			case bytes.EqualFold(name, []byte("no-store")) && !hasValue:
				private = true
			}
			if len(out) > 0 {
				out = append(out, ", "...)
			}
			out = append(out, d...)
		}
	}
	if !private {
		if len(out) == 0 {
			return append(out, "private"...)
		}
		out = append([]byte("private, "), out...)
	}
	return out
}

// directives splits a Cache-Control value at the commas outside quoted
// strings, trimmed, empty ones dropped.
func directives(v []byte) [][]byte {
	var out [][]byte
	quoted, start := false, 0
	for i := 0; i <= len(v); i++ {
		switch {
		case i < len(v) && v[i] == '"':
			quoted = !quoted
		case i == len(v) || v[i] == ',' && !quoted:
			if d := bytes.TrimSpace(v[start:i]); len(d) > 0 {
				out = append(out, d)
			}
			start = i + 1
		}
	}
	return out
}

// variesOnCookie: a Vary value that already names Cookie, or * (varies on
// everything).
func variesOnCookie(v []byte) bool {
	for t := range bytes.SplitSeq(v, []byte(",")) {
		t = bytes.TrimSpace(t)
		if bytes.Equal(t, []byte("*")) || bytes.EqualFold(t, cookieName) {
			return true
		}
	}
	return false
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
// reach) is moved under the prefix. scheme and base are the request the
// answer is for, as the browser made it (http or https) and as DSH got it
// (the path after the prefix), for relative redirects. On a sandbox
// origin the prefix is "" (the whole origin is the sandbox's) and local
// is set: DSH was sent Host localhost:<port>, so a URL on localhost (any
// port) is DSH's own too and stays on the origin.
type location struct {
	// prefix is /u/<user> in path mode, "" on a sandbox origin (local);
	// left empty, response makes it from user when an answer redirects.
	prefix, user, host, upstream string
	scheme, base                 string
	local                        bool
}

// rewrite keeps a redirect inside the user's prefix, judged as a browser
// will read it (WHATWG URL): tabs and newlines dropped, backslashes read as
// slashes in http(s) URLs, dot segments, percent-encoded or not and in any
// case, resolved. A path outside the prefix, root-absolute or relative and
// climbing above it, is taken as DSH's own (DSH thinks it serves at /) and
// moved under /u/<user>, clean; so is an absolute URL on the gateway's
// host or on DSH's address. Relative references that need none of that
// pass as they are, and so do URLs on other hosts. Refused (false): a
// protocol-relative URL ("//host/…", slashes either way), which DSH has no
// business using, and an absolute URL whose host a browser might read as
// the gateway's in a spelling this check does not (percent-encoded,
// non-ASCII, a number standing for an IPv4 address, a port with leading
// zeros).
func (l location) rewrite(raw string) (string, bool) {
	v := cleanURL(raw)
	if v == "" {
		return raw, true
	}
	scheme, rest, ok := splitScheme(v)
	switch {
	case !ok:
		return l.relative(raw, v)
	case scheme != "http" && scheme != "https":
		return raw, true // mailto: and the like go nowhere of ours
	}
	n := leadingSlashes(rest)
	if scheme == l.scheme && n < 2 {
		// "http:next" or "http:/next" on an http page is a relative
		// reference to browsers.
		return l.relative(raw, rest)
	}
	rest = rest[n:]
	end := strings.IndexAny(rest, `/\?#`)
	if end < 0 {
		end = len(rest)
	}
	authority, tail := rest[:end], rest[end:]
	if at := strings.LastIndexByte(authority, '@'); at >= 0 {
		authority = authority[at+1:]
	}
	host, ok := browserHost(authority, scheme)
	if !ok {
		return "", false
	}
	path, suffix := splitSuffix(tail)
	path = removeDots(ensureSlash(strings.ReplaceAll(path, `\`, "/")))
	switch host {
	case l.host:
		if !l.inPrefix(path) {
			path = l.prefix + path
		}
		return scheme + "://" + host + path + suffix, true
	case canonicalUpstream(l.upstream):
		// DSH named its own address: the browser cannot reach it.
		return l.prefix + path + suffix, true
	}
	if l.local && (host == "localhost" || strings.HasPrefix(host, "localhost:")) {
		return path + suffix, true
	}
	return raw, true
}

// relative places a reference without a scheme (v, cleaned from raw).
func (l location) relative(raw, v string) (string, bool) {
	n := leadingSlashes(v)
	if n >= 2 {
		return "", false // protocol-relative
	}
	path, suffix := splitSuffix(v)
	if path == "" {
		return raw, true // "?query" or "#fragment": the same page
	}
	clean := !strings.ContainsRune(path, '\\') && !hasDotSegment(path) && raw == v
	path = strings.ReplaceAll(path, `\`, "/")
	if n == 1 {
		p := removeDots(path)
		if l.inPrefix(p) {
			return p + suffix, true
		}
		return l.prefix + p + suffix, true
	}
	// As the browser resolves it, from the page it asked for.
	base := removeDots(l.prefix + ensureSlash(strings.ReplaceAll(l.base, `\`, "/")))
	if p := removeDots(dir(base) + path); l.inPrefix(p) {
		if clean {
			return raw, true
		}
		return p + suffix, true
	}
	// It climbs above the prefix: DSH meant it from its own root.
	return l.prefix + removeDots(dir(ensureSlash(strings.ReplaceAll(l.base, `\`, "/")))+path) + suffix, true
}

func (l location) inPrefix(p string) bool {
	return p == l.prefix || strings.HasPrefix(p, l.prefix+"/")
}

// cleanURL is what a browser parses of a URL: leading and trailing C0
// controls and spaces trimmed, every tab and newline removed.
func cleanURL(s string) string {
	s = strings.TrimFunc(s, func(r rune) bool { return r <= ' ' })
	if strings.ContainsAny(s, "\t\n\r") {
		s = strings.Map(func(r rune) rune {
			if r == '\t' || r == '\n' || r == '\r' {
				return -1
			}
			return r
		}, s)
	}
	return s
}

// splitScheme takes a URL's scheme off (lowercased) as browsers find one:
// a letter, then letters, digits, +, - or ., then a colon.
func splitScheme(s string) (scheme, rest string, ok bool) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
		case i > 0 && (c >= '0' && c <= '9' || c == '+' || c == '-' || c == '.'):
		case i > 0 && c == ':':
			return strings.ToLower(s[:i]), s[i+1:], true
		default:
			return "", s, false
		}
	}
	return "", s, false
}

// leadingSlashes counts the slashes and backslashes s starts with.
func leadingSlashes(s string) int {
	n := 0
	for n < len(s) && (s[n] == '/' || s[n] == '\\') {
		n++
	}
	return n
}

// splitSuffix splits a reference at its query or fragment.
func splitSuffix(s string) (path, suffix string) {
	if i := strings.IndexAny(s, "?#"); i >= 0 {
		return s[:i], s[i:]
	}
	return s, ""
}

// dir is a path up to and including its last slash.
func dir(p string) string { return p[:strings.LastIndexByte(p, '/')+1] }

func isSingleDot(s string) bool { return s == "." || strings.EqualFold(s, "%2e") }

func isDoubleDot(s string) bool {
	switch len(s) {
	case 2:
		return s == ".."
	case 4:
		return strings.EqualFold(s, ".%2e") || strings.EqualFold(s, "%2e.")
	case 6:
		return strings.EqualFold(s, "%2e%2e")
	}
	return false
}

// hasDotSegment: a path with a segment browsers resolve away.
func hasDotSegment(p string) bool {
	for seg := range strings.SplitSeq(strings.ReplaceAll(p, `\`, "/"), "/") {
		if isSingleDot(seg) || isDoubleDot(seg) {
			return true
		}
	}
	return false
}

// removeDots resolves the dot segments of an absolute path as browsers do
// ("." and ".." in any percent-encoding and case); a ".." at the root
// stays there.
func removeDots(p string) string {
	if !hasDotSegment(p) {
		return p
	}
	segs := strings.Split(p[1:], "/")
	out := make([]string, 0, len(segs))
	for i, seg := range segs {
		last := i == len(segs)-1
		switch {
		case isDoubleDot(seg):
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
			if last {
				out = append(out, "")
			}
		case isSingleDot(seg):
			if last {
				out = append(out, "")
			}
		default:
			out = append(out, seg)
		}
	}
	return "/" + strings.Join(out, "/")
}

// browserHost is an authority's host[:port] in canonical form (lowercase,
// no default port, no trailing dot), refusing what a browser may read
// differently from this check: percent-encoding or non-ASCII (which
// browsers decode and map), a host ending in a number that is not a
// dotted-decimal IPv4 address (browsers read 2130706433, 0x7f.1 or 0177.0.0.1
// as addresses), and anything else httpguard's host rules refuse.
func browserHost(authority, scheme string) (string, bool) {
	for i := 0; i < len(authority); i++ {
		if c := authority[i]; c == '%' || c >= 0x80 {
			return "", false
		}
	}
	h, ok := ident.CanonicalHost(authority, scheme)
	if !ok {
		return "", false
	}
	name := h
	if !strings.HasPrefix(name, "[") {
		if i := strings.LastIndexByte(name, ':'); i >= 0 {
			name = name[:i]
		}
		last := name[strings.LastIndexByte(name, '.')+1:]
		if numeric(last) {
			if a, err := netip.ParseAddr(name); err != nil || !a.Is4() || a.String() != name {
				return "", false
			}
		}
	}
	return h, true
}

// numeric: a label browsers read as a number (decimal, or 0x hex).
func numeric(label string) bool {
	if label == "" {
		return false
	}
	if len(label) >= 2 && label[0] == '0' && (label[1] == 'x' || label[1] == 'X') {
		return true
	}
	for i := 0; i < len(label); i++ {
		if label[i] < '0' || label[i] > '9' {
			return false
		}
	}
	return true
}

// canonicalUpstream is DSH's address as browserHost would write it.
func canonicalUpstream(addr string) string {
	h, _ := ident.CanonicalHost(addr, "http")
	return h
}

// refresh rewrites the URL of a Refresh header ("5; url=/next") the way
// rewrite does a Location, reading it as browsers do (HTML's shared
// declarative refresh steps: "url" and "=" may be spaced or missing, the
// URL may be quoted). It returns "" for a value browsers ignore (no
// delay), which is dropped.
func (l location) refresh(v string) (string, bool) {
	s := strings.TrimLeft(v, " \t\n\f\r")
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	if i == 0 && (len(s) == 0 || s[0] != '.') {
		return "", true
	}
	for i < len(s) && (s[i] >= '0' && s[i] <= '9' || s[i] == '.') {
		i++
	}
	delay, s := s[:i], s[i:]
	if s == "" {
		return delay, true
	}
	if c := s[0]; c != ';' && c != ',' && !isSpace(c) {
		return "", true
	}
	s = strings.TrimLeft(s, " \t\n\f\r")
	if s != "" && (s[0] == ';' || s[0] == ',') {
		s = s[1:]
	}
	s = strings.TrimLeft(s, " \t\n\f\r")
	if s == "" {
		return delay, true
	}
	target := s
	if len(s) >= 3 && strings.EqualFold(s[:3], "url") {
		if t := strings.TrimLeft(s[3:], " \t\n\f\r"); t != "" && t[0] == '=' {
			target = strings.TrimLeft(t[1:], " \t\n\f\r")
		}
	}
	if target != "" && (target[0] == '"' || target[0] == '\'') {
		if end := strings.IndexByte(target[1:], target[0]); end >= 0 {
			target = target[1 : end+1]
		} else {
			target = target[1:]
		}
	}
	r, ok := l.rewrite(target)
	if !ok {
		return "", false
	}
	return delay + "; url=" + r, true
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\f' || c == '\r' }

func ensureSlash(p string) string {
	if strings.HasPrefix(p, "/") {
		return p
	}
	return "/" + p
}
