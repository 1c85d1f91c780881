package config_test

import (
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

// In path mode the edge serves the admin view only on hosts that serve no
// sandbox (ADMIN_HOSTS), or refuses to start with administrators unless
// told to accept sharing their origin (ADMIN_ON_SANDBOX_HOSTS); each
// mistake names its variable.
func TestAdminHostsKeepTheAdminViewOffSandboxOrigins(t *testing.T) {
	const admin = "boss:3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f"
	sso := map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "ADMIN_GROUPS": "acme:ops"}
	with := func(m map[string]string, kv ...string) map[string]string {
		out := map[string]string{}
		for k, v := range m {
			out[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			out[kv[i]] = kv[i+1]
		}
		return out
	}
	for _, tt := range []struct {
		name   string
		env    map[string]string
		bad    string   // the variable the error must name; "" for success
		hosts  []string // AdminHosts on success
		anyway bool     // AdminOnSandboxHosts on success
	}{
		{"no administrators, path mode", nil, "", nil, false},
		{"administrators in path mode without an admin host", with(nil, "ADMIN_USERS", admin), "ADMIN_HOSTS", nil, false},
		{"admin groups in path mode without an admin host", sso, "ADMIN_HOSTS", nil, false},
		{"administrators on an admin host", with(nil, "ADMIN_USERS", admin, "ADMIN_HOSTS", "Admin.GW.example:443, localhost:9000"), "", []string{"admin.gw.example", "localhost:9000"}, false},
		{"admin groups on an admin host", with(sso, "ADMIN_HOSTS", "admin.gw.example"), "", []string{"admin.gw.example"}, false},
		{"the laptop switch", with(nil, "ADMIN_USERS", admin, "ADMIN_ON_SANDBOX_HOSTS", "true"), "", nil, true},
		{"the switch said no", with(nil, "ADMIN_USERS", admin, "ADMIN_ON_SANDBOX_HOSTS", "false"), "ADMIN_HOSTS", nil, false},
		{"the switch misspelt", with(nil, "ADMIN_USERS", admin, "ADMIN_ON_SANDBOX_HOSTS", "sure"), "ADMIN_ON_SANDBOX_HOSTS", nil, false},
		{"the switch and admin hosts", with(nil, "ADMIN_USERS", admin, "ADMIN_HOSTS", "admin.gw.example", "ADMIN_ON_SANDBOX_HOSTS", "true"), "ADMIN_ON_SANDBOX_HOSTS", nil, false},
		{"administrators in subdomain mode", with(nil, "ADMIN_USERS", admin, "SANDBOX_DOMAIN", "sbx.example"), "", nil, false},
		{"an admin host in subdomain mode", with(nil, "ADMIN_USERS", admin, "SANDBOX_DOMAIN", "sbx.example", "ADMIN_HOSTS", "admin.gw.example"), "", []string{"admin.gw.example"}, false},
		{"an admin host under the sandbox domain", with(nil, "ADMIN_USERS", admin, "SANDBOX_DOMAIN", "sbx.example", "ADMIN_HOSTS", "admin.SBX.example"), "ADMIN_HOSTS", nil, false},
		{"an admin host under the sandbox domain, ports canonical", with(nil, "SANDBOX_DOMAIN", "localhost:8080", "ADMIN_HOSTS", "ops.localhost:8080"), "ADMIN_HOSTS", nil, false},
		{"the sandbox domain's name on another port", with(nil, "SANDBOX_DOMAIN", "localhost:8080", "ADMIN_HOSTS", "ops.localhost:8081"), "", []string{"ops.localhost:8081"}, false},
		{"an admin host that is a public host", with(nil, "ADMIN_USERS", admin, "ADMIN_HOSTS", "gw.example:443"), "ADMIN_HOSTS", nil, false},
		{"an admin host that is a public host on its port", with(nil, "ADMIN_HOSTS", "LOCALHOST:8080"), "ADMIN_HOSTS", nil, false},
		{"any host as an admin host", with(nil, "ADMIN_USERS", admin, "ADMIN_HOSTS", "*"), "ADMIN_HOSTS", nil, false},
		{"a URL as an admin host", with(nil, "ADMIN_USERS", admin, "ADMIN_HOSTS", "https://admin.gw.example"), "ADMIN_HOSTS", nil, false},
		{"admin hosts beside any public host", with(nil, "ADMIN_USERS", admin, "PUBLIC_HOSTS", "*", "ADMIN_HOSTS", "admin.gw.example"), "", []string{"admin.gw.example"}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			env := with(tt.env)
			for k, v := range map[string]string{
				"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true", "OPEN_SIGNUP": "true",
				"PUBLIC_HOSTS": "GW.example:443, localhost:8080",
			} {
				if _, ok := env[k]; !ok {
					env[k] = v
				}
			}
			c, err := config.LoadEdge(config.FromMap(env))
			switch {
			case tt.bad == "" && err != nil:
				t.Fatal(err)
			case tt.bad != "" && (err == nil || !strings.Contains(err.Error(), tt.bad+":")):
				t.Fatalf("err = %v, want one naming %s", err, tt.bad)
			case tt.bad == "":
				if strings.Join(c.AdminHosts, ",") != strings.Join(tt.hosts, ",") || c.AdminOnSandboxHosts != tt.anyway {
					t.Fatalf("AdminHosts %q, AdminOnSandboxHosts %v; want %q, %v", c.AdminHosts, c.AdminOnSandboxHosts, tt.hosts, tt.anyway)
				}
			}
		})
	}
}
