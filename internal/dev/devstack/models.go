package devstack

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/embednats"
)

// models is the local stack's model calls: the provider stand-in
// (providersim) as each of the three providers the manifests name, and
// the broker in front of it, which the sandboxes call. The real providers
// cannot be reached from a laptop without keys; the stand-in streams,
// reports usage and has the -slow, -fail, -nousage and -long switches.
type models struct {
	simAddr, brokerAddr string
	// env are the broker's settings (providers, key directory, prices).
	env map[string]string
}

// simModels are the models each stand-in provider lists.
var simModels = []string{"", "-slow", "-fail", "-nousage", "-long"}

func newModels(stateDir string, settings map[string]string) (*models, error) {
	simPort, err := embednats.FreePort()
	if err != nil {
		return nil, err
	}
	brokerPort, err := embednats.FreePort()
	if err != nil {
		return nil, err
	}
	m := &models{simAddr: fmt.Sprintf("127.0.0.1:%d", simPort), brokerAddr: fmt.Sprintf("127.0.0.1:%d", brokerPort), env: map[string]string{}}
	keys := filepath.Join(stateDir, "provider-keys")
	if err := os.MkdirAll(keys, 0o700); err != nil {
		return nil, err
	}
	key := "sim-" + randomString(16)
	var providers []config.Provider
	prices := map[string]config.Price{}
	for _, p := range []struct{ name, api, path, model string }{
		{"deepseek", config.APIOpenAI, "", "deepseek-chat"},
		{"openai", config.APIOpenAI, "/v1", "gpt-4.1-mini"},
		{"anthropic", config.APIAnthropic, "", "claude-sonnet-4-5"},
	} {
		var names []string
		for _, s := range simModels {
			names = append(names, p.model+s)
			prices[p.model+s] = config.Price{Input: 0.27, Output: 1.10, Cached: 0.07}
		}
		providers = append(providers, config.Provider{Name: p.name, API: p.api, BaseURL: "http://" + m.simAddr + p.path, Models: names})
		if err := os.WriteFile(filepath.Join(keys, p.name), []byte(key), 0o600); err != nil {
			return nil, err
		}
	}
	pj, _ := json.Marshal(providers)
	prj, _ := json.Marshal(prices)
	m.env = map[string]string{"BROKER_PROVIDERS": string(pj), "BROKER_PRICES": string(prj), "BROKER_KEYS_DIR": keys, "BROKER_ADDR": m.brokerAddr}
	// The operator's own choice of providers wins (their own stand-in,
	// an in-cluster vLLM reachable from here).
	for k := range m.env {
		if v, ok := settings[k]; ok && k != "BROKER_ADDR" {
			m.env[k] = v
		}
	}
	m.env["PROVIDERSIM_KEYS"], m.env["PROVIDERSIM_LISTEN"] = key, m.simAddr
	return m, nil
}

// sandboxes points the template's provider base URLs at the local broker
// (the manifests' name, aaas-broker.<namespace>.svc, resolves only in a
// cluster).
func (m *models) sandboxes(tmpl *extv1beta1.SandboxTemplate, _ *extv1beta1.SandboxWarmPool) {
	for i := range tmpl.Spec.PodTemplate.Spec.Containers {
		c := &tmpl.Spec.PodTemplate.Spec.Containers[i]
		for j := range c.Env {
			e := &c.Env[j]
			if name, ok := strings.CutSuffix(e.Name, "_BASE_URL"); ok && e.ValueFrom == nil {
				e.Value = "http://" + m.brokerAddr + "/" + strings.ToLower(name)
			}
		}
	}
}

// broker is the broker's own environment.
func (m *models) broker() map[string]string {
	out := map[string]string{"INSTANCE_ID": "broker-a"}
	for _, k := range []string{"BROKER_PROVIDERS", "BROKER_PRICES", "BROKER_KEYS_DIR", "BROKER_ADDR"} {
		out[k] = m.env[k]
	}
	return out
}

// simEnv is the stand-in's environment: its address and key, and its
// pacing settings (PROVIDERSIM_SLOW, PROVIDERSIM_TOKEN_INTERVAL) when
// the stack's options name them, as the benchmark does to hold calls open.
func (m *models) simEnv(extra map[string]string) map[string]string {
	env := map[string]string{"PATH": os.Getenv("PATH"), "PROVIDERSIM_KEYS": m.env["PROVIDERSIM_KEYS"], "PROVIDERSIM_LISTEN": m.simAddr}
	for _, k := range []string{"PROVIDERSIM_SLOW", "PROVIDERSIM_TOKEN_INTERVAL"} {
		if v, ok := extra[k]; ok {
			env[k] = v
		}
	}
	return env
}
