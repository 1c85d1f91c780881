package broker

import (
	"net/netip"
	"sync"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Attribution reasons: the refusal metric's labels when a connection's
// address names no single running sandbox.
const (
	// ReasonUnattributed: no Ready sandbox has the address (a spare, a
	// suspended sandbox's old address, anything unknown).
	ReasonUnattributed = "unattributed"
	// ReasonAmbiguous: more than one Ready record claims the address
	// (records lag a reused IP); nobody is charged for a call that might
	// be another's.
	ReasonAmbiguous = "ambiguous"
)

// Index maps a Ready sandbox's pod IP to its user, kept current from the
// sandboxes bucket's watch (Watch). The pod IP is the one fact about a
// call a tenant cannot forge: a restricted pod has no NET_RAW or
// NET_ADMIN and sends from its own address only.
type Index struct {
	mu     sync.RWMutex
	byUser map[string]netip.Addr
	claims map[netip.Addr]map[string]struct{}
}

// NewIndex is an empty index.
func NewIndex() *Index {
	return &Index{byUser: map[string]netip.Addr{}, claims: map[netip.Addr]map[string]struct{}{}}
}

// Watch is the cache option that keeps the index current: give it to
// kv.NewCache of the sandboxes bucket.
func (x *Index) Watch() kv.CacheOption[state.Sandbox] {
	return kv.OnChange(func(user string, e kv.Entry[state.Sandbox], deleted bool) {
		var ip netip.Addr
		if !deleted {
			ip = readyIP(e.Value)
		}
		x.Set(user, ip)
	})
}

// readyIP is the address a record vouches for: a Ready sandbox's pod IP
// in canonical form, or none.
func readyIP(s state.Sandbox) netip.Addr {
	if s.Phase != state.PhaseReady || s.PodIP == "" {
		return netip.Addr{}
	}
	ip, err := netip.ParseAddr(s.PodIP)
	if err != nil {
		return netip.Addr{}
	}
	return canonical(ip)
}

// canonical makes the forms of one address equal: IPv4-mapped IPv6
// (::ffff:10.0.0.1, how a dual-stack listener sees IPv4 peers) becomes
// IPv4, and zones are dropped (a pod's address has none that matters).
func canonical(ip netip.Addr) netip.Addr { return ip.Unmap().WithZone("") }

// Set records that user's sandbox vouches for ip (the zero Addr: for
// none).
func (x *Index) Set(user string, ip netip.Addr) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if old, ok := x.byUser[user]; ok {
		if old == ip {
			return
		}
		delete(x.claims[old], user)
		if len(x.claims[old]) == 0 {
			delete(x.claims, old)
		}
		delete(x.byUser, user)
	}
	if !ip.IsValid() {
		return
	}
	x.byUser[user] = ip
	if x.claims[ip] == nil {
		x.claims[ip] = map[string]struct{}{}
	}
	x.claims[ip][user] = struct{}{}
}

// Lookup is the user whose call comes from ip, or the refusal reason.
func (x *Index) Lookup(ip netip.Addr) (user, reason string) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	users := x.claims[canonical(ip)]
	switch len(users) {
	case 0:
		return "", ReasonUnattributed
	case 1:
		for u := range users {
			return u, ""
		}
	}
	return "", ReasonAmbiguous
}

// peer is the TCP peer address of a request's connection, from
// RemoteAddr, which net/http sets from the socket and nothing the client
// sends changes.
func peer(remoteAddr string) (netip.Addr, bool) {
	ap, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return netip.Addr{}, false
	}
	return canonical(ap.Addr()), true
}
