package broker

import (
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

// Payloads in the shapes the providers send (from their API references).
const (
	openaiStream = `data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":0}}}

data: [DONE]

`
	deepseekStream = `data: {"id":"a1","object":"chat.completion.chunk","created":1,"model":"deepseek-chat","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}

data: {"id":"a1","object":"chat.completion.chunk","created":1,"model":"deepseek-chat","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":20,"total_tokens":31,"prompt_tokens_details":{"cached_tokens":0},"prompt_cache_hit_tokens":8,"prompt_cache_miss_tokens":3}}

data: [DONE]

`
	openaiNoUsage = `data: {"choices":[{"index":0,"delta":{"content":"abcdefgh"}}]}

data: {"choices":[{"index":0,"delta":{"reasoning_content":"abcd"}}]}

data: [DONE]

`
	openaiBody      = `{"id":"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG","object":"chat.completion","created":1741570283,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"message":{"role":"assistant","content":"The image shows a wooden boardwalk.","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1117,"completion_tokens":46,"total_tokens":1163,"prompt_tokens_details":{"cached_tokens":1024,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_fc9f1d7035"}`
	anthropicStream = `event: message_start
data: {"type":"message_start","message":{"id":"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY","type":"message","role":"assistant","content":[],"model":"claude-3-5-sonnet-20241022","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,"cache_creation_input_tokens":0,"cache_read_input_tokens":100,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"!"}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":15}}

event: message_stop
data: {"type":"message_stop"}

`
	anthropicCut = `event: message_start
data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-x","usage":{"input_tokens":25,"output_tokens":1}}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello there"}}

`
	anthropicBody = `{"content":[{"text":"Hi! My name is Claude.","type":"text"}],"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","model":"claude-3-7-sonnet-20250219","role":"assistant","stop_reason":"end_turn","stop_sequence":null,"type":"message","usage":{"input_tokens":2095,"cache_creation_input_tokens":5,"cache_read_input_tokens":10,"output_tokens":503}}`
)

func TestMeter(t *testing.T) {
	for _, tc := range []struct {
		name, api, answer string
		sse               bool
		request           int
		want              Usage
	}{
		{"openai stream", config.APIOpenAI, openaiStream, true, 0, Usage{Input: 9, Output: 12, Cached: 4}},
		{"openai stream CRLF", config.APIOpenAI, strings.ReplaceAll(openaiStream, "\n", "\r\n"), true, 0, Usage{Input: 9, Output: 12, Cached: 4}},
		{"deepseek stream", config.APIOpenAI, deepseekStream, true, 0, Usage{Input: 11, Output: 20, Cached: 8}},
		{"openai stream without usage", config.APIOpenAI, openaiNoUsage, true, 400, Usage{Input: 100, Output: 3, Estimated: true}},
		{"openai body", config.APIOpenAI, openaiBody, false, 0, Usage{Input: 1117, Output: 46, Cached: 1024}},
		{"openai body without usage", config.APIOpenAI, `{"choices":[{"message":{"content":"12345678"}}]}`, false, 40, Usage{Input: 10, Output: 2, Estimated: true}},
		{"anthropic stream", config.APIAnthropic, anthropicStream, true, 0, Usage{Input: 125, Output: 15, Cached: 100}},
		{"anthropic stream cut before message_delta", config.APIAnthropic, anthropicCut, true, 0, Usage{Input: 25, Output: 1}},
		{"anthropic body", config.APIAnthropic, anthropicBody, false, 0, Usage{Input: 2110, Output: 503, Cached: 10, CacheWrite: 5}},
		{"anthropic no usage", config.APIAnthropic, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"abcdefgh\"}}\n\n", true, 8, Usage{Input: 2, Output: 2, Estimated: true}},
		{"not JSON at all", config.APIOpenAI, "<html>oops</html>", false, 4, Usage{Input: 1, Output: 0, Estimated: true}},
		{"negative counts", config.APIOpenAI, `{"usage":{"prompt_tokens":-5,"completion_tokens":-1,"prompt_tokens_details":{"cached_tokens":-3}}}`, false, 0, Usage{}},
		{"cached over input", config.APIOpenAI, `{"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":30}}}`, false, 0, Usage{Input: 5, Output: 1, Cached: 5}},
		{"overlong line skipped, the next read", config.APIOpenAI, "data: {\"x\":\"" + strings.Repeat("a", maxLine) + "\"}\n\n" + deepseekStream, true, 0, Usage{Input: 11, Output: 20, Cached: 8}},
		{"body over the cap estimated from its bytes", config.APIOpenAI, `{"usage":{"prompt_tokens":1},"x":"` + strings.Repeat("a", maxBody) + `"}`, false, 8, Usage{Input: 2, Output: (int64(maxBody) + 36 + 3) / 4, Estimated: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Whatever pieces the answer arrives in, the result is the same.
			for _, size := range []int{1, 7, 64, 4096, len(tc.answer)} {
				m := newMeter(tc.api, tc.sse)
				for i := 0; i < len(tc.answer); i += size {
					m.Write([]byte(tc.answer[i:min(i+size, len(tc.answer))]))
					if len(m.line) > maxLine || len(m.body) > maxBody {
						t.Fatalf("holding %d line bytes, %d body bytes", len(m.line), len(m.body))
					}
				}
				if got := m.Result(tc.request); got != tc.want {
					t.Fatalf("pieces of %d: got %+v, want %+v", size, got, tc.want)
				}
			}
		})
	}
}

func TestCost(t *testing.T) {
	p := config.Price{Input: 0.27, Output: 1.1, Cached: 0.07}
	for _, tc := range []struct {
		name  string
		u     Usage
		price config.Price
		want  int64
	}{
		{"uncached", Usage{Input: 1000, Output: 500}, p, 270 + 550},
		{"cached part of input", Usage{Input: 1000, Output: 500, Cached: 400}, p, 162 + 28 + 550},
		{"no cached price charges cached as input", Usage{Input: 1000, Cached: 400}, config.Price{Input: 0.27}, 270},
		{"rounded to the micro-USD", Usage{Input: 1, Output: 1}, p, 1},
		{"no price", Usage{Input: 1e6, Output: 1e6}, config.Price{}, 0},
		{"one million tokens at one USD", Usage{Input: 1e6}, config.Price{Input: 1}, 1e6},
		{"negative ignored", Usage{Input: -5, Output: -5, Cached: -5, CacheWrite: -5}, p, 0},
		{"cache writes at their price", Usage{Input: 1000, Cached: 400, CacheWrite: 100}, config.Price{Input: 3, Cached: 0.3, CacheWrite: 3.75}, 1500 + 120 + 375},
		{"no cache-write price charges writes as input", Usage{Input: 1000, CacheWrite: 100}, config.Price{Input: 3}, 3000},
		{"writes over the uncached input are capped", Usage{Input: 10, Cached: 6, CacheWrite: 50}, config.Price{Input: 1, CacheWrite: 2}, 6 + 4*2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Cost(tc.u, tc.price); got != tc.want {
				t.Fatalf("got %d, want %d", got, tc.want)
			}
		})
	}
}

// fuzzMeter checks what must hold of any answer: no panic, bounded
// memory, sane counts, and the same result however the bytes are split.
func fuzzMeter(t *testing.T, api string, data []byte, split uint16, sse bool) {
	whole := newMeter(api, sse)
	whole.Write(data)
	want := whole.Result(len(data))
	at := int(split) % (len(data) + 1)
	parts := newMeter(api, sse)
	parts.Write(data[:at])
	parts.Write(data[at:])
	if len(parts.line) > maxLine || len(parts.body) > maxBody {
		t.Fatalf("holding %d line bytes, %d body bytes", len(parts.line), len(parts.body))
	}
	if got := parts.Result(len(data)); got != want {
		t.Fatalf("split at %d: %+v, whole: %+v", at, got, want)
	}
	if want.Input < 0 || want.Output < 0 || want.Cached < 0 || want.CacheWrite < 0 || want.Cached+want.CacheWrite > want.Input {
		t.Fatalf("counts %+v", want)
	}
}

func FuzzUsageOpenAI(f *testing.F) {
	for _, s := range []string{openaiStream, deepseekStream, openaiNoUsage, openaiBody, "data: {\"usage\":{\"prompt_tokens\":1e400}}\n"} {
		f.Add([]byte(s), uint16(len(s)/2), true)
	}
	f.Add([]byte(openaiBody), uint16(10), false)
	f.Fuzz(func(t *testing.T, data []byte, split uint16, sse bool) {
		fuzzMeter(t, config.APIOpenAI, data, split, sse)
	})
}

func FuzzUsageAnthropic(f *testing.F) {
	for _, s := range []string{anthropicStream, anthropicCut} {
		f.Add([]byte(s), uint16(len(s)/3), true)
	}
	f.Add([]byte(anthropicBody), uint16(100), false)
	f.Fuzz(func(t *testing.T, data []byte, split uint16, sse bool) {
		fuzzMeter(t, config.APIAnthropic, data, split, sse)
	})
}
