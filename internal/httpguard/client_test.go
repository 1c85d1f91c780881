package httpguard

import (
	"net/netip"
	"testing"

	"github.com/aaas-project/aaas/internal/ident"
)

func mustPolicy(t *testing.T, trusted []string, hosts ...string) *Policy {
	t.Helper()
	var prefixes []netip.Prefix
	for _, s := range trusted {
		p, err := ident.ParseTrustedProxy(s)
		if err != nil {
			t.Fatal(err)
		}
		prefixes = append(prefixes, p)
	}
	p, err := NewPolicy(Options{TrustedProxies: prefixes, PublicHosts: hosts})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestResolveClientAddress(t *testing.T) {
	p := mustPolicy(t, []string{"10.0.0.0/8", "fd00::1"}, "*")
	for _, tt := range []struct {
		name      string
		peer      string
		xff       []string
		wantIP    string
		wantKey   string
		wantProto []string
		scheme    string
	}{
		{name: "untrusted peer: forwarding headers ignored", peer: "203.0.113.5", xff: []string{"1.2.3.4"}, wantProto: []string{"https"}, wantIP: "203.0.113.5", wantKey: "203.0.113.5", scheme: "http"},
		{name: "trusted peer: the entry it appended", peer: "10.1.1.1", xff: []string{"198.51.100.7"}, wantProto: []string{"https"}, wantIP: "198.51.100.7", wantKey: "198.51.100.7", scheme: "https"},
		{name: "client-supplied entries left of the real one are ignored", peer: "10.1.1.1", xff: []string{"6.6.6.6, 198.51.100.7"}, wantIP: "198.51.100.7", wantKey: "198.51.100.7", scheme: "http"},
		{name: "walk past trusted hops", peer: "10.1.1.1", xff: []string{"198.51.100.7, 10.2.2.2", "10.3.3.3"}, wantIP: "198.51.100.7", wantKey: "198.51.100.7", scheme: "http"},
		{name: "all trusted: the leftmost", peer: "10.1.1.1", xff: []string{"10.9.9.9, 10.2.2.2"}, wantIP: "10.9.9.9", wantKey: "10.9.9.9", scheme: "http"},
		{name: "garbage stops at the last trusted hop", peer: "10.1.1.1", xff: []string{"198.51.100.7, not-an-ip"}, wantIP: "10.1.1.1", wantKey: "10.1.1.1", scheme: "http"},
		{name: "entry with a port", peer: "10.1.1.1", xff: []string{"198.51.100.7:5555"}, wantIP: "198.51.100.7", wantKey: "198.51.100.7", scheme: "http"},
		{name: "IPv6 client keyed by /64", peer: "fd00::1", xff: []string{"2001:db8:1:2:aaaa::1"}, wantIP: "2001:db8:1:2:aaaa::1", wantKey: "2001:db8:1:2::/64", scheme: "http"},
		{name: "IPv6 peer untrusted", peer: "2001:db8:1:2::9", xff: []string{"1.2.3.4"}, wantIP: "2001:db8:1:2::9", wantKey: "2001:db8:1:2::/64", scheme: "http"},
		{name: "bracketed entry", peer: "10.1.1.1", xff: []string{"[2001:db8::5]"}, wantIP: "2001:db8::5", wantKey: "2001:db8::/64", scheme: "http"},
		{name: "last proto wins; junk proto ignored", peer: "10.1.1.1", wantProto: []string{"https", "gopher"}, wantIP: "10.1.1.1", wantKey: "10.1.1.1", scheme: "http"},
		{name: "a WebSocket upgrade's wss is https (Traefik)", peer: "10.1.1.1", wantProto: []string{"wss"}, wantIP: "10.1.1.1", wantKey: "10.1.1.1", scheme: "https"},
		{name: "a WebSocket upgrade's ws is http", peer: "10.1.1.1", wantProto: []string{"ws"}, wantIP: "10.1.1.1", wantKey: "10.1.1.1", scheme: "http"},
		{name: "wss from an untrusted peer ignored", peer: "203.0.113.5", wantProto: []string{"wss"}, wantIP: "203.0.113.5", wantKey: "203.0.113.5", scheme: "http"},
		{name: "mapped IPv4 peer", peer: "::ffff:10.1.1.1", xff: []string{"198.51.100.7"}, wantIP: "198.51.100.7", wantKey: "198.51.100.7", scheme: "http"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			info, _ := p.Resolve(netip.MustParseAddr(tt.peer).Unmap(), tt.xff, tt.wantProto, "gw.example", false)
			if info.IP.String() != tt.wantIP || info.Key() != tt.wantKey || info.Scheme != tt.scheme {
				t.Fatalf("got %s key %s scheme %s, want %s key %s scheme %s", info.IP, info.Key(), info.Scheme, tt.wantIP, tt.wantKey, tt.scheme)
			}
		})
	}
}

func TestPublicHosts(t *testing.T) {
	p := mustPolicy(t, nil, "GW.example.com", "gw.example.com:8443", "127.0.0.1:8080", "[::1]:8080")
	for _, tt := range []struct {
		host, scheme string
		tls          bool
		want         string
		ok           bool
	}{
		{host: "gw.example.com", want: "gw.example.com", ok: true},
		{host: "GW.Example.COM.", want: "gw.example.com", ok: true},
		{host: "gw.example.com:80", want: "gw.example.com", ok: true},
		{host: "gw.example.com:443", tls: true, want: "gw.example.com", ok: true},
		{host: "gw.example.com:443", want: "gw.example.com:443", ok: false},
		{host: "gw.example.com:8443", want: "gw.example.com:8443", ok: true},
		{host: "gw.example.com:8444", want: "gw.example.com:8444", ok: false},
		{host: "127.0.0.1:8080", want: "127.0.0.1:8080", ok: true},
		{host: "127.0.0.1:8081", want: "127.0.0.1:8081", ok: false},
		{host: "[::1]:8080", want: "[::1]:8080", ok: true},
		{host: "evil.example", want: "evil.example", ok: false},
		{host: "", ok: false},
		{host: "gw.example.com:08080", ok: false},
		{host: "gw.example.com:99999", ok: false},
		{host: "gw example.com", ok: false},
		{host: "gw.example.com/x", ok: false},
		{host: "[::1", ok: false},
		{host: "[1.2.3.4]:80", ok: false},
	} {
		info, ok := p.Resolve(netip.MustParseAddr("192.0.2.1"), nil, nil, tt.host, tt.tls)
		if ok != tt.ok || (tt.want != "" && info.Host != tt.want) {
			t.Errorf("Host %q (tls %v): %q %v, want %q %v", tt.host, tt.tls, info.Host, ok, tt.want, tt.ok)
		}
	}
	if _, ok := mustPolicy(t, nil, "*").Resolve(netip.MustParseAddr("192.0.2.1"), nil, nil, "anything.example:1234", false); !ok {
		t.Fatal("* must accept any well-formed host")
	}
	if _, ok := mustPolicy(t, nil, "*").Resolve(netip.MustParseAddr("192.0.2.1"), nil, nil, "bad host", false); ok {
		t.Fatal("* must still refuse a malformed host")
	}
}

func TestAPolicyNeedsPublicHosts(t *testing.T) {
	if _, err := NewPolicy(Options{}); err == nil {
		t.Error("a policy without public hosts was accepted")
	}
}

// BenchmarkResolve is the per-request cost of the trust boundary: a
// trusted peer, two forwarding entries, a public host.
func BenchmarkResolve(b *testing.B) {
	p, _ := NewPolicy(Options{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, PublicHosts: []string{"gw.example.com"}})
	peer := netip.MustParseAddr("10.1.1.1")
	xff, xfp := []string{"198.51.100.7, 10.2.2.2"}, []string{"https"}
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := p.Resolve(peer, xff, xfp, "gw.example.com", false); !ok {
			b.Fatal("refused")
		}
	}
}
