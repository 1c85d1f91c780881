// Package chartschema generates the Helm chart's values.schema.json
// (charts/aaas) from internal/config: the chart's own structure (base.json)
// with, under config, one property per variable the processes read, typed,
// bounded and defaulted as its loader reads it. `go run ./hack/chartschema`
// writes the file; a test keeps the committed one equal, so the chart
// refuses at install what a process would refuse at start.
package chartschema

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/aaas-project/aaas/internal/config"
)

//go:embed base.json
var base []byte

// Path is the schema's place in the repository.
const Path = "charts/aaas/values.schema.json"

// ChartManaged lists the variables the chart sets itself, from hosts,
// namespaces, NATS, Secrets and the pods' own addresses: values.config may
// not set them, so each decision has one place. Secrets (config's secret
// kind) are refused there too: no credential goes into a ConfigMap.
var ChartManaged = map[string]string{
	"ALLOW_INSECURE_COOKIES":   "development only",
	"AUTH_PROXY_HEADER":        "gatewaySSO.enabled",
	"AUTH_PROXY_ID_HEADER":     "gatewaySSO.enabled",
	"AUTH_PROXY_ALLOW":         "gatewaySSO.allow",
	"AUTH_PROXY_SIGN_OUT_URL":  "gatewaySSO.enabled",
	"BROKER_ADDR":              "the broker's pod",
	"BROKER_KEYS_DIR":          "broker.existingSecret",
	"BROKER_PRICES":            "broker.prices",
	"BROKER_PROVIDERS":         "broker.providers",
	"CONTROL_PLANE_NAMESPACE":  "the release's namespace",
	"GENERATE_APP_SECRET":      "secrets.existingSecret",
	"GENERATE_NATS_SECRET":     "nats.existingSecret",
	"GENERATE_NATS_TLS_SECRET": "nats.tls.existingSecret",
	"HANDSHAKE_KEY":            "secrets.existingSecret",
	"INSTANCE_ID":              "each pod's name",
	"KUBECONFIG":               "in-cluster credentials",
	"LISTEN_ADDR":              "the edge's pod",
	"METRICS_ADDR":             "each pod",
	"NAMESPACE":                "sandboxNamespace.name",
	"NATS_ALLOW_ANONYMOUS":     "NATS identities are always on",
	"NATS_CA":                  "nats.tls.existingSecret",
	"NATS_CERT":                "nats.tls.existingSecret",
	"NATS_CREDS":               "nats.existingSecret",
	"NATS_KEY":                 "nats.tls.existingSecret",
	"NATS_NKEY":                "nats.existingSecret",
	"NATS_URL":                 "nats.bundled, nats.external.url",
	"PROFILES":                 "sandbox.profiles",
	"PUBLIC_HOSTS":             "hosts.public",
	"SANDBOX_DOMAIN":           "hosts.sandboxDomain",
	"SANDBOX_NAMESPACE":        "sandboxNamespace.name",
	"SHUTDOWN_TIMEOUT":         "the edge's termination grace period",
	"SMOKE_CA_FILE":            "tests.caSecret",
	"SMOKE_HOST":               "hosts.public",
	"SMOKE_TIMEOUT":            "the helm test pods",
	"SMOKE_URL":                "tests.frontDoor",
	"STREAM_REPLICAS":          "nats.replicas",
	"WARM_POOL":                "sandbox.warmPool.name",
}

// durationPattern is what config's Duration accepts: a Go duration or a
// bare number of seconds.
const durationPattern = `^(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h))+$|^[0-9]+(\.[0-9]+)?$`

// Generate returns values.schema.json.
func Generate() ([]byte, error) {
	var schema map[string]any
	if err := json.Unmarshal(base, &schema); err != nil {
		return nil, fmt.Errorf("base.json: %w", err)
	}
	props := map[string]any{}
	for _, s := range config.Settings() {
		if _, managed := ChartManaged[s.Name]; managed || s.Kind == "secret" {
			continue
		}
		p, err := property(s)
		if err != nil {
			return nil, err
		}
		props[s.Name] = p
	}
	schema["properties"].(map[string]any)["config"] = map[string]any{
		"type":                 "object",
		"description":          "Settings every aaas process reads (ConfigMap aaas-config), by the variables' names; generated from internal/config.",
		"additionalProperties": false,
		"properties":           props,
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(schema); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

func property(s config.Setting) (map[string]any, error) {
	p := map[string]any{}
	atoi := func(v string) (int64, error) { return strconv.ParseInt(v, 10, 64) }
	switch s.Kind {
	case "integer":
		p["type"] = "integer"
		for key, v := range map[string]string{"minimum": s.Min, "maximum": s.Max, "default": s.Default} {
			n, err := atoi(v)
			if err != nil {
				return nil, fmt.Errorf("%s: %s %q: %w", s.Name, key, v, err)
			}
			p[key] = n
		}
	case "boolean":
		p["type"] = "boolean"
		p["default"] = s.Default == "true"
	case "duration":
		p["type"] = "string"
		p["pattern"] = durationPattern
		p["default"] = s.Default
		p["description"] = "a duration (30s, 15m, 2h) or seconds, from " + s.Min + " to " + s.Max
	case "enum":
		p["enum"] = s.Enum
		p["default"] = s.Default
	case "list":
		p["type"] = "string"
		p["description"] = "comma-separated"
		if s.Default != "" {
			p["default"] = s.Default
		}
	case "string":
		p["type"] = "string"
		if s.Default != "" {
			p["default"] = s.Default
		}
	default:
		return nil, fmt.Errorf("%s: kind %q has no schema", s.Name, s.Kind)
	}
	return p, nil
}
