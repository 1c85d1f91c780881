package providersim

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
)

// The OpenAI chat completions API, as DeepSeek, vLLM and the rest speak it:
// Authorization: Bearer <key>; usage in prompt_tokens, completion_tokens,
// total_tokens and prompt_tokens_details.cached_tokens; a stream is
// "data: <chunk>" events ending in "data: [DONE]", with a final usage chunk
// (empty choices) only when stream_options.include_usage is true.

type openaiRequest struct {
	Model         string    `json:"model"`
	Messages      []message `json:"messages"`
	Stream        bool      `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens           *int `json:"max_tokens"`
	MaxCompletionTokens *int `json:"max_completion_tokens"`
}

type openaiUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func openaiError(w http.ResponseWriter, status int, kind, code, msg string) {
	var c any
	if code != "" {
		c = code
	}
	writeJSON(w, status, map[string]any{"error": map[string]any{"message": msg, "type": kind, "param": nil, "code": c}})
}

func (e *exchange) openaiUsage() *openaiUsage {
	if e.sw.NoUsage {
		return nil
	}
	u := &openaiUsage{PromptTokens: e.call.InputTokens, CompletionTokens: e.call.OutputTokens}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails.CachedTokens = e.call.CachedTokens
	return u
}

func (s *Server) serveModels(w http.ResponseWriter, r *http.Request) {
	key, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !s.authorized(key) {
		openaiError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "Incorrect API key provided.")
		return
	}
	var data []map[string]any
	for _, m := range listedModels {
		data = append(data, map[string]any{"id": m, "object": "model", "created": 0, "owned_by": "providersim"})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// listedModels is what GET /v1/models lists; every other name is served
// too, its switches read from its suffixes.
var listedModels = []string{"deepseek-chat", "deepseek-reasoner", "gpt-4o-mini"}

func (s *Server) serveChat(w http.ResponseWriter, r *http.Request) {
	key, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	e := s.newExchange(w, r, "openai", key)
	defer e.done()
	fail := func(status int, kind, code, msg string) {
		e.call.Status = status
		openaiError(w, status, kind, code, msg)
	}
	if !s.authorized(key) {
		fail(http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "Incorrect API key provided.")
		return
	}
	body, tooBig, err := readBody(w, r)
	switch {
	case tooBig:
		fail(http.StatusRequestEntityTooLarge, "invalid_request_error", "", fmt.Sprintf("request body over %d bytes", maxBody))
		return
	case err != nil:
		fail(http.StatusBadRequest, "invalid_request_error", "", "read request body: "+err.Error())
		return
	}
	var req openaiRequest
	if err := json.Unmarshal(body, &req); err != nil {
		fail(http.StatusBadRequest, "invalid_request_error", "", "We could not parse the JSON body of your request: "+err.Error())
		return
	}
	e.call.Model, e.call.Stream = req.Model, req.Stream
	if req.Model == "" {
		fail(http.StatusBadRequest, "invalid_request_error", "", "you must provide a model parameter")
		return
	}
	if len(req.Messages) == 0 {
		fail(http.StatusBadRequest, "invalid_request_error", "", "messages: must be a non-empty array")
		return
	}
	if e.p, err = readPrompt(nil, req.Messages); err != nil {
		fail(http.StatusBadRequest, "invalid_request_error", "", err.Error())
		return
	}
	e.call.InputTokens, e.call.CachedTokens = e.p.usage()
	e.sw = ParseModel(req.Model)
	if !e.begin() {
		return
	}
	if e.sw.Fail {
		fail(http.StatusInternalServerError, "server_error", "", failMessage)
		return
	}
	limit := req.MaxCompletionTokens
	if limit == nil {
		limit = req.MaxTokens
	}
	n, cut := replyLength(limit)
	finish := "stop"
	if cut {
		finish = "length"
	}
	id := fmt.Sprintf("chatcmpl-sim-%d", s.nextID())

	if !req.Stream {
		if e.sw.Long {
			e.holdLong()
			return
		}
		e.call.Status, e.call.OutputTokens = http.StatusOK, n
		resp := map[string]any{
			"id": id, "object": "chat.completion", "created": now(), "model": req.Model,
			"choices": []any{map[string]any{
				"index": 0, "message": map[string]any{"role": "assistant", "content": e.p.reply(n)}, "finish_reason": finish,
			}},
		}
		if u := e.openaiUsage(); u != nil {
			resp["usage"] = u
		}
		writeJSON(w, http.StatusOK, resp)
		return
	}

	includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage && !e.sw.NoUsage
	chunk := func(choices []any) map[string]any {
		c := map[string]any{"id": id, "object": "chat.completion.chunk", "created": now(), "model": req.Model, "choices": choices}
		if includeUsage {
			c["usage"] = nil // as OpenAI sends it on every chunk but the last
		}
		return c
	}
	choice := func(delta map[string]any, finish any) []any {
		return []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}}
	}
	e.call.Status = http.StatusOK
	st := startStream(w)
	if !st.send("", chunk(choice(map[string]any{"role": "assistant", "content": ""}, nil))) {
		return
	}
	if !e.tokens(n, func(piece string) bool {
		return st.send("", chunk(choice(map[string]any{"content": piece}, nil)))
	}) {
		return
	}
	if !st.send("", chunk(choice(map[string]any{}, finish))) {
		return
	}
	if includeUsage {
		last := chunk([]any{})
		last["usage"] = e.openaiUsage()
		if !st.send("", last) {
			return
		}
	}
	st.send("", []byte("[DONE]"))
}
