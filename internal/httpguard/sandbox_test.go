package httpguard_test

import (
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
)

// Sandbox origins are one label below SANDBOX_DOMAIN: <key> is the DSH of
// the sandbox of that key (<user> or <user>--<name>), <port>-<key> a
// preview. Everything else is no sandbox's host.
func TestParseSandboxHost(t *testing.T) {
	for _, tt := range []struct {
		host, domain string
		user         string
		port         int
		ok           bool
	}{
		{"ann.sbx.example", "sbx.example", "ann", 0, true},
		{"5173-ann.sbx.example", "sbx.example", "ann", 5173, true},
		{"1-ann.sbx.example", "sbx.example", "ann", 1, true},
		{"65535-ann.sbx.example", "sbx.example", "ann", 65535, true},
		{"ann-2.sbx.example", "sbx.example", "ann-2", 0, true},
		{"ann.localhost:8080", "localhost:8080", "ann", 0, true},
		{"3000-bob.localhost:8080", "localhost:8080", "bob", 3000, true},
		{"ann.localhost:8081", "localhost:8080", "", 0, false}, // another port is another domain
		{"ann.localhost", "localhost:8080", "", 0, false},      // no port
		{"sbx.example", "sbx.example", "", 0, false},           // the domain itself
		{".sbx.example", "sbx.example", "", 0, false},          // empty label
		{"a.ann.sbx.example", "sbx.example", "", 0, false},     // two labels deep
		{"annsbx.example", "sbx.example", "", 0, false},        // not below it, a suffix only
		{"ann.sbx.example.evil", "sbx.example", "", 0, false},  // another domain
		{"0-ann.sbx.example", "sbx.example", "", 0, false},     // port 0
		{"05173-ann.sbx.example", "sbx.example", "", 0, false}, // leading zero
		{"65536-ann.sbx.example", "sbx.example", "", 0, false}, // out of range
		{"99999999999999999999-ann.sbx.example", "sbx.example", "", 0, false},
		{"5173.sbx.example", "sbx.example", "", 0, false},          // a port, no user
		{"5173-.sbx.example", "sbx.example", "", 0, false},         // empty user
		{"5173-5173-ann.sbx.example", "sbx.example", "", 0, false}, // the user would start with a digit
		{"5173--ann.sbx.example", "sbx.example", "", 0, false},
		{"+5173-ann.sbx.example", "sbx.example", "", 0, false},
		{"dshadmin.sbx.example", "sbx.example", "", 0, false}, // no account can be named dsh…
		{"a--b.sbx.example", "sbx.example", "", 0, false},     // "a" is no account
		{"ann--work.sbx.example", "sbx.example", "ann--work", 0, true},
		{"ann--w.sbx.example", "sbx.example", "ann--w", 0, true},
		{"5173-ann--work.sbx.example", "sbx.example", "ann--work", 5173, true},
		{"ann--work-2.localhost:8080", "localhost:8080", "ann--work-2", 0, true},
		{"ann--.sbx.example", "sbx.example", "", 0, false},        // no name
		{"ann---work.sbx.example", "sbx.example", "", 0, false},   // the name would start with a hyphen
		{"ann--work--x.sbx.example", "sbx.example", "", 0, false}, // a third part
		{"ann--work-.sbx.example", "sbx.example", "", 0, false},
		{"ann--2w.sbx.example", "sbx.example", "", 0, false}, // a name starts with a letter
		{"dsh--work.sbx.example", "sbx.example", "", 0, false},
		{"ann--" + strings.Repeat("w", ident.MaxSandboxNameLen+1) + ".sbx.example", "sbx.example", "", 0, false},
		{"a.sbx.example", "sbx.example", "", 0, false}, // too short for an account
		{"ann_x.sbx.example", "sbx.example", "", 0, false},
		{"ann.sbx.example", "", "", 0, false}, // path mode: no sandbox hosts
	} {
		user, port, ok := httpguard.ParseSandboxHost(tt.host, tt.domain)
		if user != tt.user || port != tt.port || ok != tt.ok {
			t.Errorf("ParseSandboxHost(%q, %q) = %q, %d, %v; want %q, %d, %v", tt.host, tt.domain, user, port, ok, tt.user, tt.port, tt.ok)
		}
	}
}

// The host policy in subdomain mode: the gateway's hosts and every host
// one label below SANDBOX_DOMAIN are served (the latter never by a gateway
// route; Sandbox says whose origin it is, "" for a label that names no
// one); anything else is 421. Host case and the default port do not
// matter, as for PUBLIC_HOSTS.
func TestSandboxHostPolicy(t *testing.T) {
	p, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: []string{"GW.example", "gw2.example"}, SandboxDomain: "SBX.example:443"})
	if err != nil {
		t.Fatal(err)
	}
	peer := netip.MustParseAddr("203.0.113.5")
	for _, tt := range []struct {
		host        string
		tls         bool
		ok, sandbox bool
		user        string
		port        int
		canonical   string
	}{
		{host: "gw.example", ok: true, canonical: "gw.example"},
		{host: "Ann.SBX.example.", ok: true, sandbox: true, user: "ann", canonical: "ann.sbx.example"},
		{host: "ann.sbx.example:443", tls: true, ok: true, sandbox: true, user: "ann", canonical: "ann.sbx.example"},
		{host: "ann.sbx.example:8443", tls: true, ok: false, canonical: "ann.sbx.example:8443"},
		{host: "5173-ann.sbx.example", ok: true, sandbox: true, user: "ann", port: 5173, canonical: "5173-ann.sbx.example"},
		{host: "dshx.sbx.example", ok: true, sandbox: true, canonical: "dshx.sbx.example"}, // a 404 page, nothing proxied
		{host: "0-ann.sbx.example", ok: true, sandbox: true, canonical: "0-ann.sbx.example"},
		{host: "a.ann.sbx.example", ok: false, canonical: "a.ann.sbx.example"},
		{host: "sbx.example", ok: false, canonical: "sbx.example"},
		{host: "ann.other.example", ok: false, canonical: "ann.other.example"},
		{host: "ann.sbx.example/x", ok: false},
	} {
		info, ok := p.Resolve(peer, nil, nil, tt.host, tt.tls)
		if ok != tt.ok || info.OnSandboxDomain != tt.sandbox || info.Sandbox != tt.user || info.PreviewPort != tt.port || (tt.canonical != "" && info.Host != tt.canonical) {
			t.Errorf("%q: ok %v, %+v; want ok %v sandbox domain %v user %q port %d host %q", tt.host, ok, info, tt.ok, tt.sandbox, tt.user, tt.port, tt.canonical)
		}
		// The edge's pages on the sandbox domain link the gateway: the
		// first public host.
		if want := map[bool]string{true: "gw.example"}[tt.sandbox]; info.Gateway != want {
			t.Errorf("%q: gateway %q, want %q", tt.host, info.Gateway, want)
		}
	}
	if _, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: []string{"*"}, SandboxDomain: "sbx.example"}); err == nil {
		t.Error("a sandbox domain with no gateway host was accepted")
	}
	// Path mode knows no sandbox hosts.
	pm, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: []string{"gw.example"}})
	if err != nil {
		t.Fatal(err)
	}
	if info, ok := pm.Resolve(peer, nil, nil, "ann.sbx.example", false); ok || info.OnSandboxDomain || info.Sandbox != "" {
		t.Errorf("path mode accepted a sandbox host: %+v", info)
	}
}

// keyLabel is the reference grammar of an origin's label, written apart
// from ParseSandboxHost: an optional port (1-65535, no leading zero) and a
// hyphen, then an account name, and optionally "--" and a sandbox name.
var keyLabel = regexp.MustCompile(`^(?:([1-9][0-9]{0,4})-)?([a-z][a-z0-9-]*)$`)

// sandboxKey is the reference reading of a key: the part before the
// first "--" an account name, the rest, if any, a sandbox name.
func sandboxKey(key string) bool {
	user, name, named := strings.Cut(key, "--")
	return ident.ValidUser(user) && (!named || ident.ValidateSandboxName(name) == nil)
}

// FuzzSandboxHost holds ParseSandboxHost to the reference grammar and to
// SandboxHost: whatever it accepts is exactly one label (port and account
// name) below the domain, reads back to the same host, and names an
// account ident.ValidateUser accepts; whatever the grammar accepts it
// accepts. The policy agrees: a host it maps to a sandbox is one the
// parser accepts, and no sandbox host is taken for a gateway host.
func FuzzSandboxHost(f *testing.F) {
	domains := []string{"sbx.example", "localhost:8080", "a.b.c.example"}
	for _, s := range []string{
		"ann.sbx.example", "5173-ann.sbx.example", "0-ann.sbx.example", "05173-ann.sbx.example", "65536-ann.sbx.example",
		"a.ann.sbx.example", "sbx.example", ".sbx.example", "ann.sbx.example.", "ANN.sbx.example", "dsh.sbx.example",
		"ann.localhost:8080", "ann.localhost:80", "5173-ann.localhost:8080", "ann--x.sbx.example", "1-a1.a.b.c.example",
		"ann.sbx.example:443", "[::1].sbx.example", "5173-5173.sbx.example", "ann\x00.sbx.example",
	} {
		for i := range domains {
			f.Add(s, uint8(i))
		}
	}
	f.Fuzz(func(t *testing.T, host string, d uint8) {
		domain := domains[int(d)%len(domains)]
		user, port, ok := httpguard.ParseSandboxHost(host, domain)
		label, below := strings.CutSuffix(host, "."+domain)
		m := keyLabel.FindStringSubmatch(label)
		want := below && m != nil && sandboxKey(m[2])
		if want && m[1] != "" {
			n, _ := strconv.Atoi(m[1])
			want = n <= 65535
		}
		if ok != want {
			t.Fatalf("ParseSandboxHost(%q, %q) ok = %v; the grammar says %v", host, domain, ok, want)
		}
		if !ok {
			if user != "" || port != 0 {
				t.Fatalf("refused %q but returned %q, %d", host, user, port)
			}
		} else {
			if back := httpguard.SandboxHost(user, port, domain); back != host {
				t.Fatalf("%q parsed to %q, %d, which is the host %q", host, user, port, back)
			}
			if !ident.ValidSandboxKey(user) || ident.OwnerOf(user) == "" || port < 0 || port > 65535 {
				t.Fatalf("%q parsed to %q, %d", host, user, port)
			}
		}
		p, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: []string{"gw.example"}, SandboxDomain: domain})
		if err != nil {
			t.Fatal(err)
		}
		info, served := p.Resolve(netip.MustParseAddr("203.0.113.5"), nil, nil, host, false)
		if info.Sandbox != "" {
			if u, pt, ok := httpguard.ParseSandboxHost(info.Host, domain); !ok || u != info.Sandbox || pt != info.PreviewPort || !served || !info.OnSandboxDomain {
				t.Fatalf("the policy read %q as %+v (served %v); the parser reads %q as %q, %d, %v", host, info, served, info.Host, u, pt, ok)
			}
		}
		if served && !info.OnSandboxDomain && info.Host != "gw.example" {
			t.Fatalf("the policy served %q as a gateway host (%+v)", host, info)
		}
	})
}
