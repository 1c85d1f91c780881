package config_test

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

// loadEdge loads the edge's settings from envs merged in order, and says
// whether they loaded: when fail names a variable, the load must fail
// naming it (and ok is false); otherwise it must not fail.
func loadEdge(t *testing.T, fail string, envs ...map[string]string) (config.Edge, bool) {
	t.Helper()
	env := map[string]string{}
	for _, m := range envs {
		maps.Copy(env, m)
	}
	c, err := config.LoadEdge(config.FromMap(env))
	switch {
	case fail != "":
		if err == nil || !strings.Contains(err.Error(), fail+":") {
			t.Fatalf("err = %v, want one naming %s", err, fail)
		}
		return c, false
	case err != nil:
		t.Fatal(err)
	}
	return c, true
}

func TestPreviewSettings(t *testing.T) {
	base := map[string]string{
		"HANDSHAKE_KEYS": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", "SIGNUP_INVITE_CODE": "x",
		"NATS_ALLOW_ANONYMOUS": "true", "PUBLIC_HOSTS": "gw.example", "SANDBOX_DOMAIN": "sandboxes.example",
	}
	many := make([]string, 33)
	for i := range many {
		many[i] = strconv.Itoa(10000 + i)
	}
	for _, tc := range []struct {
		name  string
		env   map[string]string
		ports []int
		users bool
		fail  string // the variable the error names; "" for none
	}{
		{name: "default: off, owner only"},
		{name: "sorted", env: map[string]string{"PREVIEW_PORTS": "8000, 3000,5173"}, ports: []int{3000, 5173, 8000}},
		{name: "users", env: map[string]string{"PREVIEW_PORTS": "5173", "PREVIEW_ACCESS": "users"}, ports: []int{5173}, users: true},
		{name: "owner spelled out", env: map[string]string{"PREVIEW_PORTS": "5173", "PREVIEW_ACCESS": "owner"}, ports: []int{5173}},
		{name: "unknown access", env: map[string]string{"PREVIEW_ACCESS": "everyone"}, fail: "PREVIEW_ACCESS"},
		{name: "not a number", env: map[string]string{"PREVIEW_PORTS": "5173,http"}, fail: "PREVIEW_PORTS"},
		{name: "zero", env: map[string]string{"PREVIEW_PORTS": "0"}, fail: "PREVIEW_PORTS"},
		{name: "too large", env: map[string]string{"PREVIEW_PORTS": "65536"}, fail: "PREVIEW_PORTS"},
		{name: "negative", env: map[string]string{"PREVIEW_PORTS": "-80"}, fail: "PREVIEW_PORTS"},
		{name: "a range is not a port", env: map[string]string{"PREVIEW_PORTS": "3000-3005"}, fail: "PREVIEW_PORTS"},
		{name: "twice", env: map[string]string{"PREVIEW_PORTS": "5173,5173"}, fail: "PREVIEW_PORTS"},
		{name: "DSH's default port", env: map[string]string{"PREVIEW_PORTS": "3080"}, fail: "PREVIEW_PORTS"},
		{name: "DSH's configured port", env: map[string]string{"PREVIEW_PORTS": "3080,4000", "DSH_PORT": "4000"}, fail: "PREVIEW_PORTS"},
		{name: "3080 when DSH is elsewhere", env: map[string]string{"PREVIEW_PORTS": "3080", "DSH_PORT": "4000"}, ports: []int{3080}},
		{name: "path mode", env: map[string]string{"PREVIEW_PORTS": "5173", "SANDBOX_DOMAIN": ""}, fail: "PREVIEW_PORTS"},
		{name: "path mode, previews off", env: map[string]string{"SANDBOX_DOMAIN": "", "PREVIEW_ACCESS": "users"}, users: true},
		{name: "too many", env: map[string]string{"PREVIEW_PORTS": strings.Join(many, ",")}, fail: "PREVIEW_PORTS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, ok := loadEdge(t, tc.fail, base, tc.env)
			if !ok {
				return
			}
			if !slices.Equal(c.Preview.Ports, tc.ports) || c.Preview.Users != tc.users {
				t.Fatalf("preview = %+v, want ports %v users %v", c.Preview, tc.ports, tc.users)
			}
			for _, p := range tc.ports {
				if !c.Preview.Allows(p) {
					t.Errorf("port %d listed but not allowed", p)
				}
			}
			for _, p := range []int{0, 1, 3080, 65535, 5174} {
				if !slices.Contains(tc.ports, p) && c.Preview.Allows(p) {
					t.Errorf("port %d allowed but not listed", p)
				}
			}
		})
	}
}
