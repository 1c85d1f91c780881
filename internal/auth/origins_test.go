package auth

import "testing"

// The sign-in's next is the one URL a browser is sent to from the
// gateway with a fresh code: exactly a sandbox origin of this gateway, by
// the request's scheme, with a path a browser reads on that origin.
func TestSandboxURL(t *testing.T) {
	a := &Authenticator{o: Options{Origins: Origins{Domain: "sbx.example"}}}
	for _, tt := range []struct {
		next, host, user string
		port             int
		path             string
		ok               bool
	}{
		{next: "https://ann.sbx.example/", host: "ann.sbx.example", user: "ann", path: "/", ok: true},
		{next: "https://ANN.sbx.example:443", host: "ann.sbx.example", user: "ann", path: "/", ok: true},
		{next: "https://ann.sbx.example/a%20b/c?x=1&y=%2F#frag", host: "ann.sbx.example", user: "ann", path: "/a%20b/c?x=1&y=%2F", ok: true},
		{next: "https://5173-ann.sbx.example/app", host: "5173-ann.sbx.example", user: "ann", port: 5173, path: "/app", ok: true},
		{next: "http://ann.sbx.example/"},       // another scheme than the request's
		{next: "https://ann.sbx.example:8443/"}, // another origin
		{next: "https://x@ann.sbx.example/"},    // userinfo
		{next: "https://a.ann.sbx.example/"},    // no sandbox's host
		{next: "https://sbx.example/"},          // the domain itself
		{next: "https://gw.example/"},           // the gateway
		{next: "https://evil.example/?ann.sbx.example"},
		{next: "https://ann.sbx.example.evil.example/"},
		{next: "https://dshx.sbx.example/"},
		{next: "//ann.sbx.example/"},
		{next: "/relative"},
		{next: "https://ann.sbx.example//evil.example/"}, // a path browsers read as another host
		{next: "https://ann.sbx.example/%0d%0aSet-Cookie:x", host: "ann.sbx.example", user: "ann", path: "/%0d%0aSet-Cookie:x", ok: true}, // stays encoded
		{next: "javascript:alert(1)"},
		{next: ""},
	} {
		host, user, port, path, ok := a.sandboxURL(tt.next, "https")
		if host != tt.host || user != tt.user || port != tt.port || path != tt.path || ok != tt.ok {
			t.Errorf("sandboxURL(%q) = %q %q %d %q %v; want %q %q %d %q %v", tt.next, host, user, port, path, ok, tt.host, tt.user, tt.port, tt.path, tt.ok)
		}
	}
}

func TestLocalPath(t *testing.T) {
	for p, want := range map[string]bool{
		"/": true, "/a?b=c": true, "/a/b%2F": true,
		"": false, "a": false, "//evil.example": false, "/\\evil.example": false, "/a\r\nb": false, "/a\tb": false, "https://x/": false,
	} {
		if got := LocalPath(p); got != want {
			t.Errorf("LocalPath(%q) = %v", p, got)
		}
	}
}
