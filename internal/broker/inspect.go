package broker

import (
	"bytes"
	"encoding/json"
	"fmt"
	"mime"
	"net/http"
	"slices"
	"strings"

	"github.com/aaas-project/aaas/internal/config"
)

// Refusal reasons of the broker's own (metric labels); the ledger adds
// its own ("budget", "concurrency", …).
const (
	ReasonModel     = "model"
	ReasonMalformed = "malformed"
	ReasonTooLarge  = "too_large"
	ReasonEncoding  = "encoding"
	ReasonPath      = "path"
	ReasonProvider  = "provider"
	// ReasonStale: the sandboxes copy is not confirmed current.
	ReasonStale = "stale"
	// ReasonUnavailable: a lookup the call needs (budget, brought key)
	// failed.
	ReasonUnavailable = "unavailable"
)

// modelEndpoints are the path endpoints whose bodies name a model: they
// must be a JSON object with one of the provider's models.
var modelEndpoints = []string{"/chat/completions", "/completions", "/embeddings", "/responses", "/messages", "/messages/count_tokens"}

// streamUsageEndpoints are OpenAI's endpoints that report a stream's
// usage only when asked to (stream_options.include_usage).
var streamUsageEndpoints = []string{"/chat/completions", "/completions"}

func hasEndpoint(rest string, endpoints []string) bool {
	p := "/" + strings.TrimSuffix(rest, "/")
	return slices.ContainsFunc(endpoints, func(e string) bool { return strings.HasSuffix(p, e) })
}

// inspected is what the broker read of a request body, and the body it
// forwards.
type inspected struct {
	// Model is the body's model ("" if it names none).
	Model  string
	Stream bool
	// Body is what is forwarded: the client's object re-encoded (so the
	// provider reads exactly the fields checked here, however a parser
	// would treat a duplicate key), with include_usage added where it is
	// needed for metering; or the client's bytes unchanged when they are
	// not JSON.
	Body []byte
}

// inspectRequest reads a request body a tenant sent to provider p at
// rest (the path after the provider's name): a POST to a model endpoint,
// or any JSON body, must be a JSON object whose model, if it has one
// (model endpoints: must have one), is one of p's. The refusal is a 400
// with a message the user is shown.
func inspectRequest(p config.Provider, method, rest, contentType string, body []byte) (inspected, *Refusal) {
	endpoint := method == http.MethodPost && hasEndpoint(rest, modelEndpoints)
	mt, _, _ := mime.ParseMediaType(contentType)
	trimmed := bytes.TrimLeft(body, " \t\r\n")
	isJSON := mt == "application/json" || strings.HasSuffix(mt, "+json") || (len(trimmed) > 0 && trimmed[0] == '{')
	if !endpoint && (!isJSON || len(trimmed) == 0) {
		return inspected{Body: body}, nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil || obj == nil {
		return inspected{}, bad(ReasonMalformed, "the request body is not a JSON object: "+jsonProblem(err))
	}
	var in inspected
	if raw, ok := obj["model"]; ok {
		if err := json.Unmarshal(raw, &in.Model); err != nil || in.Model == "" {
			return inspected{}, bad(ReasonMalformed, "model must be a non-empty string")
		}
		if !slices.Contains(p.Models, in.Model) {
			return inspected{}, bad(ReasonModel, fmt.Sprintf("the model %q is not available through %s; available: %s", truncate(in.Model, 64), p.Name, strings.Join(p.Models, ", ")))
		}
	} else if endpoint {
		return inspected{}, bad(ReasonMalformed, "the request names no model; available: "+strings.Join(p.Models, ", "))
	}
	_ = json.Unmarshal(obj["stream"], &in.Stream)
	if in.Stream && p.API == config.APIOpenAI && hasEndpoint(rest, streamUsageEndpoints) {
		obj["stream_options"] = withIncludeUsage(obj["stream_options"])
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(obj); err != nil {
		return inspected{}, bad(ReasonMalformed, "the request body is not valid JSON")
	}
	in.Body = bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	return in, nil
}

// withIncludeUsage is stream_options with include_usage set to true
// unless the client set it: OpenAI-compatible servers report a stream's
// usage only when asked. Options of another type are left for the
// provider to refuse.
func withIncludeUsage(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 || string(raw) == "null" {
		return json.RawMessage(`{"include_usage":true}`)
	}
	var opts map[string]json.RawMessage
	if json.Unmarshal(raw, &opts) != nil || opts == nil {
		return raw
	}
	if _, set := opts["include_usage"]; set {
		return raw
	}
	opts["include_usage"] = json.RawMessage("true")
	b, err := json.Marshal(opts)
	if err != nil {
		return raw
	}
	return b
}

func bad(reason, msg string) *Refusal {
	return &Refusal{Status: http.StatusBadRequest, Message: msg, Reason: reason}
}

func jsonProblem(err error) string {
	if err == nil {
		return "it is null"
	}
	return truncate(err.Error(), 120)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
