package config

import (
	"slices"
	"strconv"
)

// Preview is how the edge serves the web apps agents start in their
// sandboxes: port P of ann's sandbox at <P>-ann.<SANDBOX_DOMAIN>.
type Preview struct {
	// Ports is PREVIEW_PORTS, sorted: the sandbox ports a preview host may
	// name (empty: previews off). Any other port's host answers 404.
	Ports []int
	// Users is PREVIEW_ACCESS=users: any signed-in user may open any
	// sandbox's previews. The default, owner, admits the owner only.
	Users bool
}

// maxPreviewPorts bounds PREVIEW_PORTS: each is a rule in every sandbox's
// NetworkPolicy and a port a tenant's app may be reached on.
const maxPreviewPorts = 32

// Preview access modes, PREVIEW_ACCESS's values.
const (
	PreviewOwner = "owner"
	PreviewUsers = "users"
)

// loadPreview reads PREVIEW_PORTS and PREVIEW_ACCESS. DSH's own port is
// refused: its host would reach DSH without the handshake's cookie (DSH
// refuses every request), past the DSH origin's rules.
func loadPreview(e *Env) Preview {
	p := Preview{Users: e.OneOf("PREVIEW_ACCESS", PreviewOwner, PreviewOwner, PreviewUsers) == PreviewUsers}
	dsh := dshPort(e)
	for _, s := range e.List("PREVIEW_PORTS", nil) {
		n, err := strconv.Atoi(s)
		switch {
		case err != nil || n < 1 || n > 65535:
			e.Fail("PREVIEW_PORTS", "%q is not a port (1-65535)", s)
			continue
		case n == dsh:
			e.Fail("PREVIEW_PORTS", "%d is DSH_PORT: DSH is served on the user's own host, never as a preview", n)
			continue
		case slices.Contains(p.Ports, n):
			e.Fail("PREVIEW_PORTS", "%d is listed twice", n)
			continue
		}
		p.Ports = append(p.Ports, n)
	}
	if len(p.Ports) > maxPreviewPorts {
		e.Fail("PREVIEW_PORTS", "%d ports: list at most %d (each is a rule in every sandbox's NetworkPolicy)", len(p.Ports), maxPreviewPorts)
	}
	slices.Sort(p.Ports)
	return p
}

// Allows reports whether port is one of PREVIEW_PORTS.
func (p Preview) Allows(port int) bool {
	_, ok := slices.BinarySearch(p.Ports, port)
	return ok
}

// dshPort reads DSH_PORT, the port DSH listens on in every sandbox:
// lifecycle dials it, the edge keeps it out of PREVIEW_PORTS.
func dshPort(e *Env) int { return e.Int("DSH_PORT", 3080, 1, 65535) }
