package ident

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// CanonicalHost is host (a Host header or a URL's host[:port]) the way
// the edge compares hosts: lowercase, without a trailing dot or the
// scheme's default port; false when it is not a DNS name or IP literal
// with an optional port. With scheme "", both 80 and 443 are dropped
// (for configured entries).
func CanonicalHost(host, scheme string) (string, bool) {
	h := strings.ToLower(host)
	name, port := h, ""
	if strings.HasPrefix(h, "[") {
		end := strings.IndexByte(h, ']')
		if end < 0 {
			return "", false
		}
		name, port = h[:end+1], h[end+1:]
		if a, err := netip.ParseAddr(name[1 : len(name)-1]); err != nil || !a.Is6() {
			return "", false
		}
		if port != "" && port[0] != ':' {
			return "", false
		}
		port = strings.TrimPrefix(port, ":")
	} else if i := strings.LastIndexByte(h, ':'); i >= 0 {
		name, port = h[:i], h[i+1:]
	}
	name = strings.TrimSuffix(name, ".")
	if !strings.HasPrefix(name, "[") && !validName(name) {
		return "", false
	}
	if port != "" {
		n, err := strconv.Atoi(port)
		if err != nil || n < 1 || n > 65535 || port[0] == '0' {
			return "", false
		}
		if (port == "80" && scheme != "https") || (port == "443" && scheme != "http") {
			port = ""
		}
	}
	if port == "" {
		return name, true
	}
	return name + ":" + port, true
}

// validName: DNS labels of letters, digits and hyphens, or a dotted IPv4
// address (which is made of the same characters).
func validName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for label := range strings.SplitSeq(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// ParsePublicHost checks a PUBLIC_HOSTS entry and returns its canonical
// form: an entry may name port 80 or 443, which browsers leave out.
func ParsePublicHost(h string) (string, error) {
	c, ok := CanonicalHost(h, "")
	if !ok {
		return "", fmt.Errorf("%q is not a host name or host:port", h)
	}
	return c, nil
}

// ParseTrustedProxy reads a TRUSTED_PROXIES entry: a CIDR or one address.
func ParseTrustedProxy(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is neither a CIDR nor an address", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}
