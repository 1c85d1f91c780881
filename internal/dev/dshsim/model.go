package dshsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// The model call behind a chat: DSH asks its provider for a streamed reply,
// OpenAI chat completions (stream: true) for DeepSeek and OpenAI, the
// messages API for Anthropic, and relays the text as it arrives.

const (
	// anthropicVersion is the API version DSH's SDK sends.
	anthropicVersion = "2023-06-01"
	// replyMaxTokens bounds a reply; Anthropic requires a bound.
	replyMaxTokens = 1024
	// maxEventBytes bounds one line of the provider's stream.
	maxEventBytes = 1 << 20
	// maxErrorBytes bounds how much of an error answer is read.
	maxErrorBytes = 64 << 10
	// headerTimeout bounds the wait for the provider's answer to begin;
	// the stream itself lasts as long as the chat request does.
	headerTimeout = 2 * time.Minute
)

// providerError is a provider's refusal or failure, with the message it
// gave, which the chat shows the user (a broker's budget refusal, say).
type providerError struct {
	Status  int // 0 when the error came inside a stream
	Message string
}

func (e *providerError) Error() string {
	if e.Status == 0 {
		return e.Message
	}
	return fmt.Sprintf("%d: %s", e.Status, e.Message)
}

type modelClient struct {
	p  Provider
	hc *http.Client
	// credentials is DSH_HOME's .credentials.yaml: a key stored there for
	// the provider wins over p.Key, as in DSH.
	credentials string
}

func newModelClient(p Provider, source net.IP, credentials string) *modelClient {
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	if source != nil {
		d.LocalAddr = &net.TCPAddr{IP: source}
	}
	return &modelClient{p: p, credentials: credentials, hc: &http.Client{Transport: &http.Transport{
		DialContext:           d.DialContext,
		ForceAttemptHTTP2:     true,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: headerTimeout,
		MaxIdleConns:          8,
		IdleConnTimeout:       90 * time.Second,
	}}}
}

// stream asks for a reply to message and calls text with every piece as
// it arrives. It returns nil once the provider has ended the reply, a
// *providerError when the provider refused or failed, or another error
// (ctx's included) when the call broke.
func (c *modelClient) stream(ctx context.Context, model, message string, text func(string) error) error {
	req, err := c.request(ctx, model, message)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("call the model provider: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &providerError{Status: resp.StatusCode, Message: errorMessage(resp)}
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		return fmt.Errorf("the model provider answered %q, not a stream", ct)
	}
	ended := false
	err = readEvents(resp.Body, func(name, data string) (end bool, err error) {
		if c.p.Anthropic() {
			end, err = anthropicEvent(name, data, text)
		} else {
			end, err = openaiEvent(data, text)
		}
		ended = end
		return end, err
	})
	switch {
	case err != nil && ctx.Err() != nil:
		return ctx.Err()
	case err != nil:
		return err
	case !ended:
		return errors.New("the model provider's stream ended before the reply did")
	}
	return nil
}

func (c *modelClient) request(ctx context.Context, model, message string) (*http.Request, error) {
	msgs := []map[string]string{{"role": "user", "content": message}}
	body := map[string]any{"model": model, "stream": true, "messages": msgs}
	path := "/chat/completions"
	if c.p.Anthropic() {
		body["max_tokens"] = replyMaxTokens
		path = "/v1/messages"
	}
	b, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("encode model request: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.p.BaseURL+path, bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("model request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	key := c.p.Key
	if stored, ok := storedKey(c.credentials, c.p.Name); ok {
		key = stored
	}
	if c.p.Anthropic() {
		req.Header.Set("x-api-key", key)
		req.Header.Set("anthropic-version", anthropicVersion)
	} else {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	return req, nil
}

// storedKey is the key .credentials.yaml (at path) holds for provider, as
// a user enters one in DSH's settings: dshsim's form of it is a top-level
// "<provider>: <key>". Read at each call, as a key entered takes effect
// without a restart; a file that is absent or unreadable holds none.
func storedKey(path, provider string) (string, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false
	}
	var creds map[string]any
	if yaml.Unmarshal(b, &creds) != nil {
		return "", false
	}
	key, ok := creds[provider].(string)
	return key, ok && key != ""
}

// apiError is the error object of both APIs: OpenAI's {"error":{...}} and
// Anthropic's {"type":"error","error":{...}}.
type apiError struct {
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// errorMessage is the message of an error answer: the API's own when the
// body has one, else its first line, else the status text.
func errorMessage(resp *http.Response) string {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBytes))
	var e apiError
	if json.Unmarshal(b, &e) == nil && e.Error != nil && e.Error.Message != "" {
		return e.Error.Message
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	if line == "" || len(line) > 500 {
		return http.StatusText(resp.StatusCode)
	}
	return line
}

// readEvents splits a server-sent event stream into events (name and
// joined data lines) and calls on for each until it reports the end.
func readEvents(r io.Reader, on func(name, data string) (end bool, err error)) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, maxEventBytes)
	var name string
	var data []string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if len(data) > 0 {
				end, err := on(name, strings.Join(data, "\n"))
				if err != nil || end {
					return err
				}
			}
			name, data = "", nil
		case strings.HasPrefix(line, ":"): // a comment, sent to keep the connection up
		default:
			field, value, _ := strings.Cut(line, ":")
			value = strings.TrimPrefix(value, " ")
			switch field {
			case "event":
				name = value
			case "data":
				data = append(data, value)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read the model stream: %w", err)
	}
	return nil
}

// openaiEvent reads a chat completion chunk; "[DONE]" ends the stream.
func openaiEvent(data string, text func(string) error) (bool, error) {
	if data == "[DONE]" {
		return true, nil
	}
	var chunk struct {
		apiError
		Choices []struct {
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
		} `json:"choices"`
	}
	if err := json.Unmarshal([]byte(data), &chunk); err != nil {
		return false, fmt.Errorf("decode model stream chunk: %w", err)
	}
	if chunk.Error != nil {
		return false, &providerError{Message: chunk.Error.Message}
	}
	for _, c := range chunk.Choices {
		if c.Delta.Content != "" {
			if err := text(c.Delta.Content); err != nil {
				return false, err
			}
		}
	}
	return false, nil
}

// anthropicEvent reads a messages stream event; message_stop ends it.
func anthropicEvent(name, data string, text func(string) error) (bool, error) {
	switch name {
	case "message_stop":
		return true, nil
	case "error":
		var e apiError
		if err := json.Unmarshal([]byte(data), &e); err != nil || e.Error == nil {
			return false, &providerError{Message: "the model provider failed mid-reply"}
		}
		return false, &providerError{Message: e.Error.Message}
	case "content_block_delta":
		var ev struct {
			Delta struct {
				Type string `json:"type"`
				Text string `json:"text"`
			} `json:"delta"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return false, fmt.Errorf("decode model stream event: %w", err)
		}
		if ev.Delta.Type == "text_delta" && ev.Delta.Text != "" {
			return false, text(ev.Delta.Text)
		}
	}
	return false, nil
}
