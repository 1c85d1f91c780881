package config

import (
	"slices"
	"strings"

	"github.com/aaas-project/aaas/internal/ident"
)

// AdminPlacement is where the edge serves the admin view and API
// (/_/admin…). In path mode (SANDBOX_DOMAIN empty) every sandbox is served
// under /u/<user>/ on the gateway's own hosts, so a page an agent wrote,
// opened by an administrator, is same-origin with the admin view and can
// drive it with the administrator's cookie (security review S1). Keeping
// the admin view on hosts that serve no sandbox gives it an origin no
// tenant page shares.
type AdminPlacement struct {
	// AdminHosts is ADMIN_HOSTS, canonical (as PUBLIC_HOSTS): when set,
	// the only hosts that serve /_/admin…, and hosts that serve no /u/
	// route. The edge accepts them besides PUBLIC_HOSTS; they may not be
	// PUBLIC_HOSTS entries or hosts under SANDBOX_DOMAIN.
	AdminHosts []string
	// AdminOnSandboxHosts is ADMIN_ON_SANDBOX_HOSTS: in path mode without
	// ADMIN_HOSTS, serve the admin view on the hosts that serve sandboxes
	// anyway, accepting that risk (a laptop with trusted agents). Without
	// it the edge refuses to start with administrators configured.
	AdminOnSandboxHosts bool
}

// loadAdminPlacement reads ADMIN_HOSTS and ADMIN_ON_SANDBOX_HOSTS and
// refuses an edge that would serve the admin view on the origin of the
// sandboxes without being told to. It needs c's PUBLIC_HOSTS, ADMIN_USERS
// and ADMIN_GROUPS read.
func loadAdminPlacement(e *Env, c *Edge) AdminPlacement {
	p := AdminPlacement{AdminOnSandboxHosts: e.Bool("ADMIN_ON_SANDBOX_HOSTS", false)}
	domain := e.String("SANDBOX_DOMAIN", "")
	domainName, domainPort := "", ""
	if d, ok := ident.CanonicalHost(domain, ""); ok {
		domainName, domainPort = splitPort(d)
	}
	for _, h := range e.List("ADMIN_HOSTS", nil) {
		if h == "*" {
			e.Fail("ADMIN_HOSTS", "* is not a host: name the hosts that serve the admin view (and no sandbox)")
			continue
		}
		a, err := ident.ParsePublicHost(h)
		if err != nil {
			e.Fail("ADMIN_HOSTS", "%v", err)
			continue
		}
		if slices.Contains(c.PublicHosts, a) {
			e.Fail("ADMIN_HOSTS", "%q is also in PUBLIC_HOSTS, whose hosts serve sandboxes; an admin host must be one that serves none", a)
			continue
		}
		if name, port := splitPort(a); domainName != "" && port == domainPort && strings.HasSuffix(name, "."+domainName) {
			e.Fail("ADMIN_HOSTS", "%q is under SANDBOX_DOMAIN (%s), where every host is a sandbox's", a, domain)
			continue
		}
		p.AdminHosts = append(p.AdminHosts, a)
	}
	admins := len(c.AdminUsers) > 0 || len(c.AdminGroups) > 0
	switch {
	case p.AdminOnSandboxHosts && e.Set("ADMIN_HOSTS"):
		e.Fail("ADMIN_ON_SANDBOX_HOSTS", "set together with ADMIN_HOSTS, which serve the admin view and no sandbox; unset one of them")
	case admins && domain == "" && !e.Set("ADMIN_HOSTS") && !p.AdminOnSandboxHosts:
		e.Fail("ADMIN_HOSTS", "required with ADMIN_USERS or ADMIN_GROUPS while SANDBOX_DOMAIN is empty: "+
			"every sandbox is then served on the gateway's own hosts, where a page an agent wrote, opened by an administrator, "+
			"can use the admin view with the administrator's cookie. Set SANDBOX_DOMAIN (each sandbox on its own origin), "+
			"or ADMIN_HOSTS (hosts that serve the admin view and no sandbox), "+
			"or ADMIN_ON_SANDBOX_HOSTS=true to accept that risk (a laptop only)")
	}
	return p
}

// splitPort cuts a canonical host into its name and port ("" for none).
func splitPort(h string) (string, string) {
	if i := strings.LastIndexByte(h, ':'); i >= 0 && !strings.HasSuffix(h, "]") {
		return h[:i], h[i+1:]
	}
	return h, ""
}
