package providersim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Switches are the behaviours a model name asks for by its suffixes.
type Switches struct {
	Slow    bool // -slow: the first byte after Options.Slow, tokens Options.TokenInterval apart
	Fail    bool // -fail: 500 in the API's error shape
	NoUsage bool // -nousage: no usage anywhere, whatever the request asked
	Long    bool // -long: streams until the client leaves
}

// ParseModel reads the switches off the end of a model name, in any order.
func ParseModel(model string) Switches {
	var s Switches
	flags := map[string]*bool{"-slow": &s.Slow, "-fail": &s.Fail, "-nousage": &s.NoUsage, "-long": &s.Long}
	for {
		found := false
		for suffix, flag := range flags {
			if rest, ok := strings.CutSuffix(model, suffix); ok {
				*flag, model, found = true, rest, true
			}
		}
		if !found {
			return s
		}
	}
}

// CountTokens is the stand-in's tokenizer: one token per whitespace-separated
// word. Usage fields and the reply's length both count this way, so a test
// can predict every figure from the text it sent.
func CountTokens(text string) int { return len(strings.Fields(text)) }

// defaultReplyTokens is the length of a reply when the request sets no
// smaller max_tokens.
const defaultReplyTokens = 12

// prompt is a request's text, as the token rule sees it.
type prompt struct {
	texts []string // system text first (if any), then every message's text
}

// usage: input counts every text; cached counts all but the last one, the
// conversation's prefix that a provider's prompt cache would hold. A
// one-message conversation has nothing cached.
func (p prompt) usage() (input, cached int) {
	for _, t := range p.texts {
		input += CountTokens(t)
	}
	if len(p.texts) > 0 {
		cached = input - CountTokens(p.texts[len(p.texts)-1])
	}
	return input, cached
}

// piece is the i-th token of the reply to p: "echo:" and then the words of
// the last message over and over ("ok" when it has none). Each piece after
// the first starts with a space, so the pieces concatenate to the reply.
func (p prompt) piece(i int) string {
	if i == 0 {
		return "echo:"
	}
	var words []string
	if len(p.texts) > 0 {
		words = strings.Fields(p.texts[len(p.texts)-1])
	}
	if len(words) == 0 {
		words = []string{"ok"}
	}
	return " " + words[(i-1)%len(words)]
}

func (p prompt) reply(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(p.piece(i))
	}
	return b.String()
}

// replyLength is how many tokens a reply has, and whether max_tokens cut it.
func replyLength(maxTokens *int) (int, bool) {
	if maxTokens != nil && *maxTokens < defaultReplyTokens {
		return max(*maxTokens, 0), true
	}
	return defaultReplyTokens, false
}

// contentText reads a message's content: a string, an array of parts of
// which the text ones count ({"type":"text","text":...}), or null.
func contentText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", errors.New("content must be a string or an array of content parts")
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if p.Type == "text" {
			texts = append(texts, p.Text)
		}
	}
	return strings.Join(texts, " "), nil
}

type message struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

func readPrompt(system json.RawMessage, msgs []message) (prompt, error) {
	var p prompt
	if len(system) > 0 {
		t, err := contentText(system)
		if err != nil {
			return prompt{}, fmt.Errorf("system: %w", err)
		}
		p.texts = append(p.texts, t)
	}
	for i, m := range msgs {
		if m.Role == "" {
			return prompt{}, fmt.Errorf("messages[%d].role: required", i)
		}
		t, err := contentText(m.Content)
		if err != nil {
			return prompt{}, fmt.Errorf("messages[%d].%w", i, err)
		}
		p.texts = append(p.texts, t)
	}
	return p, nil
}

// stream writes server-sent events, flushing after every one.
type stream struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func startStream(w http.ResponseWriter) *stream {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &stream{w: w, rc: http.NewResponseController(w)}
}

// send writes one event (no "event:" line when name is empty) and reports
// whether the client still takes them.
func (s *stream) send(name string, data any) bool {
	b, ok := data.([]byte)
	if !ok {
		b, _ = json.Marshal(data)
	}
	if name != "" {
		if _, err := fmt.Fprintf(s.w, "event: %s\n", name); err != nil {
			return false
		}
	}
	if _, err := fmt.Fprintf(s.w, "data: %s\n\n", b); err != nil {
		return false
	}
	return s.rc.Flush() == nil
}

// exchange is one model call being answered; done records it.
type exchange struct {
	s    *Server
	w    http.ResponseWriter
	r    *http.Request
	call Call
	p    prompt
	sw   Switches
}

func (s *Server) newExchange(w http.ResponseWriter, r *http.Request, api, key string) *exchange {
	return &exchange{s: s, w: w, r: r, call: Call{API: api, Path: r.URL.Path, Remote: remoteHost(r), KeyHint: keyHint(key)}}
}

func (e *exchange) done() { e.s.record(e.call) }

// statusClientGone is recorded when the client left before any answer
// (nginx's convention).
const statusClientGone = 499

// begin waits out -slow; false when the client left meanwhile.
func (e *exchange) begin() bool {
	if e.sw.Slow && !wait(e.r.Context(), e.s.opts.Slow) {
		e.call.Status = statusClientGone
		return false
	}
	return true
}

// tokens sends the reply's pieces, n of them or, for -long, until the
// client leaves; false when it left.
func (e *exchange) tokens(n int, send func(piece string) bool) bool {
	paced := e.sw.Slow || e.sw.Long
	for i := 0; e.sw.Long || i < n; i++ {
		if i > 0 && paced && !wait(e.r.Context(), e.s.opts.TokenInterval) {
			return false
		}
		if !send(e.p.piece(i)) {
			return false
		}
		e.call.OutputTokens++
	}
	return true
}

// holdLong answers a non-streamed -long call: it never ends by itself.
func (e *exchange) holdLong() {
	<-e.r.Context().Done()
	e.call.Status = statusClientGone
}

const failMessage = "providersim: simulated provider failure (model ends in -fail)"

func now() int64 { return time.Now().Unix() }
