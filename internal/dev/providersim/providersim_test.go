package providersim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testutil"
)

const testKey = "sk-sim-test-1234"

func newSim(t *testing.T) (*Server, *httptest.Server) {
	t.Helper()
	s := New(Options{Keys: []string{"sk-other-9999", testKey}, Slow: 50 * time.Millisecond, TokenInterval: 5 * time.Millisecond})
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return s, hs
}

// do sends body to path with the API's key header (key "" sends none).
func do(t *testing.T, ctx context.Context, hs *httptest.Server, api, path, key, body string) *http.Response {
	t.Helper()
	resp, err := hs.Client().Do(requestWithKey(ctx, hs, api, path, key, body))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return resp
}

// requestWithKey is a POST of body (a GET when it is empty) with the API's
// key header; key "" sends none.
func requestWithKey(ctx context.Context, hs *httptest.Server, api, path, key, body string) *http.Request {
	method := http.MethodPost
	if body == "" {
		method = http.MethodGet
	}
	req, _ := http.NewRequestWithContext(ctx, method, hs.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	switch {
	case key == "":
	case api == "anthropic":
		req.Header.Set("x-api-key", key)
	default:
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if api == "anthropic" {
		req.Header.Set("anthropic-version", "2023-06-01")
	}
	return req
}

func request(ctx context.Context, hs *httptest.Server, api, path, body string) *http.Request {
	return requestWithKey(ctx, hs, api, path, testKey, body)
}

func decode(t *testing.T, resp *http.Response) map[string]any {
	t.Helper()
	defer resp.Body.Close()
	var v map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatalf("decode %d body: %v", resp.StatusCode, err)
	}
	return v
}

type event struct{ name, data string }

// readEvents reads a whole SSE body.
func readEvents(t *testing.T, resp *http.Response) []event {
	t.Helper()
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type = %q, want text/event-stream", ct)
	}
	var evs []event
	r := bufio.NewReader(resp.Body)
	for {
		ev, err := nextEvent(r)
		if err == io.EOF {
			return evs
		}
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev)
	}
}

func nextEvent(r *bufio.Reader) (event, error) {
	var ev event
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			if line == "" && ev == (event{}) {
				return ev, io.EOF
			}
			return ev, fmt.Errorf("event cut short at %q: %w", line, err)
		}
		line = strings.TrimSuffix(line, "\n")
		switch {
		case line == "":
			return ev, nil
		case strings.HasPrefix(line, "event: "):
			ev.name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			ev.data = strings.TrimPrefix(line, "data: ")
		default:
			return ev, fmt.Errorf("unexpected line %q", line)
		}
	}
}

func jsonOf(t *testing.T, s string) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("decode %q: %v", s, err)
	}
	return v
}

// at walks a decoded JSON value: keys for objects, ints for arrays.
func at(v any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, _ := v.(map[string]any)
			v = m[k]
		case int:
			a, _ := v.([]any)
			if k >= len(a) {
				return nil
			}
			v = a[k]
		}
	}
	return v
}

func num(v any) int { f, _ := v.(float64); return int(f) }

// The conversation every wire test sends: 2 + 3 + 2 words, the last
// message "hello there", so input 7, cached 5 and the reply
// "echo: hello there hello there …" of 12 tokens.
const (
	convoOpenAI    = `[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"what is"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"this"}]},{"role":"user","content":"hello there"}]`
	convoAnthropic = `"system":"be brief","messages":[{"role":"user","content":[{"type":"text","text":"what is this"}]},{"role":"user","content":"hello there"}]`
	wantReply      = "echo: hello there hello there hello there hello there hello there hello"
)

func TestOpenAIStream(t *testing.T) {
	for _, tt := range []struct {
		name, model, options string
		usage                bool
	}{
		{"usage asked", "deepseek-chat", `,"stream_options":{"include_usage":true}`, true},
		{"usage not asked", "deepseek-chat", ``, false},
		{"usage asked of a usage-less model", "deepseek-chat-nousage", `,"stream_options":{"include_usage":true}`, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, hs := newSim(t)
			resp := do(t, t.Context(), hs, "openai", "/v1/chat/completions", testKey,
				`{"model":"`+tt.model+`","stream":true,"messages":`+convoOpenAI+tt.options+`}`)
			evs := readEvents(t, resp)
			if last := evs[len(evs)-1]; last != (event{data: "[DONE]"}) {
				t.Fatalf("last event = %+v, want data: [DONE]", last)
			}
			var text strings.Builder
			var finish []any
			var usage []map[string]any
			for i, ev := range evs[:len(evs)-1] {
				c := jsonOf(t, ev.data)
				if c["object"] != "chat.completion.chunk" || c["model"] != tt.model || ev.name != "" {
					t.Fatalf("chunk %d = %s", i, ev.data)
				}
				if u, present := c["usage"]; present != tt.usage {
					t.Fatalf("chunk %d has usage %v, want present=%v", i, u, tt.usage)
				} else if u != nil {
					usage = append(usage, u.(map[string]any))
					if n := len(c["choices"].([]any)); n != 0 || i != len(evs)-2 {
						t.Fatalf("usage chunk %d of %d has %d choices, want the last with none", i, len(evs), n)
					}
					continue
				}
				if i == 0 && at(c, "choices", 0, "delta", "role") != "assistant" {
					t.Fatalf("first chunk = %s, want the role", ev.data)
				}
				if s, ok := at(c, "choices", 0, "delta", "content").(string); ok {
					text.WriteString(s)
				}
				if f := at(c, "choices", 0, "finish_reason"); f != nil {
					finish = append(finish, f)
				}
			}
			if text.String() != wantReply || !reflect.DeepEqual(finish, []any{"stop"}) {
				t.Fatalf("reply %q finish %v, want %q stop", text.String(), finish, wantReply)
			}
			if tt.usage {
				want := map[string]any{"prompt_tokens": 7.0, "completion_tokens": 12.0, "total_tokens": 19.0, "prompt_tokens_details": map[string]any{"cached_tokens": 5.0}}
				if len(usage) != 1 || !reflect.DeepEqual(usage[0], want) {
					t.Fatalf("usage = %v, want %v", usage, want)
				}
			}
			// The call log counts as the usage does, whether or not it was sent.
			want := Call{KeyHint: "1234", API: "openai", Path: "/v1/chat/completions", Model: tt.model, Stream: true, Status: 200,
				Remote: "127.0.0.1", InputTokens: 7, CachedTokens: 5, OutputTokens: 12}
			if got := s.Calls(); len(got) != 1 || got[0] != want {
				t.Fatalf("calls = %+v, want %+v", got, want)
			}
		})
	}
}

func TestOpenAINonStream(t *testing.T) {
	for _, tt := range []struct {
		name, path, model, limit string
		content, finish          string
		usage                    bool
	}{
		{"v1 path", "/v1/chat/completions", "gpt-4o-mini", ``, wantReply, "stop", true},
		{"DeepSeek's path", "/chat/completions", "deepseek-chat", ``, wantReply, "stop", true},
		{"max_tokens cuts", "/v1/chat/completions", "deepseek-chat", `,"max_tokens":3`, "echo: hello there", "length", true},
		{"max_completion_tokens wins", "/v1/chat/completions", "deepseek-chat", `,"max_tokens":3,"max_completion_tokens":2`, "echo: hello", "length", true},
		{"no usage", "/v1/chat/completions", "deepseek-chat-nousage", ``, wantReply, "stop", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, hs := newSim(t)
			resp := do(t, t.Context(), hs, "openai", tt.path, testKey, `{"model":"`+tt.model+`","messages":`+convoOpenAI+tt.limit+`}`)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			v := decode(t, resp)
			if v["object"] != "chat.completion" || at(v, "choices", 0, "message", "content") != tt.content ||
				at(v, "choices", 0, "message", "role") != "assistant" || at(v, "choices", 0, "finish_reason") != tt.finish {
				t.Fatalf("answer = %v", v)
			}
			u, present := v["usage"]
			if present != tt.usage {
				t.Fatalf("usage %v, want present=%v", u, tt.usage)
			}
			out := CountTokens(tt.content)
			if tt.usage && (num(at(u, "prompt_tokens")) != 7 || num(at(u, "completion_tokens")) != out ||
				num(at(u, "total_tokens")) != 7+out || num(at(u, "prompt_tokens_details", "cached_tokens")) != 5) {
				t.Fatalf("usage = %v, want 7 in (5 cached), %d out", u, out)
			}
		})
	}
}

func TestAnthropicStream(t *testing.T) {
	for _, tt := range []struct {
		name, model string
		usage       bool
	}{
		{"usage", "claude-sonnet-4-5", true},
		{"no usage", "claude-sonnet-4-5-nousage", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, hs := newSim(t)
			resp := do(t, t.Context(), hs, "anthropic", "/v1/messages", testKey,
				`{"model":"`+tt.model+`","max_tokens":100,"stream":true,`+convoAnthropic+`}`)
			evs := readEvents(t, resp)
			var names []string
			var text strings.Builder
			for _, ev := range evs {
				names = append(names, ev.name)
				d := jsonOf(t, ev.data)
				if d["type"] != ev.name {
					t.Fatalf("event %s carries type %v", ev.name, d["type"])
				}
				switch ev.name {
				case "message_start":
					u, present := at(d, "message").(map[string]any)["usage"]
					if present != tt.usage || at(d, "message", "model") != tt.model || at(d, "message", "role") != "assistant" {
						t.Fatalf("message_start = %s", ev.data)
					}
					if tt.usage && (num(at(u, "input_tokens")) != 2 || num(at(u, "cache_read_input_tokens")) != 5) {
						t.Fatalf("message_start usage = %v, want 2 uncached + 5 cache read", u)
					}
				case "content_block_delta":
					if at(d, "delta", "type") != "text_delta" {
						t.Fatalf("delta = %s", ev.data)
					}
					text.WriteString(at(d, "delta", "text").(string))
				case "message_delta":
					u, present := d["usage"]
					if present != tt.usage || at(d, "delta", "stop_reason") != "end_turn" {
						t.Fatalf("message_delta = %s", ev.data)
					}
					if tt.usage && num(at(u, "output_tokens")) != 12 {
						t.Fatalf("message_delta usage = %v, want 12 out", u)
					}
				}
			}
			want := "message_start content_block_start ping" + strings.Repeat(" content_block_delta", 12) + " content_block_stop message_delta message_stop"
			if strings.Join(names, " ") != want || text.String() != wantReply {
				t.Fatalf("events %v text %q", names, text.String())
			}
			if got := s.Calls(); len(got) != 1 || got[0].API != "anthropic" || got[0].KeyHint != "1234" || got[0].InputTokens != 7 || got[0].CachedTokens != 5 || got[0].OutputTokens != 12 {
				t.Fatalf("calls = %+v", got)
			}
		})
	}
}

func TestAnthropicNonStream(t *testing.T) {
	_, hs := newSim(t)
	v := decode(t, do(t, t.Context(), hs, "anthropic", "/v1/messages", testKey, `{"model":"claude-x","max_tokens":4,`+convoAnthropic+`}`))
	want := map[string]any{
		"type": "message", "role": "assistant", "model": "claude-x", "stop_reason": "max_tokens", "stop_sequence": nil,
		"content": []any{map[string]any{"type": "text", "text": "echo: hello there hello"}},
		"usage":   map[string]any{"input_tokens": 2.0, "cache_creation_input_tokens": 0.0, "cache_read_input_tokens": 5.0, "output_tokens": 4.0},
	}
	delete(v, "id")
	if !reflect.DeepEqual(v, want) {
		t.Fatalf("answer = %v\nwant     %v", v, want)
	}
	v = decode(t, do(t, t.Context(), hs, "anthropic", "/v1/messages", testKey, `{"model":"claude-x-nousage","max_tokens":4,`+convoAnthropic+`}`))
	if _, present := v["usage"]; present || v["type"] != "message" {
		t.Fatalf("usage-less answer = %v", v)
	}
}

// Errors are the provider's own shape, and only a known key is served.
func TestErrorsInTheProvidersShape(t *testing.T) {
	const chat = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	const msgs = `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`
	for _, tt := range []struct {
		name, api, path, key, body string
		header                     [2]string // replaces or adds one header
		status                     int
		kind                       string
	}{
		{"openai no key", "openai", "/v1/chat/completions", "", chat, [2]string{}, 401, "invalid_request_error"},
		{"openai wrong key", "openai", "/v1/chat/completions", "sk-wrong", chat, [2]string{}, 401, "invalid_request_error"},
		{"openai key prefix", "openai", "/v1/chat/completions", "sk-sim-test-123", chat, [2]string{}, 401, "invalid_request_error"},
		{"openai key in x-api-key", "openai", "/v1/chat/completions", "", chat, [2]string{"x-api-key", testKey}, 401, "invalid_request_error"},
		{"models wrong key", "openai", "/v1/models", "sk-wrong", "", [2]string{}, 401, "invalid_request_error"},
		{"anthropic no key", "anthropic", "/v1/messages", "", msgs, [2]string{}, 401, "authentication_error"},
		{"anthropic key as bearer", "anthropic", "/v1/messages", "", msgs, [2]string{"Authorization", "Bearer " + testKey}, 401, "authentication_error"},
		{"anthropic no version", "anthropic", "/v1/messages", testKey, msgs, [2]string{"anthropic-version", ""}, 400, "invalid_request_error"},
		{"openai malformed JSON", "openai", "/v1/chat/completions", testKey, `{"model":`, [2]string{}, 400, "invalid_request_error"},
		{"openai no model", "openai", "/v1/chat/completions", testKey, `{"messages":[{"role":"user","content":"hi"}]}`, [2]string{}, 400, "invalid_request_error"},
		{"openai no messages", "openai", "/v1/chat/completions", testKey, `{"model":"m"}`, [2]string{}, 400, "invalid_request_error"},
		{"openai bad content", "openai", "/v1/chat/completions", testKey, `{"model":"m","messages":[{"role":"user","content":7}]}`, [2]string{}, 400, "invalid_request_error"},
		{"openai too big", "openai", "/v1/chat/completions", testKey, `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", maxBody) + `"}]}`, [2]string{}, 413, "invalid_request_error"},
		{"openai fail", "openai", "/v1/chat/completions", testKey, `{"model":"m-fail","stream":true,"messages":[{"role":"user","content":"hi"}]}`, [2]string{}, 500, "server_error"},
		{"anthropic malformed JSON", "anthropic", "/v1/messages", testKey, `[`, [2]string{}, 400, "invalid_request_error"},
		{"anthropic no max_tokens", "anthropic", "/v1/messages", testKey, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, [2]string{}, 400, "invalid_request_error"},
		{"anthropic no role", "anthropic", "/v1/messages", testKey, `{"model":"m","max_tokens":5,"messages":[{"content":"hi"}]}`, [2]string{}, 400, "invalid_request_error"},
		{"anthropic too big", "anthropic", "/v1/messages", testKey, `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"` + strings.Repeat("a", maxBody) + `"}]}`, [2]string{}, 413, "request_too_large"},
		{"anthropic fail", "anthropic", "/v1/messages", testKey, `{"model":"m-slow-fail","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}]}`, [2]string{}, 500, "api_error"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, hs := newSim(t)
			method := http.MethodPost
			if tt.body == "" {
				method = http.MethodGet
			}
			req, _ := http.NewRequestWithContext(t.Context(), method, hs.URL+tt.path, strings.NewReader(tt.body))
			switch {
			case tt.key != "" && tt.api == "anthropic":
				req.Header.Set("x-api-key", tt.key)
			case tt.key != "":
				req.Header.Set("Authorization", "Bearer "+tt.key)
			}
			if tt.api == "anthropic" {
				req.Header.Set("anthropic-version", "2023-06-01")
			}
			if tt.header[0] != "" {
				req.Header.Set(tt.header[0], tt.header[1])
			}
			resp, err := hs.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			v := decode(t, resp)
			var kind, msg any
			if tt.api == "anthropic" {
				if v["type"] != "error" {
					t.Fatalf("anthropic error without type error: %v", v)
				}
				kind, msg = at(v, "error", "type"), at(v, "error", "message")
			} else {
				kind, msg = at(v, "error", "type"), at(v, "error", "message")
			}
			if resp.StatusCode != tt.status || kind != tt.kind || msg == "" || msg == nil {
				t.Fatalf("= %d %v, want %d of type %s with a message", resp.StatusCode, v, tt.status, tt.kind)
			}
		})
	}
}

func TestModelsListsInOpenAIShape(t *testing.T) {
	_, hs := newSim(t)
	for _, path := range []string{"/v1/models", "/models"} {
		v := decode(t, do(t, t.Context(), hs, "openai", path, testKey, ""))
		if v["object"] != "list" || at(v, "data", 0, "id") != "deepseek-chat" || at(v, "data", 0, "object") != "model" {
			t.Fatalf("%s = %v", path, v)
		}
	}
}

// leaving serves s to a client that leaves as soon as its request has
// arrived whole; the returned context is the client's.
func leaving(t *testing.T, s *Server) (*httptest.Server, context.Context) {
	ctx, cancel := context.WithCancel(t.Context())
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		cancel()
		s.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)
	return hs, ctx
}

// -slow holds the first byte for Options.Slow; a client that leaves
// meanwhile is recorded as gone, with nothing sent.
func TestSlow(t *testing.T) {
	s, hs := newSim(t)
	start := time.Now()
	resp := do(t, t.Context(), hs, "openai", "/v1/chat/completions", testKey, `{"model":"m-slow","messages":[{"role":"user","content":"hi"}]}`)
	if waited := time.Since(start); waited < s.opts.Slow {
		t.Fatalf("-slow answered after %s, before %s", waited, s.opts.Slow)
	}
	if v := decode(t, resp); at(v, "choices", 0, "message", "content") != "echo: hi hi hi hi hi hi hi hi hi hi hi" {
		t.Fatalf("-slow answer = %v", v)
	}

	slow := New(Options{Keys: []string{testKey}, Slow: time.Hour})
	hs2, ctx := leaving(t, slow)
	if resp, err := hs2.Client().Do(request(ctx, hs2, "anthropic", "/v1/messages", `{"model":"m-slow","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)); err == nil {
		resp.Body.Close()
		t.Fatal("the slow call answered within an hour")
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if len(slow.Calls()) == 0 {
			return fmt.Errorf("the handler of the call whose client left has not ended")
		}
		return nil
	})
	if got := slow.Calls()[0]; got.Status != statusClientGone || got.OutputTokens != 0 || got.InputTokens != 1 {
		t.Fatalf("call whose client left = %+v", got)
	}
}

// -long streams until the client leaves, and then its handler ends (the
// call is recorded only when the handler returns).
func TestLongEndsWhenTheClientLeaves(t *testing.T) {
	for _, tt := range []struct {
		name, api, path, body string
		isDelta               func(event) bool // nil: not streamed
	}{
		{"openai stream", "openai", "/v1/chat/completions", `{"model":"m-long","stream":true,"messages":[{"role":"user","content":"go on"}]}`,
			func(ev event) bool {
				return strings.Contains(ev.data, `"delta":{"content"`) && !strings.Contains(ev.data, `"role"`)
			}},
		{"anthropic stream", "anthropic", "/v1/messages", `{"model":"m-long","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"go on"}]}`,
			func(ev event) bool { return ev.name == "content_block_delta" }},
		{"openai not streamed", "openai", "/v1/chat/completions", `{"model":"m-long","messages":[{"role":"user","content":"go on"}]}`, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, hs := newSim(t)
			if tt.isDelta == nil { // the answer never comes
				hs, ctx := leaving(t, s)
				if resp, err := hs.Client().Do(request(ctx, hs, tt.api, tt.path, tt.body)); err == nil {
					resp.Body.Close()
					t.Fatal("a non-streamed -long call answered")
				}
			} else {
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				resp, err := hs.Client().Do(request(ctx, hs, tt.api, tt.path, tt.body))
				if err != nil {
					t.Fatal(err)
				}
				r := bufio.NewReader(resp.Body)
				for deltas := 0; deltas < 30; { // more than a reply has: the stream goes on
					ev, err := nextEvent(r)
					if err != nil {
						t.Fatal(err)
					}
					if tt.isDelta(ev) {
						deltas++
					}
				}
				cancel()
				resp.Body.Close()
			}
			testutil.Eventually(t, 10*time.Second, func() error {
				if len(s.Calls()) != 1 {
					return fmt.Errorf("the -long handler has not ended")
				}
				return nil
			})
			c := s.Calls()[0]
			if tt.isDelta == nil && c.Status != statusClientGone || tt.isDelta != nil && (c.Status != 200 || c.OutputTokens < 30) {
				t.Fatalf("call = %+v", c)
			}
		})
	}
}

func TestCallLogListsAndResets(t *testing.T) {
	_, hs := newSim(t)
	do(t, t.Context(), hs, "openai", "/v1/chat/completions", "sk-other-9999", `{"model":"m","messages":[{"role":"user","content":"a b c"}]}`).Body.Close()
	do(t, t.Context(), hs, "anthropic", "/v1/messages", "bad", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`).Body.Close()
	resp, err := hs.Client().Get(hs.URL + "/_sim/calls")
	if err != nil {
		t.Fatal(err)
	}
	var calls []map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&calls); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	want := []map[string]any{
		{"key_hint": "9999", "api": "openai", "path": "/v1/chat/completions", "model": "m", "stream": false, "status": 200.0, "remote": "127.0.0.1", "input_tokens": 3.0, "cached_tokens": 0.0, "output_tokens": 12.0},
		{"key_hint": "bad", "api": "anthropic", "path": "/v1/messages", "stream": false, "status": 401.0, "remote": "127.0.0.1", "input_tokens": 0.0, "cached_tokens": 0.0, "output_tokens": 0.0},
	}
	if !reflect.DeepEqual(calls, want) {
		t.Fatalf("calls = %v\nwant    %v", calls, want)
	}
	req, _ := http.NewRequest(http.MethodDelete, hs.URL+"/_sim/calls", nil)
	if resp, err := hs.Client().Do(req); err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("DELETE = %v %v", resp, err)
	}
	resp, _ = hs.Client().Get(hs.URL + "/_sim/calls")
	if b, _ := io.ReadAll(resp.Body); strings.TrimSpace(string(b)) != "[]" {
		t.Fatalf("after reset: %s", b)
	}
}

func TestParseModel(t *testing.T) {
	for _, tt := range []struct {
		model string
		want  Switches
	}{
		{"deepseek-chat", Switches{}},
		{"deepseek-chat-slow", Switches{Slow: true}},
		{"x-fail", Switches{Fail: true}},
		{"x-nousage-long", Switches{NoUsage: true, Long: true}},
		{"x-long-slow-nousage-fail", Switches{true, true, true, true}},
		{"slow", Switches{}},
		{"x-slowly", Switches{}},
	} {
		if got := ParseModel(tt.model); got != tt.want {
			t.Errorf("ParseModel(%q) = %+v, want %+v", tt.model, got, tt.want)
		}
	}
}

func TestTokenRule(t *testing.T) {
	for _, tt := range []struct {
		texts         []string
		input, cached int
		reply         string
	}{
		{nil, 0, 0, "echo: ok ok"},
		{[]string{"hi"}, 1, 0, "echo: hi hi"},
		{[]string{"  a\tb\n", "c d e"}, 5, 2, "echo: c d"},
		{[]string{"sys", "q", ""}, 2, 2, "echo: ok ok"},
	} {
		p := prompt{texts: tt.texts}
		in, cached := p.usage()
		if in != tt.input || cached != tt.cached || p.reply(3) != tt.reply || CountTokens(p.reply(3)) != 3 {
			t.Errorf("%q: usage %d/%d reply %q, want %d/%d %q", tt.texts, in, cached, p.reply(3), tt.input, tt.cached, tt.reply)
		}
	}
}

func TestOptionsFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	o, err := OptionsFromEnv(env(map[string]string{"PROVIDERSIM_KEYS": " a, b ,,", "PROVIDERSIM_SLOW": "2s"}))
	if err != nil || !reflect.DeepEqual(o, Options{Listen: ":8091", Keys: []string{"a", "b"}, Slow: 2 * time.Second, TokenInterval: 100 * time.Millisecond}) {
		t.Fatalf("options = %+v, %v", o, err)
	}
	for _, bad := range []map[string]string{
		{},
		{"PROVIDERSIM_KEYS": " , "},
		{"PROVIDERSIM_KEYS": "a", "PROVIDERSIM_SLOW": "soon"},
		{"PROVIDERSIM_KEYS": "a", "PROVIDERSIM_TOKEN_INTERVAL": "-1s"},
	} {
		if _, err := OptionsFromEnv(env(bad)); err == nil {
			t.Errorf("OptionsFromEnv(%v) accepted", bad)
		}
	}
}

// Whatever body arrives, the stand-in answers in the API's shape without
// panicking: a JSON object, 200 or a 4xx.
func FuzzRequestBodies(f *testing.F) {
	f.Add(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, false)
	f.Add(`{"model":"m","max_tokens":3,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"text","text":"a b"}]}]}`, true)
	f.Add(`{"model":"m","messages":[{"role":"user","content":null}],"max_tokens":-5}`, false)
	// -long ends with the request's deadline, a few tokens in.
	s := New(Options{Keys: []string{testKey}, TokenInterval: 10 * time.Millisecond})
	f.Fuzz(func(t *testing.T, body string, anthropic bool) {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		path := "/v1/chat/completions"
		if anthropic {
			path = "/v1/messages"
		}
		req := httptest.NewRequestWithContext(ctx, http.MethodPost, path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+testKey)
		req.Header.Set("x-api-key", testKey)
		req.Header.Set("anthropic-version", "2023-06-01")
		w := httptest.NewRecorder()
		s.ServeHTTP(w, req)
		if w.Code != http.StatusOK && (w.Code < 400 || w.Code > 499) && w.Code != http.StatusInternalServerError {
			t.Fatalf("status %d for %q", w.Code, body)
		}
		if w.Header().Get("Content-Type") == "application/json" && !json.Valid(w.Body.Bytes()) {
			t.Fatalf("answer %q is not JSON", w.Body.String())
		}
	})
}
