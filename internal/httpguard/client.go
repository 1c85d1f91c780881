// Who is on the other end of a request, by the rules of the deployment's
// trust boundary.

package httpguard

import (
	"errors"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/gofiber/fiber/v2"
)

// Info is what the edge knows about a request's client.
type Info struct {
	// IP is the client's address: the peer, or the first address left of
	// our trusted proxies in X-Forwarded-For.
	IP netip.Addr
	// key is Key's, made on first use.
	key string
	// Scheme is http or https, as the browser used it.
	Scheme string
	// Host is the canonical public host (lowercase, no default port).
	Host string
	// OnSandboxDomain: Host is one label below SANDBOX_DOMAIN, a sandbox
	// origin's host or a name that could be one, so no gateway route
	// serves it. Sandbox is the user whose origin it is ("" when the
	// label names no one: nothing is served there), PreviewPort the
	// port of a preview origin (<port>-<user>), 0 for the user's DSH.
	OnSandboxDomain bool
	Sandbox         string
	PreviewPort     int
	// Gateway is the gateway's host (the first of PublicHosts), set on
	// requests to the sandbox domain: the edge's own pages there take
	// their stylesheet and sign-in link from it, as every path of a
	// sandbox origin is the tenant's.
	Gateway string
}

// Key names the client for rate limits: the IPv4 address, or the IPv6
// /64 (one subscriber's whole prefix). Made on first use: most requests
// are not rate-limited.
func (i *Info) Key() string {
	if i.key == "" {
		i.key = keyOf(i.IP)
	}
	return i.key
}

// hostCache remembers, per scheme, what resolve made of the hosts it
// accepted, so the canonical host of a request is a lookup, not a parse
// and a string. Bounded: a full cache starts over, so hosts a client makes
// up (every label below SANDBOX_DOMAIN is accepted) cost parses, never
// memory.
type hostCache struct {
	mu sync.RWMutex
	m  [2]map[string]Info // http, https
}

const maxCachedHosts = 4096

func schemeIndex(scheme string) int {
	if scheme == "https" {
		return 1
	}
	return 0
}

func (h *hostCache) get(raw []byte, scheme string) (Info, bool) {
	h.mu.RLock()
	v, ok := h.m[schemeIndex(scheme)][string(raw)]
	h.mu.RUnlock()
	return v, ok
}

// put keeps info's host fields (not the client's) for raw.
func (h *hostCache) put(raw []byte, info Info) {
	i := schemeIndex(info.Scheme)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.m[i] == nil || len(h.m[i]) >= maxCachedHosts {
		h.m[i] = make(map[string]Info, 64)
	}
	h.m[i][string(raw)] = Info{Host: info.Host, OnSandboxDomain: info.OnSandboxDomain, Sandbox: info.Sandbox, PreviewPort: info.PreviewPort, Gateway: info.Gateway}
}

// with is a cached host's Info for a client.
func (i Info) with(ip netip.Addr, scheme string) Info {
	i.IP, i.Scheme = ip, scheme
	return i
}

// Options is the trust boundary.
type Options struct {
	// TrustedProxies are the peers whose forwarding headers are believed.
	TrustedProxies []netip.Prefix
	// PublicHosts are the canonical hosts (see CanonicalHost) browsers
	// reach the gateway by; "*" accepts any. With a SandboxDomain the
	// first is the gateway's own host (see Info.Gateway) and must name one.
	PublicHosts []string
	// Unchecked paths (health probes, which use the pod's address) skip
	// the host check.
	Unchecked []string
	// SandboxDomain is SANDBOX_DOMAIN (canonical, "" in path mode): every
	// host one label below it is accepted and parsed by ParseSandboxHost.
	SandboxDomain string
}

// Policy applies Options to requests.
type Policy struct {
	trusted   []netip.Prefix
	hosts     map[string]bool
	anyHost   bool
	unchecked map[string]bool
	domain    string
	gateway   string
	// departures are the requests Run watches for clients that left.
	departures departures
	canon      hostCache
}

// NewPolicy validates o and returns its Policy.
func NewPolicy(o Options) (*Policy, error) {
	p := &Policy{trusted: o.TrustedProxies, hosts: map[string]bool{}, unchecked: map[string]bool{}}
	if o.SandboxDomain != "" {
		d, err := ident.ParsePublicHost(o.SandboxDomain)
		if err != nil {
			return nil, err
		}
		p.domain = d
	}
	for _, h := range o.PublicHosts {
		if h == "*" {
			p.anyHost = true
			continue
		}
		c, err := ident.ParsePublicHost(h)
		if err != nil {
			return nil, err
		}
		p.hosts[c] = true
	}
	if !p.anyHost && len(p.hosts) == 0 {
		return nil, errors.New("no public hosts")
	}
	if p.domain != "" {
		if o.PublicHosts[0] == "*" {
			return nil, errors.New("a sandbox domain needs the gateway's own host first in the public hosts, not *")
		}
		p.gateway, _ = ident.ParsePublicHost(o.PublicHosts[0])
	}
	for _, u := range o.Unchecked {
		p.unchecked[u] = true
	}
	return p, nil
}

const localsKey = "aaas.client"

// Middleware resolves every request's Info and refuses a Host that is not
// one of the public hosts with 421 Misdirected Request: the handshake with
// DSH, the same-origin checks and the redirects all depend on the host, so
// a client must not be able to choose it.
func (p *Policy) Middleware(c *fiber.Ctx) error {
	tls := c.Context().IsTLS()
	peer := addrOf(c.Context().RemoteAddr())
	hdr := &c.Request().Header
	var xff, xfp []string
	for _, v := range hdr.PeekAll(fiber.HeaderXForwardedFor) {
		xff = append(xff, string(v))
	}
	for _, v := range hdr.PeekAll(fiber.HeaderXForwardedProto) {
		xfp = append(xfp, string(v))
	}
	// The Info lives in the request's scope (Access), else on its own.
	var info *Info
	if s := scopeOf(c); s != nil {
		info, s.infoSet = &s.info, true
	} else {
		info = new(Info)
	}
	ok := p.resolve(info, peer, xff, xfp, c.Request().Host(), tls)
	if !ok && !p.unchecked[c.Path()] {
		return fiber.NewError(fiber.StatusMisdirectedRequest, "This gateway does not serve the host "+strconv.Quote(string(c.Request().Host()))+".")
	}
	c.Locals(localsKey, info)
	return c.Next()
}

// Resolve works out a request's Info from the connection's peer and the
// forwarding headers (all values in order). ok is false when host is not
// public.
func (p *Policy) Resolve(peer netip.Addr, xff, xfp []string, host string, tls bool) (Info, bool) {
	var info Info
	ok := p.resolve(&info, peer, xff, xfp, []byte(host), tls)
	return info, ok
}

func (p *Policy) resolve(info *Info, peer netip.Addr, xff, xfp []string, host []byte, tls bool) bool {
	*info = Info{IP: peer, Scheme: "http"}
	if tls {
		info.Scheme = "https"
	}
	if p.trustedPeer(peer) {
		info.IP = p.walk(peer, xff)
		// Traefik (and others) say ws or wss on a WebSocket upgrade: the
		// same schemes for every origin and cookie rule.
		switch lastToken(xfp) {
		case "http", "ws":
			info.Scheme = "http"
		case "https", "wss":
			info.Scheme = "https"
		}
	}
	if c, ok := p.canon.get(host, info.Scheme); ok {
		*info = c.with(info.IP, info.Scheme)
		return true
	}
	h, valid := ident.CanonicalHost(string(host), info.Scheme)
	info.Host = h
	if !valid {
		return false
	}
	ok := p.anyHost || p.hosts[h]
	if p.domain != "" {
		if label, found := strings.CutSuffix(h, "."+p.domain); found && label != "" && !strings.Contains(label, ".") {
			info.OnSandboxDomain, info.Gateway = true, p.gateway
			info.Sandbox, info.PreviewPort, _ = ParseSandboxHost(h, p.domain)
			ok = true
		}
	}
	if ok {
		p.canon.put(host, *info)
	}
	return ok
}

// ParseSandboxHost reads a canonical host (see CanonicalHost) as a sandbox
// origin's under the canonical domain: "<key>.<domain>" is the DSH (port
// 0) of the sandbox of that key (ident.SandboxKey: "<user>" for an
// account's first sandbox, "<user>--<name>" for a named one),
// "<port>-<key>.<domain>" a preview of that port. One label below the
// domain, so one wildcard certificate covers every origin. Keys start
// with a letter, so a label starting with a digit is never a key. ok is
// false for anything else: another depth, another domain, a port out of
// range or written with a leading zero, a key no account's sandbox can
// have.
func ParseSandboxHost(host, domain string) (key string, port int, ok bool) {
	label, found := strings.CutSuffix(host, "."+domain)
	if !found || domain == "" || label == "" || strings.Contains(label, ".") {
		return "", 0, false
	}
	if c := label[0]; c >= '0' && c <= '9' {
		digits, name, found := strings.Cut(label, "-")
		n, err := strconv.Atoi(digits)
		if !found || err != nil || digits[0] == '0' || n < 1 || n > 65535 || strconv.Itoa(n) != digits {
			return "", 0, false
		}
		port, label = n, name
	}
	if !ident.ValidSandboxKey(label) {
		return "", 0, false
	}
	return label, port, true
}

// SandboxHost is the host of the origin of the sandbox of key under
// domain (port 0: the DSH's, else that preview's): what ParseSandboxHost
// reads back.
func SandboxHost(key string, port int, domain string) string {
	if port != 0 {
		return strconv.Itoa(port) + "-" + key + "." + domain
	}
	return key + "." + domain
}

func (p *Policy) trustedPeer(a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	for _, t := range p.trusted {
		if t.Contains(a) {
			return true
		}
	}
	return false
}

// walk goes right to left through X-Forwarded-For: each entry was appended
// by the hop to its right, so it is believed while that hop is trusted. The
// first address that is not one of ours is the client; if an entry is not
// an address, the last trusted hop is the best we know.
func (p *Policy) walk(peer netip.Addr, xff []string) netip.Addr {
	addr := peer
	for i := len(xff) - 1; i >= 0; i-- {
		parts := strings.Split(xff[i], ",")
		for j := len(parts) - 1; j >= 0; j-- {
			if !p.trustedPeer(addr) {
				return addr
			}
			a, ok := parseForwarded(strings.TrimSpace(parts[j]))
			if !ok {
				return addr
			}
			addr = a
		}
	}
	return addr
}

// parseForwarded reads one X-Forwarded-For entry: an address, with a port
// or IPv6 brackets as some proxies write it.
func parseForwarded(s string) (netip.Addr, bool) {
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap(), true
	}
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap(), true
	}
	if a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(s, "["), "]")); err == nil {
		return a.Unmap(), true
	}
	return netip.Addr{}, false
}

func lastToken(values []string) string {
	if len(values) == 0 {
		return ""
	}
	parts := strings.Split(values[len(values)-1], ",")
	return strings.ToLower(strings.TrimSpace(parts[len(parts)-1]))
}

func addrOf(a net.Addr) netip.Addr {
	if t, ok := a.(*net.TCPAddr); ok {
		if ip, ok := netip.AddrFromSlice(t.IP); ok {
			return ip.Unmap()
		}
	}
	if ap, err := netip.ParseAddrPort(a.String()); err == nil {
		return ap.Addr().Unmap()
	}
	return netip.Addr{}
}

// keyOf is the rate-limit key of an address: IPv6 clients get a /64 each
// (one subscriber), so rotating addresses inside it buys nothing.
func keyOf(a netip.Addr) string {
	if !a.IsValid() {
		return "unknown"
	}
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.String()
	}
	return a.String()
}

// Get is the request's Info; without the middleware (unit tests of other
// packages) it is the untrusted view: the peer, plain http, the raw Host.
func Get(c *fiber.Ctx) *Info {
	if i, ok := c.Locals(localsKey).(*Info); ok {
		return i
	}
	peer := addrOf(c.Context().RemoteAddr())
	h, _ := ident.CanonicalHost(string(c.Request().Host()), "http")
	return &Info{IP: peer, Scheme: "http", Host: h}
}

// IP is the client's address as text.
func IP(c *fiber.Ctx) string { return Get(c).IP.String() }

// Key is the client's rate-limit key.
func Key(c *fiber.Ctx) string { return Get(c).Key() }

// Scheme is how the browser reached us.
func Scheme(c *fiber.Ctx) string { return Get(c).Scheme }

// Host is the canonical public host the request was made to.
func Host(c *fiber.Ctx) string { return Get(c).Host }

// HasBody reports whether the request carries a body (a length or chunks).
func HasBody(c *fiber.Ctx) bool {
	n := c.Request().Header.ContentLength()
	return n > 0 || n == -1
}

// SameOrigin reports whether a request comes from this gateway's own
// pages: its Origin (or, without one, its Referer) has the request's scheme
// and host, or, naming neither, the browser says Sec-Fetch-Site:
// same-origin. A request with none of them is not same-origin.
func SameOrigin(c *fiber.Ctx) bool {
	origin := c.Get(fiber.HeaderOrigin)
	if origin == "" || origin == "null" {
		if c.Get("Sec-Fetch-Site") == "same-origin" {
			return true
		}
		origin = c.Get(fiber.HeaderReferer)
	}
	if origin == "" {
		return false
	}
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" {
		return false
	}
	info := Get(c)
	scheme := strings.ToLower(u.Scheme)
	h, ok := ident.CanonicalHost(u.Host, scheme)
	return ok && scheme == info.Scheme && h == info.Host
}

// CrossSite reports a browser request made by a page of another origin:
// Fetch Metadata says another site or a sibling host sent it (Sec-Fetch-Site
// cross-site or same-site: sandbox origins are the gateway's siblings), or
// it names an Origin that is not ours. An address typed or bookmarked
// (none), our own pages, and clients that send neither are not.
func CrossSite(c *fiber.Ctx) bool {
	switch c.Get("Sec-Fetch-Site") {
	case "cross-site", "same-site":
		return true
	}
	return c.Get(fiber.HeaderOrigin) != "" && !SameOrigin(c)
}

// ForeignOrigin reports a request that names an origin other than ours;
// one that names none is not foreign (API clients send neither).
func ForeignOrigin(c *fiber.Ctx) bool {
	if c.Get(fiber.HeaderOrigin) == "" && c.Get(fiber.HeaderReferer) == "" && c.Get("Sec-Fetch-Site") == "" {
		return false
	}
	return !SameOrigin(c)
}
