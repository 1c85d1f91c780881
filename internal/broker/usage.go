package broker

import (
	"bytes"
	"encoding/json"
	"math"

	"github.com/aaas-project/aaas/internal/config"
)

// Usage is the tokens of one call. Cached tokens (read from the
// provider's cache) and CacheWrite tokens (written to it, Anthropic's
// cache_creation_input_tokens) are part of Input, for both APIs, as the
// meter counts them.
type Usage struct {
	Input, Output, Cached, CacheWrite int64
	// Estimated is set when the provider did not report (all of) it and
	// the missing counts were estimated from bytes.
	Estimated bool
}

// Bounds of what the meter holds: a stream's line or a plain body over
// these is relayed all the same but not read (the tokens are then
// estimated), so no answer makes the broker hold more than this per call.
const (
	maxLine = 256 << 10
	maxBody = 1 << 20
	// bytesPerToken is the estimate's rule of thumb.
	bytesPerToken = 4
)

// meter watches the bytes of a provider's answer as they are relayed and
// reads the usage the provider reports: OpenAI's usage object (a
// stream's final chunk, or the body's), Anthropic's message_start and
// message_delta usage (or the body's). It never holds the stream back:
// Write only looks.
type meter struct {
	api string
	sse bool
	// line is the SSE line being read, body the plain answer; skipping is
	// set while the rest of an overlong line goes by.
	line     []byte
	skipping bool
	body     []byte
	overflow bool
	// total is every byte of the answer.
	total int64

	input, output, cached, cacheWrite int64
	// inputSeen and outputSeen: the provider reported the count.
	inputSeen, outputSeen bool
	// content is the bytes of generated text seen, for the estimate.
	content int64
}

func newMeter(api string, sse bool) *meter { return &meter{api: api, sse: sse} }

// Write reads p, a piece of the answer.
func (m *meter) Write(p []byte) {
	m.total += int64(len(p))
	if !m.sse {
		if !m.overflow && len(m.body)+len(p) <= maxBody {
			m.body = append(m.body, p...)
		} else {
			m.overflow, m.body = true, nil
		}
		return
	}
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		chunk := p
		if i >= 0 {
			chunk = p[:i]
		}
		if !m.skipping {
			if len(m.line)+len(chunk) > maxLine {
				m.skipping, m.line = true, m.line[:0]
			} else {
				m.line = append(m.line, chunk...)
			}
		}
		if i < 0 {
			return
		}
		if !m.skipping {
			m.sseLine(m.line)
		}
		m.line, m.skipping = m.line[:0], false
		p = p[i+1:]
	}
}

// sseLine reads one line of an event stream: only data lines matter.
func (m *meter) sseLine(line []byte) {
	line = bytes.TrimSuffix(line, []byte("\r"))
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return
	}
	data = bytes.TrimLeft(data, " ")
	if len(data) == 0 || data[0] != '{' {
		return // [DONE], keep-alives
	}
	m.object(data)
}

// Result is the call's usage, once the answer has ended: what the
// provider reported, the rest estimated (requestBytes/4 input, generated
// text/4 output, rounded up).
func (m *meter) Result(requestBytes int) Usage {
	if !m.sse && !m.overflow && len(m.body) > 0 {
		m.object(m.body)
		m.body = nil
	}
	if m.overflow {
		m.content = m.total // too long to read: all of it counts as text
	}
	u := Usage{Input: m.input, Output: m.output, Cached: min(m.cached, m.input)}
	u.CacheWrite = min(m.cacheWrite, u.Input-u.Cached)
	if !m.inputSeen {
		u.Input, u.Cached, u.CacheWrite, u.Estimated = estimate(int64(requestBytes)), 0, 0, true
	}
	if !m.outputSeen {
		u.Output, u.Estimated = estimate(m.content), true
	}
	return u
}

// estimate is the tokens of n bytes of text, rounded up: any text is at
// least a token.
func estimate(n int64) int64 { return (max(n, 0) + bytesPerToken - 1) / bytesPerToken }

type openaiUsage struct {
	PromptTokens        *int64 `json:"prompt_tokens"`
	CompletionTokens    *int64 `json:"completion_tokens"`
	InputTokens         *int64 `json:"input_tokens"`  // the Responses API
	OutputTokens        *int64 `json:"output_tokens"` // the Responses API
	PromptTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	InputTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	// PromptCacheHitTokens is DeepSeek's name for cached input.
	PromptCacheHitTokens int64 `json:"prompt_cache_hit_tokens"`
}

type openaiText struct {
	Content          json.RawMessage `json:"content"`
	ReasoningContent json.RawMessage `json:"reasoning_content"`
	ToolCalls        json.RawMessage `json:"tool_calls"`
}

type openaiObject struct {
	Usage   *openaiUsage `json:"usage"`
	Choices []struct {
		Delta   *openaiText     `json:"delta"`
		Message *openaiText     `json:"message"`
		Text    json.RawMessage `json:"text"`
	} `json:"choices"`
}

type anthropicUsage struct {
	InputTokens          *int64 `json:"input_tokens"`
	OutputTokens         *int64 `json:"output_tokens"`
	CacheReadInputTokens int64  `json:"cache_read_input_tokens"`
	// Writing the cache is input too, at its own price (Price.CacheWrite).
	CacheCreationInputTokens int64 `json:"cache_creation_input_tokens"`
}

type anthropicObject struct {
	Type    string          `json:"type"`
	Usage   *anthropicUsage `json:"usage"`
	Message *struct {
		Usage *anthropicUsage `json:"usage"`
	} `json:"message"`
	Delta *struct {
		Text        json.RawMessage `json:"text"`
		PartialJSON json.RawMessage `json:"partial_json"`
		Thinking    json.RawMessage `json:"thinking"`
	} `json:"delta"`
	Content []struct {
		Text  json.RawMessage `json:"text"`
		Input json.RawMessage `json:"input"`
	} `json:"content"`
}

// object reads one JSON object of the answer (an event's data or the
// whole body); what does not parse is ignored (the estimate covers it).
func (m *meter) object(data []byte) {
	if m.api == config.APIAnthropic {
		m.anthropic(data)
	} else {
		m.openai(data)
	}
}

func (m *meter) openai(data []byte) {
	var o openaiObject
	if json.Unmarshal(data, &o) != nil {
		return
	}
	for _, c := range o.Choices {
		for _, t := range []*openaiText{c.Delta, c.Message} {
			if t != nil {
				m.content += textLen(t.Content) + textLen(t.ReasoningContent) + textLen(t.ToolCalls)
			}
		}
		m.content += textLen(c.Text)
	}
	if u := o.Usage; u != nil {
		in, out := u.PromptTokens, u.CompletionTokens
		if in == nil {
			in = u.InputTokens
		}
		if out == nil {
			out = u.OutputTokens
		}
		if in != nil {
			m.input, m.inputSeen = max(*in, 0), true
			m.cached = max(u.PromptTokensDetails.CachedTokens, u.InputTokensDetails.CachedTokens, u.PromptCacheHitTokens, 0)
		}
		if out != nil {
			m.output, m.outputSeen = max(*out, 0), true
		}
	}
}

func (m *meter) anthropic(data []byte) {
	var o anthropicObject
	if json.Unmarshal(data, &o) != nil {
		return
	}
	if d := o.Delta; d != nil {
		m.content += textLen(d.Text) + textLen(d.PartialJSON) + textLen(d.Thinking)
	}
	for _, c := range o.Content {
		m.content += textLen(c.Text) + textLen(c.Input)
	}
	u := o.Usage
	if o.Message != nil && o.Message.Usage != nil {
		u = o.Message.Usage
	}
	if u == nil {
		return
	}
	// message_start carries the input (and a first output count);
	// message_delta the cumulative output, and on newer API versions the
	// input again: the latest report of each wins.
	if u.InputTokens != nil {
		cached, written := max(u.CacheReadInputTokens, 0), max(u.CacheCreationInputTokens, 0)
		m.input, m.cached, m.cacheWrite, m.inputSeen = max(*u.InputTokens, 0)+cached+written, cached, written, true
	}
	if u.OutputTokens != nil {
		m.output, m.outputSeen = max(*u.OutputTokens, 0), true
	}
}

// textLen is the length of generated text in a raw field (a string's
// bytes as sent, an array's or object's encoding), 0 for none.
func textLen(raw json.RawMessage) int64 {
	if len(raw) == 0 || string(raw) == "null" {
		return 0
	}
	if raw[0] == '"' {
		return int64(max(len(raw)-2, 0))
	}
	return int64(len(raw))
}

// Cost is what u costs at price p, in micro-USD (prices are USD per
// million tokens, which is micro-USD per token): input read from the
// cache at Cached, input written to it at CacheWrite (each at Input when
// 0), the rest of the input at Input, output at Output, rounded to the
// micro-USD.
func Cost(u Usage, p config.Price) int64 {
	or := func(x float64) float64 {
		if x == 0 {
			return p.Input
		}
		return x
	}
	input := max(u.Input, 0)
	cached := min(max(u.Cached, 0), input)
	written := min(max(u.CacheWrite, 0), input-cached)
	c := float64(input-cached-written)*p.Input + float64(cached)*or(p.Cached) + float64(written)*or(p.CacheWrite) + float64(max(u.Output, 0))*p.Output
	if c > math.MaxInt64/2 {
		return math.MaxInt64 / 2
	}
	return int64(math.Round(c))
}
