package proxy

import (
	"iter"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// loc is bob's answer to a request for /u/bob/a/b over http.
var loc = location{prefix: "/u/bob", host: "gw.example", upstream: "10.1.2.3:3080", scheme: "http", base: "/a/b"}

func TestLocationRewrite(t *testing.T) {
	for _, tt := range []struct {
		in, want string
		ok       bool
	}{
		{"", "", true},
		{"/settings/", "/u/bob/settings/", true},
		{"/u/bob/x", "/u/bob/x", true},
		{"/u/bob", "/u/bob", true},
		{"/u/bobby/x", "/u/bob/u/bobby/x", true},
		{"next", "next", true},
		{"?page=2", "?page=2", true},
		{"#top", "#top", true},
		{"../up", "/u/bob/up", true},
		{"http://gw.example/a?b=1", "http://gw.example/u/bob/a?b=1", true},
		{"https://GW.example/u/bob/a", "https://gw.example/u/bob/a", true},
		{"https://gw.example:443/u/bob/a", "https://gw.example/u/bob/a", true},
		{"http://10.1.2.3:3080/a?b=1", "/u/bob/a?b=1", true},
		{"https://elsewhere.example/x", "https://elsewhere.example/x", true},
		{"mailto:a@b.example", "mailto:a@b.example", true},
		{"//evil.example/x", "", false},
		{"/\\evil.example/x", "", false},
		{"\\\\evil.example", "", false},
		{"\\/evil.example", "", false},
	} {
		got, ok := loc.rewrite(tt.in)
		if got != tt.want || ok != tt.ok {
			t.Errorf("Location %q → %q %v, want %q %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

// The prefix check reads a redirect as a browser will (security review
// S13): dot segments, percent-encoded in any case, backslashes read as
// slashes, tabs and newlines dropped, relative references climbing above
// the prefix, and absolute URLs naming the gateway's host in another
// spelling. Each case either lands inside /u/bob/ or is refused; where
// one is rewritten, the result is clean, so the browser cannot read it
// any other way.
func TestLocationDotSegmentsStayInThePrefix(t *testing.T) {
	for _, tt := range []struct {
		in, want string
		ok       bool
	}{
		{"/u/bob/../alice/", "/u/bob/u/alice/", true},
		{"/u/bob/./../alice", "/u/bob/u/alice", true},
		{"/u/bob/%2e%2e/alice/", "/u/bob/u/alice/", true},
		{"/u/bob/%2E%2e/alice/", "/u/bob/u/alice/", true},
		{"/u/bob/.%2E/alice/", "/u/bob/u/alice/", true},
		{"/u/bob/%2e./alice/", "/u/bob/u/alice/", true},
		{"/u/bob/..\\alice/", "/u/bob/u/alice/", true},
		{"/u/bob\\..\\alice", "/u/bob/u/alice", true},
		{"/u/bob/.\t./alice/", "/u/bob/u/alice/", true},
		{"/u/bob/..", "/u/bob/u/", true},
		{"/u/bob/%2e%2e", "/u/bob/u/", true},
		{"/u/bob/x/../y", "/u/bob/y", true},
		{"/u/bob/x/%2e%2e/y?q=..#..", "/u/bob/y?q=..#..", true},
		{"/u/bob/%2e%2e%2falice", "/u/bob/%2e%2e%2falice", true}, // %2f is no separator
		{"../../../alice/", "/u/bob/alice/", true},
		{"../../%2e%2e/alice/", "/u/bob/alice/", true},
		{"..\\..\\..\\alice", "/u/bob/alice", true},
		{"%2e%2e/%2e%2e/%2e%2e/alice", "/u/bob/alice", true},
		{"./x", "/u/bob/a/x", true},
		{"http:../../../alice/", "/u/bob/alice/", true},
		{"http:/u/alice/", "/u/bob/u/alice/", true},
		{"http://gw.example/u/bob/../alice/", "http://gw.example/u/bob/u/alice/", true},
		{"http://gw.example/u/bob/%2e%2e/alice/", "http://gw.example/u/bob/u/alice/", true},
		{"http:\\\\gw.example\\u\\alice", "http://gw.example/u/bob/u/alice", true},
		{"http:/\\gw.example/u/alice", "http://gw.example/u/bob/u/alice", true},
		{"https:gw.example/u/alice", "https://gw.example/u/bob/u/alice", true},
		{"https:///gw.example/u/alice", "https://gw.example/u/bob/u/alice", true},
		{"HTTP://GW.EXAMPLE./u/alice", "http://gw.example/u/bob/u/alice", true},
		{"http://gw.example:80/u/alice", "http://gw.example/u/bob/u/alice", true},
		{"http://someone@gw.example/u/alice", "http://gw.example/u/bob/u/alice", true},
		{"http://evil.example\\@gw.example/", "http://evil.example\\@gw.example/", true}, // host evil.example
		{"http://10.1.2.3:3080/../../alice", "/u/bob/alice", true},
		{" \t/u/bob/../alice\n", "/u/bob/u/alice", true},
		{"http://g%77.example/u/alice", "", false},
		{"http://ｇｗ.example/u/alice", "", false},
		{"http://gw.example:0080/u/alice", "", false},
		{"http://2130706433/u/alice", "", false},
		{"http://0x7f.1/u/alice", "", false},
		{"http://0177.0.0.1/u/alice", "", false},
		{"/\t/evil.example/", "", false},
		{"\\\t\\evil.example/", "", false},
	} {
		got, ok := loc.rewrite(tt.in)
		if got != tt.want || ok != tt.ok {
			t.Errorf("Location %q → %q %v, want %q %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

func TestRefreshRewrite(t *testing.T) {
	for _, tt := range []struct {
		in, want string
		ok       bool
	}{
		{"5", "5", true},
		{"0; url=/next", "0; url=/u/bob/next", true},
		{"3;URL='/next'", "3; url=/u/bob/next", true},
		{`1, url="http://10.1.2.3:3080/x"`, "1; url=/u/bob/x", true},
		{"2; url=https://elsewhere.example/", "2; url=https://elsewhere.example/", true},
		{"0; url=//evil.example/", "", false},
		// Read as browsers read it: spaces around =, no url=, quotes.
		{"0; url = //evil.example/", "", false},
		{"0;//evil.example/", "", false},
		{"0 //evil.example/", "", false},
		{"0; URL = '/u/bob/../alice/' trailing", "0; url=/u/bob/u/alice/", true},
		{"0; url=/u/bob/%2e%2e/alice", "0; url=/u/bob/u/alice", true},
		{"1.5; url=next", "1.5; url=next", true},
		{"soon; url=//evil.example/", "", true}, // browsers ignore it: dropped
		{"0x; url=//evil.example/", "", true},
		{"0 /u/alice/", "0; url=/u/bob/u/alice/", true},
	} {
		got, ok := loc.refresh(tt.in)
		if got != tt.want || ok != tt.ok {
			t.Errorf("Refresh %q → %q %v, want %q %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

func TestResponseHeaders(t *testing.T) {
	p := newHeaderPolicy(nil, nil)
	for _, tt := range []struct {
		name string
		in   http.Header
		want []string // "Name: value", sorted
		err  bool
	}{
		{
			name: "ordinary headers pass",
			in:   http.Header{"Content-Type": {"text/html"}, "Cache-Control": {"no-cache"}, "X-Custom": {"a", "b"}},
			want: []string{"Cache-Control: private, no-cache", "Content-Type: text/html", "Vary: Cookie", "X-Custom: a", "X-Custom: b"},
		},
		{
			name: "origin-wide headers are dropped",
			in: http.Header{
				"Set-Cookie": {"dsh-auth-1=secret"}, "Service-Worker-Allowed": {"/"}, "Clear-Site-Data": {`"*"`},
				"Strict-Transport-Security": {"max-age=9999; includeSubDomains"}, "Alt-Svc": {`h3=":443"`},
				"Report-To": {"{}"}, "Nel": {"{}"}, "Content-Type": {"text/plain"},
			},
			want: []string{"Cache-Control: private", "Content-Type: text/plain", "Vary: Cookie"},
		},
		{
			name: "instructions to an nginx in front are dropped",
			in:   http.Header{"X-Accel-Redirect": {"/internal/secret"}, "X-Accel-Buffering": {"no"}, "X-Accelerated": {"kept"}},
			want: []string{"Cache-Control: private", "Vary: Cookie", "X-Accelerated: kept"},
		},
		{
			name: "hop-by-hop, including every name in every Connection header",
			in: http.Header{
				"Connection": {"X-One", "close, X-Two"}, "X-One": {"1"}, "X-Two": {"2"}, "X-Three": {"3"},
				"Keep-Alive": {"timeout=5"}, "Transfer-Encoding": {"chunked"}, "Upgrade": {"h2c"}, "Content-Length": {"12"},
			},
			want: []string{"Cache-Control: private", "Vary: Cookie", "X-Three: 3"},
		},
		{
			name: "Location and Refresh stay in the prefix",
			in:   http.Header{"Location": {"/settings/"}, "Refresh": {"0; url=/next"}},
			want: []string{"Cache-Control: private", "Location: /u/bob/settings/", "Refresh: 0; url=/u/bob/next", "Vary: Cookie"},
		},
		{
			name: "a Refresh browsers ignore is dropped",
			in:   http.Header{"Refresh": {"later; url=/x"}},
			want: []string{"Cache-Control: private", "Vary: Cookie"},
		},
		{name: "protocol-relative Location is refused", in: http.Header{"Location": {"//evil.example/"}, "X-Custom": {"a"}}, err: true},
		{name: "protocol-relative Refresh is refused", in: http.Header{"Refresh": {"0;url=//evil.example/"}}, err: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			err := p.response(visitHeader(tt.in), loc, addFunc(func(k, v []byte) { got = append(got, string(k)+": "+string(v)) }))
			slices.Sort(got)
			switch {
			case tt.err && (err == nil || len(got) != 0):
				t.Fatalf("err %v, added %v: want an error and nothing added", err, got)
			case !tt.err && (err != nil || strings.Join(got, "\n") != strings.Join(tt.want, "\n")):
				t.Fatalf("err %v, got\n%s\nwant\n%s", err, strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
		})
	}
}

// Every answer leaves the edge private to the browser that asked
// (security review S14): DSH's public and s-maxage (a shared cache's
// permission) are dropped, private with field names (private only for
// them) becomes plain private, private is added unless the answer is
// no-store; the rest is kept for the browser's own cache, and Vary names
// Cookie unless it already does (or is *).
func TestAnswersArePrivate(t *testing.T) {
	p := newHeaderPolicy(nil, nil)
	for _, tt := range []struct {
		in        http.Header
		cache     string
		varyAdded bool
	}{
		{http.Header{"Cache-Control": {"public, max-age=86400"}}, "private, max-age=86400", true},
		{http.Header{"Cache-Control": {"PUBLIC", "s-maxage=600, max-age=60"}}, "private, max-age=60", true},
		{http.Header{"Cache-Control": {`private="Set-Cookie", max-age=60`}}, "private, max-age=60", true},
		{http.Header{"Cache-Control": {`no-cache="X-A, X-B", public`}}, `private, no-cache="X-A, X-B"`, true},
		{http.Header{"Cache-Control": {"no-store"}}, "no-store", true},
		{http.Header{"Cache-Control": {"private, private, max-age=5"}}, "private, max-age=5", true},
		{http.Header{}, "private", true},
		{http.Header{"Cache-Control": {"public"}, "Vary": {"Accept-Encoding"}}, "private", true},
		{http.Header{"Cache-Control": {"public"}, "Vary": {"accept-encoding, cookie"}}, "private", false},
		{http.Header{"Vary": {"*"}}, "private", false},
	} {
		var cache, vary []string
		err := p.response(visitHeader(tt.in), loc, addFunc(func(k, v []byte) {
			switch string(k) {
			case "Cache-Control":
				cache = append(cache, string(v))
			case "Vary":
				vary = append(vary, string(v))
			}
		}))
		if err != nil {
			t.Fatal(err)
		}
		if len(cache) != 1 || cache[0] != tt.cache {
			t.Errorf("%v: Cache-Control %q, want %q", tt.in, cache, tt.cache)
		}
		want := slices.Clone(tt.in["Vary"])
		if tt.varyAdded {
			want = append(want, "Cookie")
		}
		if !slices.Equal(vary, want) {
			t.Errorf("%v: Vary %q, want %q", tt.in, vary, want)
		}
	}
}

func TestRequestHeaderPolicy(t *testing.T) {
	deny := newHeaderPolicy(nil, []string{"X-Forwarded-User", "X-Forwarded-Email", ""})
	allow := newHeaderPolicy([]string{"Accept", "X-Custom", "X-Forwarded-For"}, nil)
	for _, tt := range []struct {
		name        string
		deny, allow bool
	}{
		{"Accept", true, true},
		{"X-Custom", true, true},
		{"X-Other", true, false},
		{"Cookie", false, false},
		{"Authorization", false, false},
		{"Host", false, false},
		{"Forwarded", false, false},
		{"X-Forwarded-For", false, false}, // ours to set, even if allowed
		{"X-Forwarded-User", false, false},
		{"X_forwarded_user", false, false},
		{"X-Real-Ip", false, false},
		{"True-Client-Ip", false, false},
		{"X-Original-Url", false, false},
		{"X-Auth-Request-User", false, false},
		{"Sec-Websocket-Key", false, false},
		{"Expect", false, false},
	} {
		if got := deny.pass(tt.name); got != tt.deny {
			t.Errorf("denylist: %s passes=%v, want %v", tt.name, got, tt.deny)
		}
		if got := allow.pass(tt.name); got != tt.allow {
			t.Errorf("allowlist: %s passes=%v, want %v", tt.name, got, tt.allow)
		}
	}
	if connectionTokens([][]byte{[]byte("keep-alive"), []byte("Close")}) != nil {
		t.Fatal("keep-alive and close are no extra hop-by-hop headers")
	}
	tokens := connectionTokens([][]byte{[]byte("keep-alive, X-A"), []byte("x-b")})
	if !tokens["X-A"] || !tokens["X-B"] || !isHopByHop("X-B", tokens) || isHopByHop("X-C", tokens) {
		t.Fatalf("connection tokens %v", tokens)
	}
}

func TestSplitUserPath(t *testing.T) {
	for _, tt := range []struct {
		raw, user, rest string
		ok              bool
	}{
		{"/u/bob/", "bob", "/", true},
		{"/u/bob", "bob", "", true},
		{"/u/bob/a/../b", "bob", "/a/../b", true},
		{"/u/bob%2Falice/x", "bob%2Falice", "/x", true},
		{"/u//alice/", "", "/alice/", true},
		{"/x/bob/", "", "", false},
	} {
		user, rest, ok := splitUserPath(tt.raw)
		if user != tt.user || rest != tt.rest || ok != tt.ok {
			t.Errorf("%q → %q %q %v", tt.raw, user, rest, ok)
		}
	}
}

// visitHeader visits h as fasthttp visits a parsed header.
// addFunc records what response adds.
type addFunc func(k, v []byte)

func (f addFunc) AddBytesKV(k, v []byte) { f(k, v) }

func visitHeader(h http.Header) iter.Seq2[[]byte, []byte] {
	return func(yield func(k, v []byte) bool) {
		for k, vs := range h {
			for _, v := range vs {
				if !yield([]byte(k), []byte(v)) {
					return
				}
			}
		}
	}
}
