package providersim

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// The Anthropic messages API: x-api-key and anthropic-version headers,
// max_tokens required; usage in input_tokens (the uncached part),
// cache_read_input_tokens and output_tokens; a stream is named events:
// message_start (input usage), content_block_start, ping,
// content_block_delta (text_delta), content_block_stop, message_delta
// (output_tokens) and message_stop.

type anthropicRequest struct {
	Model     string          `json:"model"`
	MaxTokens *int            `json:"max_tokens"`
	System    json.RawMessage `json:"system"`
	Messages  []message       `json:"messages"`
	Stream    bool            `json:"stream"`
}

func anthropicError(w http.ResponseWriter, status int, kind, msg string) {
	writeJSON(w, status, map[string]any{"type": "error", "error": map[string]any{"type": kind, "message": msg}})
}

// anthropicUsage: Anthropic's input_tokens leaves out the tokens read from
// the cache, which it reports beside them.
func (e *exchange) anthropicUsage(output int) map[string]any {
	return map[string]any{
		"input_tokens":                e.call.InputTokens - e.call.CachedTokens,
		"cache_creation_input_tokens": 0,
		"cache_read_input_tokens":     e.call.CachedTokens,
		"output_tokens":               output,
	}
}

func (s *Server) serveMessages(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("X-Api-Key")
	e := s.newExchange(w, r, "anthropic", key)
	defer e.done()
	fail := func(status int, kind, msg string) {
		e.call.Status = status
		anthropicError(w, status, kind, msg)
	}
	if !s.authorized(key) {
		fail(http.StatusUnauthorized, "authentication_error", "invalid x-api-key")
		return
	}
	if r.Header.Get("Anthropic-Version") == "" {
		fail(http.StatusBadRequest, "invalid_request_error", "anthropic-version: header is required")
		return
	}
	body, tooBig, err := readBody(w, r)
	switch {
	case tooBig:
		fail(http.StatusRequestEntityTooLarge, "request_too_large", fmt.Sprintf("request body over %d bytes", maxBody))
		return
	case err != nil:
		fail(http.StatusBadRequest, "invalid_request_error", "read request body: "+err.Error())
		return
	}
	var req anthropicRequest
	if err := json.Unmarshal(body, &req); err != nil {
		fail(http.StatusBadRequest, "invalid_request_error", "invalid JSON body: "+err.Error())
		return
	}
	e.call.Model, e.call.Stream = req.Model, req.Stream
	switch {
	case req.Model == "":
		fail(http.StatusBadRequest, "invalid_request_error", "model: Field required")
		return
	case req.MaxTokens == nil:
		fail(http.StatusBadRequest, "invalid_request_error", "max_tokens: Field required")
		return
	case len(req.Messages) == 0:
		fail(http.StatusBadRequest, "invalid_request_error", "messages: at least one message is required")
		return
	}
	if e.p, err = readPrompt(req.System, req.Messages); err != nil {
		fail(http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	e.call.InputTokens, e.call.CachedTokens = e.p.usage()
	e.sw = ParseModel(req.Model)
	if !e.begin() {
		return
	}
	if e.sw.Fail {
		fail(http.StatusInternalServerError, "api_error", failMessage)
		return
	}
	n, cut := replyLength(req.MaxTokens)
	stop := "end_turn"
	if cut {
		stop = "max_tokens"
	}
	id := fmt.Sprintf("msg_sim_%d", s.nextID())
	msg := func(content []any, stop any) map[string]any {
		return map[string]any{
			"id": id, "type": "message", "role": "assistant", "model": req.Model,
			"content": content, "stop_reason": stop, "stop_sequence": nil,
		}
	}

	if !req.Stream {
		if e.sw.Long {
			e.holdLong()
			return
		}
		e.call.Status, e.call.OutputTokens = http.StatusOK, n
		resp := msg([]any{map[string]any{"type": "text", "text": e.p.reply(n)}}, stop)
		if !e.sw.NoUsage {
			resp["usage"] = e.anthropicUsage(n)
		}
		writeJSON(w, http.StatusOK, resp)
		return
	}

	e.call.Status = http.StatusOK
	st := startStream(w)
	start := msg([]any{}, nil)
	if !e.sw.NoUsage {
		// output_tokens is 1 here, as Anthropic sends it; the count that
		// matters comes with message_delta.
		start["usage"] = e.anthropicUsage(1)
	}
	if !st.send("message_start", map[string]any{"type": "message_start", "message": start}) ||
		!st.send("content_block_start", map[string]any{"type": "content_block_start", "index": 0, "content_block": map[string]any{"type": "text", "text": ""}}) ||
		!st.send("ping", map[string]any{"type": "ping"}) {
		return
	}
	if !e.tokens(n, func(piece string) bool {
		return st.send("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0, "delta": map[string]any{"type": "text_delta", "text": piece}})
	}) {
		return
	}
	delta := map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": stop, "stop_sequence": nil}}
	if !e.sw.NoUsage {
		delta["usage"] = map[string]any{"output_tokens": e.call.OutputTokens}
	}
	if !st.send("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0}) || !st.send("message_delta", delta) {
		return
	}
	st.send("message_stop", map[string]any{"type": "message_stop"})
}
