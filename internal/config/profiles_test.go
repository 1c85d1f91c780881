package config_test

import (
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/idle"
)

func TestProfileSettings(t *testing.T) {
	base := map[string]string{
		"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "SIGNUP_INVITE_CODE": "x",
		"NATS_ALLOW_ANONYMOUS": "true", "PUBLIC_HOSTS": "gw.example",
	}
	sso := map[string]string{"AUTH_PROXY_HEADER": "X-Forwarded-User", "AUTH_PROXY_ALLOW": "*"}
	two := `[{"name":"small","warm_pool":"dsh-pool"},{"name":"gpu","description":"one GPU","warm_pool":"dsh-gpu","groups":["ml"]}]`
	for _, tc := range []struct {
		name  string
		env   map[string]string
		sso   bool
		want  string // the profiles' names, in order
		fail  string // the variable the error names; "" for none
		pools string // the warm pools, in order
	}{
		{name: "unset: one default profile of WARM_POOL's default", want: "default", pools: "dsh-pool"},
		{name: "unset: WARM_POOL's", env: map[string]string{"WARM_POOL": "my-pool"}, want: "default", pools: "my-pool"},
		{name: "WARM_POOL not an object name", env: map[string]string{"WARM_POOL": "My_Pool"}, fail: "WARM_POOL"},
		{name: "two, groups with SSO", env: map[string]string{"PROFILES": two}, sso: true, want: "small, gpu", pools: "dsh-pool dsh-gpu"},
		{name: "groups without SSO", env: map[string]string{"PROFILES": two}, fail: "PROFILES"},
		{name: "with WARM_POOL", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p"}]`, "WARM_POOL": "p"}, fail: "WARM_POOL"},
		{name: "not JSON", env: map[string]string{"PROFILES": `small`}, fail: "PROFILES"},
		{name: "two lists", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p"}] []`}, fail: "PROFILES"},
		{name: "empty list", env: map[string]string{"PROFILES": `[]`}, fail: "PROFILES"},
		{name: "unknown field", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","cpu":2}]`}, fail: "PROFILES"},
		{name: "twice", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p"},{"name":"a1","warm_pool":"q"}]`}, fail: "PROFILES"},
		{name: "upper case", env: map[string]string{"PROFILES": `[{"name":"Big","warm_pool":"p"}]`}, fail: "PROFILES"},
		{name: "double hyphen", env: map[string]string{"PROFILES": `[{"name":"a--b","warm_pool":"p"}]`}, fail: "PROFILES"},
		{name: "too long", env: map[string]string{"PROFILES": `[{"name":"` + strings.Repeat("a", 33) + `","warm_pool":"p"}]`}, fail: "PROFILES"},
		{name: "no warm pool", env: map[string]string{"PROFILES": `[{"name":"a1"}]`}, fail: "PROFILES"},
		{name: "long description", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","description":"` + strings.Repeat("x", 201) + `"}]`}, fail: "PROFILES"},
		{name: "idle rules", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","idle_timeout":"5m","max_runtime":"8h","max_running":3}]`}, want: "a1", pools: "p"},
		{name: "not a duration", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","idle_timeout":"soon"}]`}, fail: "PROFILES"},
		{name: "a duration as a number", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","idle_timeout":300}]`}, fail: "PROFILES"},
		{name: "idle timeout too short", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","idle_timeout":"10ms"}]`}, fail: "PROFILES"},
		{name: "negative ceiling", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","max_runtime":"-1h"}]`}, fail: "PROFILES"},
		{name: "ceiling below the global idle timeout", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","max_runtime":"5m"}]`}, fail: "PROFILES"},
		{name: "ceiling below its own idle timeout", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","idle_timeout":"2h","max_runtime":"1h"}]`}, fail: "PROFILES"},
		{name: "negative cap", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","max_running":-1}]`}, fail: "PROFILES"},
		{name: "the default names groups", env: map[string]string{"PROFILES": `[{"name":"a1","warm_pool":"p","groups":["ml"]}]`}, sso: true, fail: "PROFILES"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			with := base
			if tc.sso {
				with = maps.Clone(base)
				maps.Copy(with, sso)
			}
			c, ok := loadEdge(t, tc.fail, with, tc.env)
			if !ok {
				return
			}
			var pools []string
			for _, p := range c.Profiles {
				pools = append(pools, p.WarmPool)
			}
			if c.Profiles.Names() != tc.want || strings.Join(pools, " ") != tc.pools {
				t.Fatalf("profiles %q of pools %q, want %q of %q", c.Profiles.Names(), pools, tc.want, tc.pools)
			}
			// Lifecycle reads the same list (groups are the edge's to check).
			env := maps.Clone(with)
			maps.Copy(env, tc.env)
			l, err := config.LoadLifecycle(config.FromMap(env))
			if err != nil || l.Profiles.Names() != tc.want {
				t.Fatalf("lifecycle's profiles %q (%v), want %q", l.Profiles.Names(), err, tc.want)
			}
		})
	}
}

func TestProfileFindAndAllows(t *testing.T) {
	ps := config.Profiles{{Name: "small", WarmPool: "p"}, {Name: "gpu", WarmPool: "g", Groups: []string{"ml", "research"}}}
	for _, tc := range []struct {
		name   string
		found  string
		ok     bool
		groups []string
		allows bool
	}{
		{name: "", found: "small", ok: true, allows: true},
		{name: "small", found: "small", ok: true, allows: true},
		{name: "gpu", found: "gpu", ok: true, groups: []string{"research"}, allows: true},
		{name: "gpu", found: "gpu", ok: true, groups: []string{"sales"}},
		{name: "gpu", found: "gpu", ok: true},
		{name: "huge"},
		{name: "GPU"},
	} {
		p, ok := ps.Find(tc.name)
		if ok != tc.ok || p.Name != tc.found {
			t.Fatalf("Find(%q) = %q %v, want %q %v", tc.name, p.Name, ok, tc.found, tc.ok)
		}
		// A sandbox of a profile no longer listed is remade of the default.
		if kept := ps.Kept(tc.name); ok && kept.Name != tc.found || !ok && kept.Name != "small" {
			t.Errorf("Kept(%q) = %q", tc.name, kept.Name)
		}
		if !ok {
			continue
		}
		member := func(g string) bool {
			for _, have := range tc.groups {
				if have == g {
					return true
				}
			}
			return false
		}
		if got := p.Allows(member); got != tc.allows {
			t.Errorf("%s allows a member of %v: %v, want %v", p.Name, tc.groups, got, tc.allows)
		}
	}
}

func TestProfilePolicy(t *testing.T) {
	base := idle.Policy{IdleTimeout: 15 * time.Minute, MaxRuntime: 8 * time.Hour, DormantAfter: time.Hour}
	ps := config.Profiles{{Name: "small"}, {Name: "quick", IdleTimeout: config.Duration(time.Minute)}, {Name: "long", MaxRuntime: config.Duration(24 * time.Hour)}}
	for name, want := range map[string]idle.Policy{
		"":      base,
		"small": base,
		"gone":  base,
		"quick": {IdleTimeout: time.Minute, MaxRuntime: 8 * time.Hour, DormantAfter: time.Hour},
		"long":  {IdleTimeout: 15 * time.Minute, MaxRuntime: 24 * time.Hour, DormantAfter: time.Hour},
	} {
		if got := ps.PolicyOf(base, name); got != want {
			t.Errorf("PolicyOf(%q) = %+v, want %+v", name, got, want)
		}
	}
}
