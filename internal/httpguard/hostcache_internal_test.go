package httpguard

import (
	"strconv"
	"testing"
)

// The canonical-host cache holds at most maxCachedHosts per scheme however
// many hosts clients make up, keeps what it was last told, and never
// answers one scheme's lookup with the other's entry (a host's canonical
// form depends on the scheme's default port).
func TestHostCacheIsBoundedPerScheme(t *testing.T) {
	var h hostCache
	for i := range 3 * maxCachedHosts {
		raw := []byte("u" + strconv.Itoa(i) + ".sbx.test")
		h.put(raw, Info{Host: string(raw), Scheme: "http", Sandbox: "u" + strconv.Itoa(i)})
		if got, ok := h.get(raw, "http"); !ok || got.Host != string(raw) {
			t.Fatalf("%s just put: %+v %v", raw, got, ok)
		}
	}
	if n := len(h.m[schemeIndex("http")]); n > maxCachedHosts || n == 0 {
		t.Fatalf("%d hosts cached for http, bound %d", n, maxCachedHosts)
	}
	if _, ok := h.get([]byte("u0.sbx.test"), "http"); ok {
		t.Fatal("the oldest of three bounds' worth of hosts is still cached")
	}
	raw := []byte("gw.test:443")
	h.put(raw, Info{Host: "gw.test", Scheme: "https"})
	if _, ok := h.get(raw, "http"); ok {
		t.Fatal("an https entry answered an http lookup")
	}
	if got, ok := h.get(raw, "https"); !ok || got.Host != "gw.test" || got.IP.IsValid() {
		t.Fatalf("https lookup: %+v %v (the client's fields are never cached)", got, ok)
	}
}
