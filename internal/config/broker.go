package config

import (
	"encoding/json"
	"math"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/handshake"
)

// Provider API shapes: what a provider's requests, answers, errors and
// usage look like.
const (
	APIOpenAI    = "openai"
	APIAnthropic = "anthropic"
)

// Provider is one upstream model provider of BROKER_PROVIDERS. Sandboxes
// reach it at <broker>/<Name>/…, which the broker forwards to BaseURL/…
// with the provider's key.
type Provider struct {
	// Name is the provider's path segment and key file name
	// (BROKER_KEYS_DIR/<name>): lower-case letters, digits and dashes.
	Name string `json:"name"`
	// API is openai (chat completions; also any OpenAI-compatible server:
	// vLLM, LiteLLM, Ollama) or anthropic (messages).
	API string `json:"api"`
	// BaseURL is what the provider's SDK calls its base URL, e.g.
	// https://api.deepseek.com, https://api.openai.com/v1,
	// https://api.anthropic.com.
	BaseURL string `json:"base_url"`
	// Models are the model names sandboxes may ask for; any other is
	// refused before it costs anything.
	Models []string `json:"models"`
}

// Price is what a model costs, in USD per million tokens (the unit
// providers publish), which is micro-USD per token.
type Price struct {
	Input  float64 `json:"input"`
	Output float64 `json:"output"`
	// Cached is the price of input tokens the provider served from its
	// cache (reported apart); 0 charges them as Input.
	Cached float64 `json:"cached,omitempty"`
	// CacheWrite is the price of input tokens written to the provider's
	// cache (Anthropic's cache_creation_input_tokens, 1.25× input there);
	// 0 charges them as Input.
	CacheWrite float64 `json:"cache_write,omitempty"`
}

// Broker is the configuration of cmd/broker, the model-API endpoint
// sandboxes call: it holds the provider keys, attributes every call to the
// user whose pod made it, meters it and enforces budgets.
type Broker struct {
	Common
	// Addr is BROKER_ADDR, where sandboxes reach the broker.
	Addr string
	// Providers is BROKER_PROVIDERS, a JSON list of Provider.
	Providers []Provider
	// KeysDir is BROKER_KEYS_DIR: one file per provider, named after it,
	// holding its API key (a Secret mounted into the broker only). A
	// provider without a file is called without a key (an in-cluster
	// server that needs none).
	KeysDir string
	// Prices is BROKER_PRICES, a JSON object model → Price. A model
	// without a price costs nothing (and is metered all the same).
	Prices map[string]Price
	Budget
	// MaxConcurrent is BROKER_MAX_CONCURRENT_CALLS: the most model calls
	// one user may have in flight on all brokers together.
	MaxConcurrent int
	// CallTimeout is BROKER_CALL_TIMEOUT: the longest one call may take,
	// streaming included; also how long a killed broker's slot is held.
	CallTimeout time.Duration
	// HeaderTimeout is BROKER_HEADER_TIMEOUT: how long a provider may take
	// to start answering (504 after it).
	HeaderTimeout time.Duration
	// MaxBody is BROKER_MAX_BODY_BYTES: the largest request body (413).
	MaxBody int
	// MaxStaleness is ROUTE_MAX_STALENESS: the longest the broker
	// attributes calls from its copy of the sandboxes bucket without
	// confirming it current. Meanwhile a pod's address may have gone to
	// another tenant's pod, whose calls would be charged to the old user;
	// past the bound calls answer 503.
	MaxStaleness time.Duration
	// ShutdownTimeout is SHUTDOWN_TIMEOUT: on SIGTERM, how long calls in
	// flight may go on before their streams are cut (the client retries on
	// another replica).
	ShutdownTimeout time.Duration
	// BYOK is BROKER_BYOK: users may store their own provider keys, used
	// instead of the organisation's and not charged to its budget.
	BYOK bool
	// CredentialKeys is CREDENTIALS_KEYS, the broker's key ring for
	// opening the keys users brought (newest first): base64 X25519
	// private keys. Needed with BROKER_BYOK.
	CredentialKeys [][]byte
	// BeaconInterval is BEACON_INTERVAL: a user's activity beacons while
	// a model call is in flight, as an edge sends while a request is.
	BeaconInterval time.Duration
	// BeaconTTL is BEACON_TTL: how long such a beacon keeps the sandbox
	// awake, so a killed broker's calls stop pinning it after this long.
	BeaconTTL time.Duration
}

// Budget is the model budget every process that shows or enforces it
// reads the same way.
type Budget struct {
	// DefaultMicros is BROKER_BUDGET_DEFAULT, in USD per user per month
	// (e.g. "20", "2.50"), in micro-USD; 0 (unset) means no budget.
	DefaultMicros int64
}

var providerName = regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}$`)

// LoadBroker reads and validates the broker's variables.
func LoadBroker(e *Env) (Broker, error) {
	c := Broker{
		Common:          LoadCommon(e, ":9093"),
		Addr:            e.String("BROKER_ADDR", ":8090"),
		KeysDir:         e.String("BROKER_KEYS_DIR", "/etc/aaas/provider-keys"),
		Budget:          loadBudget(e),
		MaxConcurrent:   e.Int("BROKER_MAX_CONCURRENT_CALLS", 4, 1, 1000),
		CallTimeout:     e.Duration("BROKER_CALL_TIMEOUT", 10*time.Minute, time.Second, 2*time.Hour),
		HeaderTimeout:   e.Duration("BROKER_HEADER_TIMEOUT", time.Minute, time.Second, 30*time.Minute),
		MaxBody:         e.Int("BROKER_MAX_BODY_BYTES", 8<<20, 1<<10, 64<<20),
		ShutdownTimeout: shutdownTimeout(e),
		MaxStaleness:    routeMaxStaleness(e),
		BYOK:            e.Bool("BROKER_BYOK", false),
		BeaconInterval:  beaconInterval(e),
	}
	c.BeaconTTL = beaconTTL(e, c.BeaconInterval)
	c.Providers = loadProviders(e)
	c.Prices = loadPrices(e)
	if c.BYOK {
		c.CredentialKeys = keyRing(e, "CREDENTIALS_KEYS")
		if len(c.CredentialKeys) == 0 {
			e.Fail("CREDENTIALS_KEYS", "needed with BROKER_BYOK: the brokers' key ring for the keys users bring")
		}
	}
	return c, e.Err()
}

// loadBudget reads BROKER_BUDGET_DEFAULT.
func loadBudget(e *Env) Budget {
	v := e.String("BROKER_BUDGET_DEFAULT", "")
	if v == "" {
		return Budget{}
	}
	usd, err := strconv.ParseFloat(v, 64)
	if err != nil || usd < 0 || usd > 1e6 || math.IsNaN(usd) {
		e.Fail("BROKER_BUDGET_DEFAULT", "%q is not an amount of USD between 0 and 1000000", v)
		return Budget{}
	}
	return Budget{DefaultMicros: int64(math.Round(usd * 1e6))}
}

// publicKey reads a 32-byte public key, base64 (or hex, as keyRing reads
// the private ones); required.
func publicKey(e *Env, name string) []byte {
	v := e.String(name, "")
	if v == "" {
		e.Fail(name, "needed with BROKER_BYOK: the public key of the brokers' newest CREDENTIALS_KEYS (`setup credentials-keygen` prints both)")
		return nil
	}
	k, err := handshake.ParseKey(v)
	if err != nil {
		e.Fail(name, "not a public key: %v", err)
		return nil
	}
	return k
}

func loadProviders(e *Env) []Provider {
	v := e.String("BROKER_PROVIDERS", "")
	if v == "" {
		e.Fail("BROKER_PROVIDERS", `needed: a JSON list such as [{"name":"deepseek","api":"openai","base_url":"https://api.deepseek.com","models":["deepseek-chat"]}]`)
		return nil
	}
	var ps []Provider
	dec := json.NewDecoder(strings.NewReader(v))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ps); err != nil {
		e.Fail("BROKER_PROVIDERS", "not a JSON list of providers: %v", err)
		return nil
	}
	seen := map[string]bool{}
	for _, p := range ps {
		switch u, err := url.Parse(p.BaseURL); {
		case !providerName.MatchString(p.Name):
			e.Fail("BROKER_PROVIDERS", "provider name %q: lower-case letters, digits and dashes, starting with a letter", p.Name)
		case seen[p.Name]:
			e.Fail("BROKER_PROVIDERS", "provider %q is listed twice", p.Name)
		case p.API != APIOpenAI && p.API != APIAnthropic:
			e.Fail("BROKER_PROVIDERS", "provider %q: api %q is not openai or anthropic", p.Name, p.API)
		case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "":
			e.Fail("BROKER_PROVIDERS", "provider %q: base_url %q is not an http(s) URL without query", p.Name, p.BaseURL)
		case len(p.Models) == 0:
			e.Fail("BROKER_PROVIDERS", "provider %q lists no models", p.Name)
		}
		seen[p.Name] = true
	}
	return ps
}

func loadPrices(e *Env) map[string]Price {
	v := e.String("BROKER_PRICES", "")
	if v == "" {
		return nil
	}
	var ps map[string]Price
	dec := json.NewDecoder(strings.NewReader(v))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ps); err != nil {
		e.Fail("BROKER_PRICES", `not a JSON object of prices in USD per million tokens, e.g. {"deepseek-chat":{"input":0.27,"output":1.1,"cached":0.07}}: %v`, err)
		return nil
	}
	for m, p := range ps {
		for _, x := range []float64{p.Input, p.Output, p.Cached, p.CacheWrite} {
			if x < 0 || x > 1e4 || math.IsNaN(x) {
				e.Fail("BROKER_PRICES", "model %q: a price of %v USD per million tokens is outside [0, 10000]", m, x)
			}
		}
	}
	return ps
}
