package proxy

import (
	"net/http"
	"slices"
	"strings"
	"testing"
)

var loc = location{prefix: "/u/bob", host: "gw.example", upstream: "10.1.2.3:3080"}

func TestLocationRewrite(t *testing.T) {
	for _, tt := range []struct {
		in, want string
		ok       bool
	}{
		{"", "", true},
		{"/settings/", "/u/bob/settings/", true},
		{"/u/bob/x", "/u/bob/x", true},
		{"/u/bobby/x", "/u/bob/u/bobby/x", true},
		{"next", "next", true},
		{"../up", "../up", true},
		{"http://gw.example/a?b=1", "http://gw.example/u/bob/a?b=1", true},
		{"https://GW.example/u/bob/a", "https://GW.example/u/bob/a", true},
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
			want: []string{"Cache-Control: no-cache", "Content-Type: text/html", "X-Custom: a", "X-Custom: b"},
		},
		{
			name: "origin-wide headers are dropped",
			in: http.Header{
				"Set-Cookie": {"dsh-auth-1=secret"}, "Service-Worker-Allowed": {"/"}, "Clear-Site-Data": {`"*"`},
				"Strict-Transport-Security": {"max-age=9999; includeSubDomains"}, "Alt-Svc": {`h3=":443"`},
				"Report-To": {"{}"}, "Nel": {"{}"}, "Content-Type": {"text/plain"},
			},
			want: []string{"Content-Type: text/plain"},
		},
		{
			name: "instructions to an nginx in front are dropped",
			in:   http.Header{"X-Accel-Redirect": {"/internal/secret"}, "X-Accel-Buffering": {"no"}, "X-Accelerated": {"kept"}},
			want: []string{"X-Accelerated: kept"},
		},
		{
			name: "hop-by-hop, including every name in every Connection header",
			in: http.Header{
				"Connection": {"X-One", "close, X-Two"}, "X-One": {"1"}, "X-Two": {"2"}, "X-Three": {"3"},
				"Keep-Alive": {"timeout=5"}, "Transfer-Encoding": {"chunked"}, "Upgrade": {"h2c"}, "Content-Length": {"12"},
			},
			want: []string{"X-Three: 3"},
		},
		{
			name: "Location and Refresh stay in the prefix",
			in:   http.Header{"Location": {"/settings/"}, "Refresh": {"0; url=/next"}},
			want: []string{"Location: /u/bob/settings/", "Refresh: 0; url=/u/bob/next"},
		},
		{name: "protocol-relative Location is refused", in: http.Header{"Location": {"//evil.example/"}, "X-Custom": {"a"}}, err: true},
		{name: "protocol-relative Refresh is refused", in: http.Header{"Refresh": {"0;url=//evil.example/"}}, err: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			err := p.response(visitHeader(tt.in), loc, func(k, v []byte) { got = append(got, string(k)+": "+string(v)) })
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
func visitHeader(h http.Header) func(func(k, v []byte)) {
	return func(f func(k, v []byte)) {
		for k, vs := range h {
			for _, v := range vs {
				f([]byte(k), []byte(v))
			}
		}
	}
}
