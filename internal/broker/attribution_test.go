package broker

import (
	"net/netip"
	"testing"

	"github.com/aaas-project/aaas/internal/state"
)

func TestIndex(t *testing.T) {
	ready := func(ip string) state.Sandbox { return state.Sandbox{Phase: state.PhaseReady, PodIP: ip} }
	type rec struct {
		user string
		box  state.Sandbox
		gone bool // deleted after being put
	}
	for _, tc := range []struct {
		name          string
		records       []rec
		peer          string
		user, refusal string
	}{
		{"ready sandbox", []rec{{"ann", ready("10.0.0.5"), false}}, "10.0.0.5:43122", "ann", ""},
		{"spare: no record", []rec{{"ann", ready("10.0.0.5"), false}}, "10.0.0.6:1", "", ReasonUnattributed},
		{"suspended keeps an old address", []rec{{"ann", state.Sandbox{Phase: state.PhaseSuspended, PodIP: "10.0.0.5"}, false}}, "10.0.0.5:1", "", ReasonUnattributed},
		{"waking", []rec{{"ann", state.Sandbox{Phase: state.PhaseWaking, PodIP: "10.0.0.5"}, false}}, "10.0.0.5:1", "", ReasonUnattributed},
		{"deleted record", []rec{{"ann", ready("10.0.0.5"), true}}, "10.0.0.5:1", "", ReasonUnattributed},
		{"two records on one address", []rec{{"ann", ready("10.0.0.5"), false}, {"bob", ready("10.0.0.5"), false}}, "10.0.0.5:1", "", ReasonAmbiguous},
		{"address reused by a newer pod, old record updated away", []rec{{"ann", ready("10.0.0.5"), false}, {"bob", ready("10.0.0.5"), false}, {"ann", ready("10.0.0.7"), false}}, "10.0.0.5:1", "bob", ""},
		{"IPv6", []rec{{"ann", ready("fd00::5"), false}}, "[fd00::5]:8080", "ann", ""},
		{"IPv6 written long", []rec{{"ann", ready("fd00:0:0:0:0:0:0:5"), false}}, "[fd00::5]:8080", "ann", ""},
		{"IPv6 with a zone", []rec{{"ann", ready("fe80::1"), false}}, "[fe80::1%eth0]:8080", "ann", ""},
		{"IPv4-mapped IPv6 peer", []rec{{"ann", ready("10.0.0.5"), false}}, "[::ffff:10.0.0.5]:9", "ann", ""},
		{"IPv4-mapped IPv6 record", []rec{{"ann", ready("::ffff:10.0.0.5"), false}}, "10.0.0.5:9", "ann", ""},
		{"other IPv6", []rec{{"ann", ready("fd00::5"), false}}, "[fd00::6]:1", "", ReasonUnattributed},
		{"garbage record address", []rec{{"ann", ready("10.0.0.5, 10.0.0.6"), false}}, "10.0.0.5:1", "", ReasonUnattributed},
		{"no port in the peer", []rec{{"ann", ready("10.0.0.5"), false}}, "10.0.0.5", "", ReasonUnattributed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := NewIndex()
			for _, r := range tc.records {
				x.Set(r.user, readyIP(r.box))
				if r.gone {
					x.Set(r.user, netip.Addr{})
				}
			}
			user, reason := "", ReasonUnattributed
			if ip, ok := peer(tc.peer); ok {
				user, reason = x.Lookup(ip)
			}
			if user != tc.user || reason != tc.refusal {
				t.Fatalf("got (%q, %q), want (%q, %q)", user, reason, tc.user, tc.refusal)
			}
		})
	}
}
