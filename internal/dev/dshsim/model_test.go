package dshsim

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/providersim"
	"github.com/aaas-project/aaas/internal/dev/testutil"
)

// These tests put the provider stand-in (internal/dev/providersim) at the far
// end of dshsim's model calls; it stands for the broker or a provider and
// records what reached it.

const providerKey = "sk-dsh-test-7777"

func newProvider(t *testing.T) (*providersim.Server, *httptest.Server) {
	t.Helper()
	sim := providersim.New(providersim.Options{Keys: []string{providerKey}, Slow: time.Hour, TokenInterval: 10 * time.Millisecond})
	hs := httptest.NewServer(sim)
	t.Cleanup(hs.Close)
	return sim, hs
}

// modelFixture is a dshsim whose chat calls the provider at base.
func modelFixture(t *testing.T, name, base, key string) (*fixture, *http.Cookie) {
	t.Helper()
	o := testOptions(t)
	o.Provider = Provider{Name: name, BaseURL: base, Key: key}
	o.Model = "deepseek-chat"
	f := newFixture(t, o)
	return f, f.handshake()
}

// chatStream posts a chat and returns the open response.
func chatStream(t *testing.T, f *fixture, cookie *http.Cookie, body string) *http.Response {
	t.Helper()
	req := f.request(http.MethodPost, "/api/chat", strings.NewReader(body), cookie)
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatalf("POST /api/chat: %v", err)
	}
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("POST /api/chat = %s %q", resp.Status, resp.Header.Get("Content-Type"))
	}
	return resp
}

// modelReply reads a whole chat stream: the text of its delta events, the
// error event's data (nil if none), and whether it ended with done.
func modelReply(t *testing.T, resp *http.Response) (text string, errEvent map[string]any, done bool) {
	t.Helper()
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	for {
		ev, err := readEvent(r)
		if err == io.EOF {
			return text, errEvent, done
		}
		if err != nil {
			t.Fatal(err)
		}
		if done {
			t.Fatalf("event %+v after done", ev)
		}
		switch ev.event {
		case "delta":
			var piece string
			if err := json.Unmarshal([]byte(ev.data), &piece); err != nil {
				t.Fatalf("delta %q: %v", ev.data, err)
			}
			text += piece
		case "error":
			if err := json.Unmarshal([]byte(ev.data), &errEvent); err != nil {
				t.Fatalf("error event %q: %v", ev.data, err)
			}
		case "done":
			done = true
		default:
			t.Fatalf("unexpected event %+v", ev)
		}
	}
}

const twelveTokens = "echo: hello there hello there hello there hello there hello there hello"

func TestChatStreamsTheProvidersReply(t *testing.T) {
	for _, tt := range []struct {
		name, provider, base, body, path, model string
	}{
		{"deepseek, the default model", "deepseek", "", `{"message":"hello there","session":"s"}`, "/chat/completions", "deepseek-chat"},
		{"openai, the chat's model", "openai", "/v1", `{"message":"hello there","session":"s","model":"gpt-4o-mini"}`, "/v1/chat/completions", "gpt-4o-mini"},
		{"anthropic messages", "anthropic", "", `{"message":"hello there","session":"s","model":"claude-sonnet-4-5"}`, "/v1/messages", "claude-sonnet-4-5"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sim, hs := newProvider(t)
			f, cookie := modelFixture(t, tt.provider, hs.URL+tt.base, providerKey)
			text, errEvent, done := modelReply(t, chatStream(t, f, cookie, tt.body))
			if text != twelveTokens || errEvent != nil || !done {
				t.Fatalf("reply %q error %v done %v", text, errEvent, done)
			}
			api := "openai"
			if tt.provider == "anthropic" {
				api = "anthropic"
			}
			want := providersim.Call{KeyHint: "7777", API: api, Path: tt.path, Model: tt.model, Stream: true, Status: 200,
				Remote: "127.0.0.1", InputTokens: 2, OutputTokens: 12}
			testutil.Eventually(t, 10*time.Second, func() error { // recorded once its handler returns
				if calls := sim.Calls(); len(calls) != 1 || calls[0] != want {
					return fmt.Errorf("provider saw %+v, want %+v", calls, want)
				}
				return nil
			})
			// The history keeps the whole reply, one turn, not its pieces.
			if got, want := chatHistory(t, f, cookie, "s"), []chatMessage{{"user", "hello there"}, {"assistant", twelveTokens}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("history = %+v, want %+v", got, want)
			}
		})
	}
}

// The reply reaches the browser as it arrives: with a -long model the
// provider never finishes while the client reads, yet text arrives. When
// the browser leaves, the provider call ends too.
func TestChatRelaysTheReplyAsItArrives(t *testing.T) {
	for _, provider := range []string{"openai", "anthropic"} {
		t.Run(provider, func(t *testing.T) {
			sim, hs := newProvider(t)
			f, cookie := modelFixture(t, provider, hs.URL, providerKey)
			resp := chatStream(t, f, cookie, `{"message":"go on","session":"s","model":"sim-long"}`)
			r := bufio.NewReader(resp.Body)
			var text string
			for !strings.HasPrefix(text, "echo: go on go") {
				ev, err := readEvent(r)
				if err != nil {
					t.Fatal(err)
				}
				if ev.event != "delta" {
					t.Fatalf("event %+v before the reply", ev)
				}
				var piece string
				_ = json.Unmarshal([]byte(ev.data), &piece)
				text += piece
			}
			if calls := sim.Calls(); len(calls) != 0 {
				t.Fatalf("the provider finished before the client read the reply: %+v", calls)
			}
			resp.Body.Close()
		})
	}
}

// The browser leaving does not end the agent's call: it runs to its end
// at the provider, and the whole reply is in the history.
func TestTheAgentsCallOutlivesTheBrowser(t *testing.T) {
	for _, provider := range []string{"openai", "anthropic"} {
		t.Run(provider, func(t *testing.T) {
			sim := providersim.New(providersim.Options{Keys: []string{providerKey}, Slow: 10 * time.Millisecond, TokenInterval: 20 * time.Millisecond})
			hs := httptest.NewServer(sim)
			t.Cleanup(hs.Close)
			f, cookie := modelFixture(t, provider, hs.URL, providerKey)
			resp := chatStream(t, f, cookie, `{"message":"hello there","session":"s","model":"sim-slow"}`)
			ev, err := readEvent(bufio.NewReader(resp.Body))
			if err != nil || ev.event != "delta" {
				t.Fatalf("first event %+v, %v", ev, err)
			}
			resp.Body.Close() // the browser leaves after the first token
			testutil.Eventually(t, 10*time.Second, func() error {
				if c := sim.Calls(); len(c) != 1 || c[0].Status != http.StatusOK || c[0].OutputTokens != 12 {
					return fmt.Errorf("the provider's calls %+v, want the one, finished with its 12 tokens", c)
				}
				return nil
			})
			testutil.Eventually(t, 10*time.Second, func() error {
				if h := chatHistory(t, f, cookie, "s"); len(h) != 2 || h[1].Text != twelveTokens {
					return fmt.Errorf("history %+v, want the whole reply", h)
				}
				return nil
			})
		})
	}
}

// What a provider (or the broker in front of it) refuses with reaches the
// chat as its message.
func TestChatShowsTheProvidersError(t *testing.T) {
	const budget = "your model budget of $5.00 for 2026-12 is spent ($5.01 used); it renews on 2027-01-01"
	refuse := func(status int, body string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = io.WriteString(w, body)
		}
	}
	stream := func(body string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, body)
		}
	}
	for _, tt := range []struct {
		name, provider, key, model string
		far                        http.Handler // nil: the provider stand-in
		status                     float64
		message                    string
		text                       string
	}{
		{"openai budget 429", "openai", providerKey, "", refuse(429, `{"error":{"message":"`+budget+`","type":"insufficient_quota","code":"budget_exceeded"}}`), 429, budget, ""},
		{"anthropic budget 429", "anthropic", providerKey, "", refuse(429, `{"type":"error","error":{"type":"rate_limit_error","message":"`+budget+`"}}`), 429, budget, ""},
		{"a plain-text 502", "deepseek", providerKey, "", refuse(502, "upstream unreachable\nmore"), 502, "upstream unreachable", ""},
		{"an empty 504", "deepseek", providerKey, "", refuse(504, ""), 504, "Gateway Timeout", ""},
		{"provider failure", "openai", providerKey, "sim-fail", nil, 500, "providersim: simulated provider failure (model ends in -fail)", ""},
		{"anthropic failure", "anthropic", providerKey, "sim-fail", nil, 500, "providersim: simulated provider failure (model ends in -fail)", ""},
		{"wrong key", "openai", "sk-wrong", "", nil, 401, "Incorrect API key provided.", ""},
		{"openai error mid-stream", "openai", providerKey, "", stream("data: {\"choices\":[{\"delta\":{\"content\":\"par\"}}]}\n\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n"), 0, "overloaded", "par"},
		{"anthropic error mid-stream", "anthropic", providerKey, "", stream("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"par\"}}\n\nevent: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"), 0, "Overloaded", "par"},
		{"stream cut short", "openai", providerKey, "", stream("data: {\"choices\":[{\"delta\":{\"content\":\"par\"}}]}\n\n"), 0, "the model provider's stream ended before the reply did", "par"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base := ""
			if tt.far == nil {
				_, hs := newProvider(t)
				base = hs.URL
			} else {
				hs := httptest.NewServer(tt.far)
				t.Cleanup(hs.Close)
				base = hs.URL
			}
			f, cookie := modelFixture(t, tt.provider, base, tt.key)
			body := `{"message":"hi","session":"s"}`
			if tt.model != "" {
				body = `{"message":"hi","session":"s","model":"` + tt.model + `"}`
			}
			text, errEvent, done := modelReply(t, chatStream(t, f, cookie, body))
			if text != tt.text || !done || errEvent["message"] != tt.message || errEvent["status"] != tt.status {
				t.Fatalf("reply %q error %v done %v; want %q, error %v %q", text, errEvent, done, tt.text, tt.status, tt.message)
			}
			want := []chatMessage{{"user", "hi"}}
			if tt.text != "" {
				want = append(want, chatMessage{"assistant", tt.text})
			}
			if got := chatHistory(t, f, cookie, "s"); !reflect.DeepEqual(got, want) {
				t.Fatalf("history = %+v, want %+v", got, want)
			}
		})
	}
}

func TestChatRejectsABadModelName(t *testing.T) {
	sim, hs := newProvider(t)
	f, cookie := modelFixture(t, "openai", hs.URL, providerKey)
	for _, model := range []string{"a b", "-x", "m\"", strings.Repeat("m", 129)} {
		body, _ := json.Marshal(map[string]string{"message": "hi", "model": model})
		if status, _ := postChat(t, f, cookie, string(body)); status != http.StatusBadRequest {
			t.Errorf("model %q = %d, want 400", model, status)
		}
	}
	if calls := sim.Calls(); len(calls) != 0 {
		t.Errorf("a rejected chat reached the provider: %+v", calls)
	}
}

// Without a base URL the model field changes nothing: the chat answers
// itself, as it always did.
func TestChatWithoutAProviderIgnoresTheModel(t *testing.T) {
	f := newFixture(t, testOptions(t))
	cookie := f.handshake()
	status, events := postChat(t, f, cookie, `{"message":"hi you","session":"s","model":"gpt-4o-mini"}`)
	var words []string
	for _, ev := range events {
		words = append(words, ev.event+":"+ev.data)
	}
	if status != http.StatusOK || strings.Join(words, " ") != ":You :said: :hi :you done:done" {
		t.Fatalf("chat = %d %v", status, words)
	}
}

// DEVCLUSTER_POD_IP is the source address of provider calls: the provider
// sees the pod's address, not 127.0.0.1.
func TestProviderCallsComeFromTheSourceIP(t *testing.T) {
	sim, hs := newProvider(t)
	o := testOptions(t)
	o.Provider = Provider{Name: "openai", BaseURL: hs.URL, Key: providerKey}
	o.Model = "deepseek-chat"
	o.SourceIP = netip.MustParseAddr("127.0.0.23")
	f := newFixture(t, o)
	cookie := f.handshake()
	if text, errEvent, _ := modelReply(t, chatStream(t, f, cookie, `{"message":"hi"}`)); errEvent != nil || text == "" {
		t.Fatalf("reply %q error %v", text, errEvent)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if calls := sim.Calls(); len(calls) != 1 || calls[0].Remote != "127.0.0.23" {
			return fmt.Errorf("provider saw %+v, want a call from 127.0.0.23", calls)
		}
		return nil
	})
}

// A key stored in DSH's .credentials.yaml wins over <PROVIDER>_API_KEY,
// from the next call on, as UPSTREAM says of DSH: in a sandbox, the key a
// user enters in DSH's settings is the one sent to the broker (which
// drops it, whichever it is).
func TestAStoredCredentialWinsOverTheEnvironment(t *testing.T) {
	sim, hs := newProvider(t)
	f, cookie := modelFixture(t, "deepseek", hs.URL, "sk-from-the-env-0000")
	chat := func() {
		t.Helper()
		if text, errEvent, _ := modelReply(t, chatStream(t, f, cookie, `{"message":"hi"}`)); text == "" && errEvent == nil {
			t.Fatal("no reply")
		}
	}
	chat()
	creds := filepath.Join(f.srv.opts.DSHHome, ".credentials.yaml")
	if err := os.WriteFile(creds, []byte("# dsh credentials\ndeepseek: "+providerKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	chat()
	testutil.Eventually(t, 10*time.Second, func() error {
		calls := sim.Calls()
		if len(calls) != 2 || calls[0].KeyHint != "0000" || calls[1].KeyHint != providerKey[len(providerKey)-4:] || calls[1].Status != http.StatusOK {
			return fmt.Errorf("provider saw %+v: want the environment's key, then the stored one", calls)
		}
		return nil
	})
}

// The provider's stream is bytes from outside the pod: whatever they are,
// reading them neither panics nor invents text that no event carried.
func FuzzReadModelStream(f *testing.F) {
	f.Add("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n", false)
	f.Add("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\nevent: message_stop\ndata: {}\n\n", true)
	f.Add("event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\n: comment\ndata:\n\n", true)
	f.Fuzz(func(t *testing.T, body string, anthropic bool) {
		var text strings.Builder
		collect := func(s string) error { text.WriteString(s); return nil }
		_ = readEvents(strings.NewReader(body), func(name, data string) (bool, error) {
			if anthropic {
				return anthropicEvent(name, data, collect)
			}
			return openaiEvent(data, collect)
		})
		if text.Len() > len(body) {
			t.Fatalf("%d bytes of text from a %d-byte stream", text.Len(), len(body))
		}
	})
}
