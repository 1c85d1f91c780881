package proxy

import (
	"bufio"
	"net/http"
	"net/textproto"
	"slices"
	"strings"
	"testing"

	"github.com/gofiber/fiber/v2"
	"github.com/valyala/fasthttp"
)

// The header policy as the security table states it, written out again
// here so the fuzz targets check the policy, not its implementation.
var (
	// hopByHopRef describe a connection (RFC 9110 §7.6.1, and the legacy
	// ones): never forwarded in either direction.
	hopByHopRef = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}
	// oursRef are the request headers only the edge sets: the browser's
	// own never reach DSH.
	oursRef = []string{"Cookie", "Authorization", "Host", "Forwarded", "Content-Length", "Expect", "X-Real-Ip", "True-Client-Ip", "X-Client-Ip",
		"Cf-Connecting-Ip", "X-Cluster-Client-Ip", "X-Original-Url", "X-Rewrite-Url", "X-Original-Host"}
	oursPrefixRef = []string{"X-Forwarded-", "X-Auth-Request-", "Sec-Websocket-"}
	// identityRef are the SSO proxy's identity headers of the fuzzed policy.
	identityRef = []string{"Remote-User", "X-Email"}
	// originWideRef are response headers that act on the whole gateway
	// origin: never from a sandbox.
	originWideRef = []string{"Set-Cookie", "Set-Cookie2", "Service-Worker-Allowed", "Clear-Site-Data", "Strict-Transport-Security", "Alt-Svc",
		"Public-Key-Pins", "Public-Key-Pins-Report-Only", "Report-To", "Reporting-Endpoints", "Nel", "Origin-Agent-Cluster", "Content-Length"}
)

func hasFold(list []string, name string) bool {
	return slices.ContainsFunc(list, func(s string) bool { return strings.EqualFold(s, name) })
}

func hasPrefixFold(prefixes []string, name string) bool {
	return slices.ContainsFunc(prefixes, func(p string) bool { return len(name) >= len(p) && strings.EqualFold(name[:len(p)], p) })
}

// connectionNames are the names a set of Connection values lists.
func connectionNames(values []string) []string {
	var names []string
	for _, v := range values {
		for t := range strings.SplitSeq(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				names = append(names, t)
			}
		}
	}
	return names
}

// The edge's own values in the fuzzed requests.
const (
	fuzzHost   = "gw.example"
	fuzzCookie = "dsh-auth-1=sealed"
)

// FuzzRequestHeaders sends the browser's header block (after a fixed
// request line, as fasthttp parses it for the edge) through the request
// header policy (Proxy.outgoing) and reads what DSH gets with net/http:
// DSH can parse it; Host, Cookie and the X-Forwarded-* headers are exactly
// the edge's; no hop-by-hop header, none that any Connection header names,
// no identity header, no name with an underscore and none the edge owns
// survives, whatever its case or spacing; with an allowlist, nothing else
// does either; and every other header of the browser reaches DSH with its
// value.
func FuzzRequestHeaders(f *testing.F) {
	for _, s := range []string{
		"Accept: text/html\r\nX-Custom: 1\r\n",
		"Cookie: session=abc\r\ncookie: other=1\r\nAUTHORIZATION: Bearer x\r\n",
		"Connection: X-Secret, keep-alive\r\nX-Secret: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\nUpgrade: h2c\r\n",
		"X-Forwarded-For: 1.2.3.4\r\nx-forwarded-user: admin\r\nX_Forwarded_User: admin\r\nRemote-User: admin\r\nremote-user: admin\r\n",
		"Forwarded: for=1.2.3.4\r\nX-Real-IP: 1.2.3.4\r\nTrue-Client-IP: 1\r\nX-Original-URL: /admin\r\nSec-WebSocket-Key: x\r\n",
		"Host: evil.example\r\nContent-Length: 5\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n",
		"X-A: 1\r\n folded: 2\r\n",
		"X-Email : a@b\r\nCookie\t: x\r\n",
		"X-Custom: a\r\nX-Custom: b\r\nAccept: */*\r\n",
	} {
		f.Add(false, []byte(s))
		f.Add(true, []byte(s))
	}
	f.Fuzz(func(t *testing.T, allowlist bool, block []byte) {
		var rc fasthttp.RequestCtx
		raw := "GET /u/alice/x HTTP/1.1\r\nHost: " + fuzzHost + "\r\n" + string(block) + "\r\n\r\n"
		if err := rc.Request.Header.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			return // the edge answers 400
		}
		var allowed []string
		if allowlist {
			allowed = []string{"Accept", "X-Custom", "X-Forwarded-For", "Cookie"}
		}
		p := &Proxy{headers: newHeaderPolicy(allowed, identityRef)}
		app := fiber.New()
		c := app.AcquireCtx(&rc)
		defer app.ReleaseCtx(c)
		r := &request{c: c, method: "GET", user: "alice", rest: "/x", host: fuzzHost, scheme: "https"}
		o := p.outgoing(r, Upstream{Host: fuzzHost, Cookie: fuzzCookie}, nil)
		sent := "GET " + string(o.uri) + " HTTP/1.1\r\n" + string(o.header) + "\r\n"
		req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(sent)))
		if err != nil {
			t.Fatalf("DSH cannot read what the edge sends (%v):\n%s", err, sent)
		}

		// What the browser sent, as the edge read it, and the names its
		// Connection headers make hop-by-hop.
		type field struct{ name, value string }
		var browserFields []field
		var conn []string
		for k, v := range rc.Request.Header.All() {
			browserFields = append(browserFields, field{string(k), string(v)})
			if strings.EqualFold(string(k), "Connection") {
				conn = append(conn, string(v))
			}
		}
		dropped := func(name string) bool {
			return hasFold(hopByHopRef, name) || hasFold(connectionNames(conn), name) || hasFold(oursRef, name) || hasPrefixFold(oursPrefixRef, name) ||
				hasFold(identityRef, name) || strings.Contains(name, "_") || allowlist && !hasFold(allowed, name)
		}

		if req.Host != fuzzHost {
			t.Fatalf("DSH reads Host %q:\n%s", req.Host, sent)
		}
		ours := map[string]string{"Cookie": fuzzCookie, "X-Forwarded-For": "0.0.0.0", "X-Forwarded-Proto": "https", "X-Forwarded-Host": fuzzHost, "X-Forwarded-Prefix": "/u/alice"}
		for name, vs := range req.Header {
			key := strings.TrimSpace(name)
			if want, ok := ours[textproto.CanonicalMIMEHeaderKey(key)]; ok {
				if len(vs) != 1 || vs[0] != want || key != name {
					t.Fatalf("DSH reads %s %q, the edge set %q:\n%s", name, vs, want, sent)
				}
				continue
			}
			if dropped(key) {
				t.Fatalf("%s reached DSH:\n%s", name, sent)
			}
		}
		for _, f := range browserFields {
			if dropped(f.name) {
				continue
			}
			if got := req.Header.Values(f.name); !slices.Contains(got, strings.Trim(f.value, " \t")) {
				t.Fatalf("%s: %q reached DSH as %q:\n%s", f.name, f.value, got, sent)
			}
		}
	})
}

// The request the fuzzed answers respond to, and where the edge is.
const (
	fuzzPrefix   = "/u/alice"
	fuzzUpstream = "10.1.2.3:3080"
	fuzzPath     = fuzzPrefix + "/app/view/item"
	fuzzPage     = "https://" + fuzzHost + fuzzPath + "?x=1"
)

var fuzzLocation = location{prefix: fuzzPrefix, host: fuzzHost, upstream: fuzzUpstream, scheme: "https", base: strings.TrimPrefix(fuzzPath, fuzzPrefix)}

// FuzzResponseHeaders sends DSH's header block (after a fixed status
// line, read by the upstream client's head reader) through the response
// header policy: the browser gets no hop-by-hop header, none a Connection
// header names, no origin-wide one and no X-Accel-* instruction, whatever
// their case; a Location or Refresh it gets sends it nowhere on the
// gateway's host outside the user's prefix (as a browser resolves it);
// a refused answer adds nothing; and every other header reaches the
// browser with its value.
func FuzzResponseHeaders(f *testing.F) {
	for _, s := range []string{
		"Content-Type: text/html\r\nX-Custom: 1\r\n",
		"Set-Cookie: dsh-auth-1=secret\r\nset-cookie: b=2\r\nSTRICT-TRANSPORT-SECURITY: max-age=1\r\nClear-Site-Data: \"*\"\r\n",
		"Connection: X-Secret\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nUpgrade: h2c\r\nTrailer: X\r\n",
		"X-Accel-Redirect: /internal\r\nx-accel-buffering: no\r\nX-Accelerated: kept\r\n",
		"Location: /settings/\r\nRefresh: 0; url=/next\r\n",
		"Location: https://gw.example/u/bob/\r\n",
		"Location: //evil.example/\r\n",
		"Service-Worker-Allowed: /\r\nNEL: {}\r\nReport-To: {}\r\nAlt-Svc: h3=\":443\"\r\nOrigin-Agent-Cluster: ?1\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, block []byte) {
		raw := "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n" + string(block) + "\r\n\r\n"
		var h fasthttp.ResponseHeader
		if _, err := readHead(&h, bufio.NewReader(strings.NewReader(raw))); err != nil {
			return // a 502
		}
		// What DSH said, as a strict reader reads it.
		resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(raw)), nil)
		if err != nil {
			t.Fatalf("the head reader accepted what net/http refuses (%v):\n%s", err, raw)
		}
		type field struct{ name, value string }
		var added []field
		err = newHeaderPolicy(nil, nil).response(h.All(), fuzzLocation, addFunc(func(k, v []byte) { added = append(added, field{string(k), string(v)}) }))
		if err != nil {
			if len(added) > 0 {
				t.Fatalf("refused (%v) after adding %v", err, added)
			}
			return
		}
		conn := connectionNames(resp.Header.Values("Connection"))
		dropped := func(name string) bool {
			return hasFold(hopByHopRef, name) || hasFold(conn, name) || hasFold(originWideRef, name) || hasPrefixFold([]string{"X-Accel-"}, name)
		}
		for _, a := range added {
			switch {
			case dropped(a.name):
				t.Fatalf("%s: %s reached the browser:\n%s", a.name, a.value, raw)
			case strings.EqualFold(a.name, "Location") || strings.EqualFold(a.name, "Refresh"):
				if u := resolve(t, fuzzPage, a.value, strings.EqualFold(a.name, "Refresh")); !u.inside(fuzzHost, fuzzPrefix) {
					t.Fatalf("%s %q (DSH said %q) sends the browser to %s, outside %s", a.name, a.value, resp.Header.Get(a.name), u.Href, fuzzPrefix)
				}
			}
		}
		for name, vs := range resp.Header {
			if dropped(name) || name == "Location" || name == "Refresh" {
				continue
			}
			for _, v := range vs {
				if v == "" && (name == "Server" || name == "Content-Type") {
					continue // fasthttp keeps these apart and drops them empty
				}
				if !slices.ContainsFunc(added, func(a field) bool { return strings.EqualFold(a.name, name) && a.value == v }) {
					t.Fatalf("%s: %q did not reach the browser (it got %v):\n%s", name, v, added, raw)
				}
			}
		}
	})
}

// FuzzRedirect rewrites a Location (or, with refresh, a Refresh) value of
// an answer to the page fuzzPage and has a browser resolve the result: it
// never lands on the gateway's host outside the user's prefix, and a
// value that already stayed inside the prefix keeps its meaning.
func FuzzRedirect(f *testing.F) {
	for _, s := range []string{
		"", "/settings/", "/u/alice/x", "/u/alicex/y", "next", "../up", "http://gw.example/a?b=1",
		"https://GW.example/u/alice/a", "http://10.1.2.3:3080/a?b=1", "https://elsewhere.example/x", "mailto:a@b.example",
		"//evil.example/x", "/\\evil.example/x", "/u/alice\\..\\bob", "\t/u/bob/", "./%2E%2e/%2e./bob",
	} {
		f.Add(s, false)
		f.Add("0; url="+s, true)
	}
	for _, s := range []string{"5", "0;url='/next'", "1, url=\"http://10.1.2.3:3080/x\"", "0; URL = ' /x'"} {
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, value string, refresh bool) {
		// A header value as the head reader lets it through: no controls
		// but tabs, no spaces around it.
		if !validValue([]byte(value)) || strings.Trim(value, " \t") != value {
			return
		}
		rewrite := fuzzLocation.rewrite
		if refresh {
			rewrite = fuzzLocation.refresh
		}
		out, ok := rewrite(value)
		before := resolve(t, fuzzPage, value, refresh)
		if !ok {
			return
		}
		after := resolve(t, fuzzPage, out, refresh)
		if !after.inside(fuzzHost, fuzzPrefix) {
			t.Fatalf("%q, rewritten %q, sends the browser to %s, outside %s", value, out, after.Href, fuzzPrefix)
		}
		if strings.EqualFold(before.Hostname, fuzzHost) && before.inside(fuzzHost, fuzzPrefix) && before != after {
			t.Fatalf("%q led to %s inside the prefix; rewritten %q it leads to %s", value, before.Href, out, after.Href)
		}
	})
}
