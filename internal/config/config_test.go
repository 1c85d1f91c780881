package config_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/config"
)

func TestDurationsAcceptGoSyntaxAndSeconds(t *testing.T) {
	e := config.FromMap(map[string]string{"A": "90s", "B": "900", "C": "1.5"})
	if d := e.Duration("A", 0, 0, time.Hour); d != 90*time.Second {
		t.Errorf("A = %s", d)
	}
	if d := e.Duration("B", 0, 0, time.Hour); d != 15*time.Minute {
		t.Errorf("B = %s", d)
	}
	if d := e.Duration("C", 0, 0, time.Hour); d != 1500*time.Millisecond {
		t.Errorf("C = %s", d)
	}
	if d := e.Duration("UNSET", time.Minute, 0, time.Hour); d != time.Minute {
		t.Errorf("default = %s", d)
	}
	if err := e.Err(); err != nil {
		t.Fatal(err)
	}
}

func TestEveryBadVariableIsNamed(t *testing.T) {
	e := config.FromMap(map[string]string{
		"STREAM_REPLICAS": "9",
		"LOG_LEVEL":       "loud",
		"AUDIT_MAX_AGE":   "soon",
		"INSTANCE_ID":     "a.b",
	})
	_, err := config.LoadSweeper(e)
	if err == nil {
		t.Fatal("bad configuration accepted")
	}
	for _, name := range []string{"STREAM_REPLICAS", "LOG_LEVEL", "AUDIT_MAX_AGE", "INSTANCE_ID"} {
		if !strings.Contains(err.Error(), name+":") {
			t.Errorf("error does not name %s: %v", name, err)
		}
	}
}

func TestSecretsAreNotEchoed(t *testing.T) {
	e := config.FromMap(map[string]string{"N": "hunter2"})
	e.Int("N", 0, 0, 1)
	if err := e.Err(); err == nil || !strings.Contains(err.Error(), "N:") {
		t.Fatalf("err = %v", err)
	}
	if got := e.Secret("N"); got != "hunter2" {
		t.Fatalf("secret = %q", got)
	}
}

func TestDefaults(t *testing.T) {
	c, err := config.LoadLifecycle(config.FromMap(map[string]string{"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true"}))
	if err != nil {
		t.Fatal(err)
	}
	if c.SandboxNamespace != "aaas-sandboxes" || c.ControlPlaneNamespace != "aaas" || c.ManagedKey != "aaas.example.com/managed-by" || c.ManagedValue != "dsh-gateway" || c.Port != 3080 {
		t.Fatalf("lifecycle defaults = %+v", c)
	}
	if c.NATSURL != "nats://127.0.0.1:4222" || c.Streams.Replicas != 1 || c.InstanceID == "" {
		t.Fatalf("defaults = %+v", c.Common)
	}
}

// ROLLOUT_GROUPS are read as the edges keep a user's groups (trimmed,
// lower case), so they compare equal; what is no group name is refused.
func TestRolloutGroups(t *testing.T) {
	env := map[string]string{"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true", "ROLLOUT_PERCENT": "0", "ROLLOUT_GROUPS": " Early-Adopters ,acme:ML"}
	c, err := config.LoadLifecycle(config.FromMap(env))
	if err != nil || strings.Join(c.RolloutGroups, " ") != "early-adopters acme:ml" || c.RolloutPercent != 0 {
		t.Fatalf("ROLLOUT_GROUPS %q: %v %v (percent %d)", env["ROLLOUT_GROUPS"], c.RolloutGroups, err, c.RolloutPercent)
	}
	for _, bad := range []string{"ops,\x01bell", strings.Repeat("g", 300)} {
		env["ROLLOUT_GROUPS"] = bad
		if _, err := config.LoadLifecycle(config.FromMap(env)); err == nil || !strings.Contains(err.Error(), "ROLLOUT_GROUPS:") {
			t.Errorf("ROLLOUT_GROUPS %q: %v", bad, err)
		}
	}
}

func TestLifecycleRequiresAHandshakeKeyAndAValidLabel(t *testing.T) {
	_, err := config.LoadLifecycle(config.FromMap(map[string]string{"MANAGED_BY_LABEL": "no-value", "HANDSHAKE_KEYS": "c2hvcnQ="}))
	if err == nil || !strings.Contains(err.Error(), "HANDSHAKE_KEYS:") || !strings.Contains(err.Error(), "MANAGED_BY_LABEL:") {
		t.Fatalf("err = %v", err)
	}
	if strings.Contains(err.Error(), "c2hvcnQ=") {
		t.Fatal("the key's value was echoed in the error")
	}
}

func TestEdgeRefusesInsecureCookiesUnlessAllowed(t *testing.T) {
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	_, err := config.LoadEdge(config.FromMap(map[string]string{"COOKIE_SECURE": "false", "HANDSHAKE_KEYS": key}))
	if err == nil || !strings.Contains(err.Error(), "COOKIE_SECURE:") || !strings.Contains(err.Error(), "ALLOW_INSECURE_COOKIES") {
		t.Fatalf("err = %v", err)
	}
	c, err := config.LoadEdge(config.FromMap(map[string]string{"COOKIE_SECURE": "false", "ALLOW_INSECURE_COOKIES": "1", "HANDSHAKE_KEYS": key, "OPEN_SIGNUP": "true", "NATS_ALLOW_ANONYMOUS": "true", "PUBLIC_HOSTS": "localhost:8080"}))
	if err != nil || c.CookieSecure {
		t.Fatalf("allowed insecure: %+v %v", c, err)
	}
	d, err := config.LoadEdge(config.FromMap(map[string]string{"HANDSHAKE_KEYS": key, "SIGNUP_INVITE_CODE": "x", "NATS_ALLOW_ANONYMOUS": "true", "PUBLIC_HOSTS": "gw.example"}))
	if err != nil || !d.CookieSecure || d.MaxInFlightPerUser != 32 || d.WSMaxMessageBytes != 16<<20 || d.AuthRateLimit != 30 {
		t.Fatalf("defaults: %+v %v", d, err)
	}
}

// TestREADMEDocumentsEveryVariable keeps the configuration tables complete.
func TestREADMEDocumentsEveryVariable(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob("*.go")
	re := regexp.MustCompile(`e\.(?:String|Int|Bool|Duration|List|OneOf|Secret|Set)\("([A-Z][A-Z0-9_]+)"`)
	seen := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, _ := os.ReadFile(f)
		for _, m := range re.FindAllStringSubmatch(string(src), -1) {
			seen++
			if !strings.Contains(string(readme), "`"+m[1]+"`") {
				t.Errorf("%s is read in %s but not documented in README.md", m[1], f)
			}
		}
	}
	if seen < 30 {
		t.Fatalf("found only %d variables; the pattern is stale", seen)
	}
}

func TestVariablesListsWhatEveryProcessReads(t *testing.T) {
	got := strings.Join(config.Variables(), " ")
	for _, v := range []string{"NATS_URL", "LISTEN_ADDR", "ALLOW_INSECURE_COOKIES", "HANDSHAKE_KEYS", "NAMESPACE", "IDLE_TIMEOUT", "SWEEP_INTERVAL", "COOKIE_MAX_AGE"} {
		if !strings.Contains(" "+got+" ", " "+v+" ") {
			t.Errorf("Variables() lacks %s: %s", v, got)
		}
	}
}

// An empty invite (a missing Secret key, say) must not open signup by
// accident: it takes OPEN_SIGNUP, or SSO, which provisions its own users.
func TestEdgeRefusesOpenSignupUnlessAsked(t *testing.T) {
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	for _, tt := range []struct {
		env map[string]string
		ok  bool
	}{
		{map[string]string{}, false},
		{map[string]string{"SIGNUP_INVITE_CODE": "  "}, false},
		{map[string]string{"OPEN_SIGNUP": "false"}, false},
		{map[string]string{"OPEN_SIGNUP": "true"}, true},
		{map[string]string{"SIGNUP_INVITE_CODE": "abc"}, true},
		{map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*"}, true},
	} {
		tt.env["HANDSHAKE_KEYS"] = key
		tt.env["NATS_ALLOW_ANONYMOUS"] = "true"
		tt.env["PUBLIC_HOSTS"] = "gw.example"
		_, err := config.LoadEdge(config.FromMap(tt.env))
		if (err == nil) != tt.ok {
			t.Errorf("%v: err = %v", tt.env, err)
		}
		if err != nil && !strings.Contains(err.Error(), "SIGNUP_INVITE_CODE:") {
			t.Errorf("%v: the error does not name the variable: %v", tt.env, err)
		}
	}
}

// The edge's trust boundary is explicit: which hosts it serves, which
// peers are its proxies, whom SSO admits. Each mistake is refused at start
// and names its variable.
func TestEdgeTrustBoundary(t *testing.T) {
	base := map[string]string{
		"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true", "OPEN_SIGNUP": "true",
		"PUBLIC_HOSTS": "GW.example:443, localhost:8080",
	}
	for _, tt := range []struct {
		name string
		env  map[string]string
		bad  string // the variable the error must name; "" for success
	}{
		{"defaults", nil, ""},
		{"no public hosts", map[string]string{"PUBLIC_HOSTS": ""}, "PUBLIC_HOSTS"},
		{"a URL is not a host", map[string]string{"PUBLIC_HOSTS": "https://gw.example"}, "PUBLIC_HOSTS"},
		{"any host, said explicitly", map[string]string{"PUBLIC_HOSTS": "*"}, ""},
		{"proxies as CIDRs and addresses", map[string]string{"TRUSTED_PROXIES": "10.0.0.0/8, 192.0.2.1, fd00::/8"}, ""},
		{"a proxy by name", map[string]string{"TRUSTED_PROXIES": "ingress.example"}, "TRUSTED_PROXIES"},
		{"SSO without an allow list", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User"}, "AUTH_PROXY_ALLOW"},
		{"SSO with an allow list", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "alice,group:acme:devs"}, ""},
		{"admins bound to their identities", map[string]string{"ADMIN_USERS": "boss:3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f, ops-1:3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F3F", "ADMIN_HOSTS": "admin.gw.example"}, ""},
		{"an admin by name alone", map[string]string{"ADMIN_USERS": "boss"}, "ADMIN_USERS"},
		{"an admin identity that is not a SHA-256", map[string]string{"ADMIN_USERS": "boss:3f3f"}, "ADMIN_USERS"},
		{"an admin name no account can have", map[string]string{"ADMIN_USERS": "Root:3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f"}, "ADMIN_USERS"},
		{"refusal audit limit", map[string]string{"REFUSAL_AUDIT_LIMIT": "0"}, "REFUSAL_AUDIT_LIMIT"},
		{"admin groups without SSO", map[string]string{"ADMIN_GROUPS": "ops"}, "ADMIN_GROUPS"},
		{"admin groups with SSO", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "ADMIN_GROUPS": "acme:ops", "ADMIN_HOSTS": "admin.gw.example"}, ""},
		{"bad id header", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_ID_HEADER": "X Email"}, "AUTH_PROXY_ID_HEADER"},
		{"session cap", map[string]string{"MAX_SESSIONS_PER_USER": "0"}, "MAX_SESSIONS_PER_USER"},
		{"SSO sign-out at the proxy", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_SIGN_OUT_URL": "/oauth2/sign_out?rd=%2F"}, ""},
		{"SSO sign-out at the provider", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_SIGN_OUT_URL": "https://sso.example/logout"}, ""},
		{"sign-out without SSO", map[string]string{"AUTH_PROXY_SIGN_OUT_URL": "/oauth2/sign_out"}, "AUTH_PROXY_SIGN_OUT_URL"},
		{"sign-out to another site's path", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_SIGN_OUT_URL": "//evil.example/x"}, "AUTH_PROXY_SIGN_OUT_URL"},
		{"sign-out over plain http", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_SIGN_OUT_URL": "http://sso.example/logout"}, "AUTH_PROXY_SIGN_OUT_URL"},
		{"sign-out as a script", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_SIGN_OUT_URL": "javascript:alert(1)"}, "AUTH_PROXY_SIGN_OUT_URL"},
		{"sign-out with a backslash", map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*", "AUTH_PROXY_SIGN_OUT_URL": "/\\evil.example"}, "AUTH_PROXY_SIGN_OUT_URL"},
		{"sandbox domain", map[string]string{"SANDBOX_DOMAIN": "Sandboxes.Example:443"}, ""},
		{"sandbox domain with a local port", map[string]string{"SANDBOX_DOMAIN": "localhost:8080", "PUBLIC_HOSTS": "localhost:8080"}, ""},
		{"sandbox domain as a URL", map[string]string{"SANDBOX_DOMAIN": "https://sbx.example"}, "SANDBOX_DOMAIN"},
		{"sandbox domain as an address", map[string]string{"SANDBOX_DOMAIN": "127.0.0.1:8080"}, "SANDBOX_DOMAIN"},
		{"a gateway host under the sandbox domain", map[string]string{"SANDBOX_DOMAIN": "example"}, "SANDBOX_DOMAIN"},
		{"any host with a sandbox domain", map[string]string{"SANDBOX_DOMAIN": "sbx.example", "PUBLIC_HOSTS": "*"}, "SANDBOX_DOMAIN"},
		{"sign-in codes for a minute", map[string]string{"SIGNIN_CODE_TTL": "60s"}, ""},
		{"sign-in codes for longer", map[string]string{"SIGNIN_CODE_TTL": "61s"}, "SIGNIN_CODE_TTL"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			env := map[string]string{}
			for k, v := range base {
				env[k] = v
			}
			for k, v := range tt.env {
				env[k] = v
			}
			c, err := config.LoadEdge(config.FromMap(env))
			switch {
			case tt.bad == "" && err != nil:
				t.Fatal(err)
			case tt.bad != "" && (err == nil || !strings.Contains(err.Error(), tt.bad+":")):
				t.Fatalf("err = %v, want one naming %s", err, tt.bad)
			case tt.bad == "" && tt.env == nil:
				if strings.Join(c.PublicHosts, ",") != "gw.example,localhost:8080" || len(c.TrustedProxies) != 0 || c.MaxSessionsPerUser != 20 || c.AuthProxyIDHeader != "X-Forwarded-Email" ||
					c.SandboxDomain != "" || c.Buckets.SigninCodeTTL != 30*time.Second {
					t.Fatalf("defaults: %+v", c)
				}
			case tt.name == "sandbox domain":
				if c.SandboxDomain != "sandboxes.example" {
					t.Fatalf("SANDBOX_DOMAIN read as %q", c.SandboxDomain)
				}
			}
		})
	}
}

func TestNATSIdentityIsRequired(t *testing.T) {
	dir := t.TempDir()
	seed := filepath.Join(dir, "edge.nk")
	if err := os.WriteFile(seed, []byte("SU..."), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		env  map[string]string
		want string // "" for no error
	}{
		{map[string]string{}, "NATS_NKEY: no NATS identity"},
		{map[string]string{"NATS_NKEY": seed}, ""},
		{map[string]string{"NATS_ALLOW_ANONYMOUS": "true"}, ""},
		{map[string]string{"NATS_NKEY": seed, "NATS_CREDS": seed}, "NATS_NKEY: set NATS_NKEY or NATS_CREDS, not both"},
		{map[string]string{"NATS_NKEY": filepath.Join(dir, "missing.nk")}, "NATS_NKEY: cannot read"},
		{map[string]string{"NATS_NKEY": seed, "NATS_CERT": seed}, "NATS_CERT: NATS_CERT and NATS_KEY go together"},
		{map[string]string{"NATS_NKEY": seed, "NATS_CA": filepath.Join(dir, "ca.pem")}, "NATS_CA: cannot read"},
	} {
		_, err := config.LoadSweeper(config.FromMap(tt.env))
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("%v: err = %v, want %q", tt.env, err, tt.want)
		}
	}
}

func TestHandshakeKeysAreARing(t *testing.T) {
	a, b := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", strings.Repeat("ab", 32)
	c, err := config.LoadLifecycle(config.FromMap(map[string]string{"HANDSHAKE_KEYS": b + ", " + a, "NATS_ALLOW_ANONYMOUS": "true"}))
	if err != nil || len(c.HandshakeKeys) != 2 || c.HandshakeKeys[0][0] != 0xab {
		t.Fatalf("ring %v: %v", c.HandshakeKeys, err)
	}
	for env, want := range map[string]string{
		a + ",c2hvcnQ=":              "HANDSHAKE_KEYS: key 2",
		strings.Repeat(a+",", 5) + a: "keep at most 4",
	} {
		_, err := config.LoadLifecycle(config.FromMap(map[string]string{"HANDSHAKE_KEYS": env, "NATS_ALLOW_ANONYMOUS": "true"}))
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "c2hvcnQ=") {
			t.Errorf("%q: err = %v, want %q without the key", env, err, want)
		}
	}
	_, err = config.LoadLifecycle(config.FromMap(map[string]string{"HANDSHAKE_KEY": a, "HANDSHAKE_KEYS": a, "NATS_ALLOW_ANONYMOUS": "true"}))
	if err == nil || !strings.Contains(err.Error(), "HANDSHAKE_KEY: renamed HANDSHAKE_KEYS") {
		t.Fatalf("the old name: %v", err)
	}
}

// Handshakes talk to tenants' pods: by default they may hold half the
// command workers, and never all of them when there are more than one.
func TestHandshakeWorkersLeaveWorkersToOtherCommands(t *testing.T) {
	base := map[string]string{"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "NATS_ALLOW_ANONYMOUS": "true"}
	load := func(extra map[string]string) (config.Lifecycle, error) {
		env := map[string]string{}
		for k, v := range base {
			env[k] = v
		}
		for k, v := range extra {
			env[k] = v
		}
		return config.LoadLifecycle(config.FromMap(env))
	}
	for _, tc := range []struct {
		env  map[string]string
		want int
		err  string
	}{
		{env: nil, want: 8},
		{env: map[string]string{"COMMAND_WORKERS": "1"}, want: 1},
		{env: map[string]string{"COMMAND_WORKERS": "3"}, want: 1},
		{env: map[string]string{"COMMAND_WORKERS": "4", "HANDSHAKE_WORKERS": "3"}, want: 3},
		{env: map[string]string{"COMMAND_WORKERS": "4", "HANDSHAKE_WORKERS": "4"}, err: "HANDSHAKE_WORKERS: 4 leaves none of the 4 COMMAND_WORKERS"},
		{env: map[string]string{"COMMAND_WORKERS": "1", "HANDSHAKE_WORKERS": "2"}, err: "HANDSHAKE_WORKERS: 2 is more than the one"},
		{env: map[string]string{"HANDSHAKE_WORKERS": "0"}, err: "HANDSHAKE_WORKERS: 0 is outside"},
	} {
		c, err := load(tc.env)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%v: err %v, want %q", tc.env, err, tc.err)
		case tc.err == "" && (err != nil || c.HandshakeWorkers != tc.want):
			t.Errorf("%v: %d workers for handshakes (%v), want %d", tc.env, c.HandshakeWorkers, err, tc.want)
		}
	}
	if c, err := load(nil); err != nil || c.HandshakeTimeout != 15*time.Second {
		t.Errorf("lifecycle's HANDSHAKE_TIMEOUT %s (%v), want the edge's default 15s", c.HandshakeTimeout, err)
	}
}
