package config_test

import (
	"encoding/base64"
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

// The edge reads the brokers' budget default and BYOK the brokers' way;
// with BYOK it needs the providers and a 32-byte public key, and names
// what is wrong.
func TestEdgeBudgetAndBYOK(t *testing.T) {
	pub := base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))
	providers := `[{"name":"openai","api":"openai","base_url":"https://api.openai.com/v1","models":["gpt-4o"]}]`
	edge := func(extra map[string]string) (config.Edge, error) {
		env := map[string]string{"HANDSHAKE_KEYS": pub, "SIGNUP_INVITE_CODE": "x", "NATS_ALLOW_ANONYMOUS": "true", "PUBLIC_HOSTS": "gw.example"}
		for k, v := range extra {
			env[k] = v
		}
		return config.LoadEdge(config.FromMap(env))
	}
	c, err := edge(nil)
	if err != nil || c.BYOK || c.DefaultMicros != 0 || c.Providers != nil {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	c, err = edge(map[string]string{"BROKER_BUDGET_DEFAULT": "2.50", "BROKER_BYOK": "true", "BROKER_PROVIDERS": providers, "CREDENTIALS_PUBLIC_KEY": pub})
	if err != nil || !c.BYOK || c.DefaultMicros != 2_500_000 || len(c.Providers) != 1 || c.Providers[0].Name != "openai" || len(c.CredentialsPublicKey) != 32 {
		t.Fatalf("BYOK: %+v %v", c, err)
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"BROKER_BYOK": "true", "BROKER_PROVIDERS": providers}, "CREDENTIALS_PUBLIC_KEY: needed with BROKER_BYOK"},
		{map[string]string{"BROKER_BYOK": "true", "BROKER_PROVIDERS": providers, "CREDENTIALS_PUBLIC_KEY": "c2hvcnQ="}, "CREDENTIALS_PUBLIC_KEY: not a public key"},
		{map[string]string{"BROKER_BYOK": "true", "CREDENTIALS_PUBLIC_KEY": pub}, "BROKER_PROVIDERS: needed"},
		{map[string]string{"BROKER_BUDGET_DEFAULT": "-1"}, "BROKER_BUDGET_DEFAULT"},
	} {
		if _, err := edge(tc.env); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.env, err, tc.want)
		}
	}
}
