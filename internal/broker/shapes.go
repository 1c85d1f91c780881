package broker

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"

	"github.com/aaas-project/aaas/internal/config"
)

// errorType is the error "type" a provider of api gives a status: SDKs
// and DSH read it, and show the message.
func errorType(api string, status int) string {
	anthropic := api == config.APIAnthropic
	switch {
	case status == http.StatusForbidden:
		return "permission_error"
	case status == http.StatusNotFound && anthropic:
		return "not_found_error"
	case status == http.StatusRequestEntityTooLarge && anthropic:
		return "request_too_large"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status == http.StatusServiceUnavailable && anthropic:
		return "overloaded_error"
	case status >= 500 && anthropic:
		return "api_error"
	case status >= 500:
		return "server_error"
	}
	return "invalid_request_error"
}

// writeError answers in api's error shape: OpenAI's
// {"error":{"message","type","code"}} or Anthropic's
// {"type":"error","error":{"type","message"}}. code is OpenAI's
// machine-readable code ("" for none).
func writeError(w http.ResponseWriter, api string, status int, code, message string, retryAfter time.Duration) {
	var body any
	typ := errorType(api, status)
	if api == config.APIAnthropic {
		body = map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": message}}
	} else {
		e := map[string]any{"message": message, "type": typ, "code": nil}
		if code != "" {
			e["code"] = code
		}
		body = map[string]any{"error": e}
	}
	b, _ := json.Marshal(body)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int((retryAfter+time.Second-1)/time.Second)))
	}
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// writeModels answers a provider's model listing from its configured
// models, in its API's list shape, so an SDK's model picker shows exactly
// what the broker forwards.
func writeModels(w http.ResponseWriter, p config.Provider) {
	var body any
	if p.API == config.APIAnthropic {
		data := make([]map[string]string, len(p.Models))
		for i, m := range p.Models {
			data[i] = map[string]string{"type": "model", "id": m, "display_name": m, "created_at": "1970-01-01T00:00:00Z"}
		}
		first, last := "", ""
		if len(p.Models) > 0 {
			first, last = p.Models[0], p.Models[len(p.Models)-1]
		}
		body = map[string]any{"data": data, "has_more": false, "first_id": first, "last_id": last}
	} else {
		data := make([]map[string]any, len(p.Models))
		for i, m := range p.Models {
			data[i] = map[string]any{"id": m, "object": "model", "created": 0, "owned_by": p.Name}
		}
		body = map[string]any{"object": "list", "data": data}
	}
	b, _ := json.Marshal(body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}
