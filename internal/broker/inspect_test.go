package broker

import (
	"encoding/json"
	"net/http"
	"slices"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

var (
	testOpenAI    = config.Provider{Name: "deepseek", API: config.APIOpenAI, BaseURL: "https://api.deepseek.com", Models: []string{"deepseek-chat", "deepseek-reasoner"}}
	testAnthropic = config.Provider{Name: "anthropic", API: config.APIAnthropic, BaseURL: "https://api.anthropic.com", Models: []string{"claude-x"}}
)

func TestInspectRequest(t *testing.T) {
	for _, tc := range []struct {
		name                string
		p                   config.Provider
		method, rest, ctype string
		body                string
		model               string
		stream              bool
		forwarded           string // "" : the body as sent
		refusal             string
	}{
		{"chat", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"deepseek-chat","messages":[]}`, "deepseek-chat", false, `{"messages":[],"model":"deepseek-chat"}`, ""},
		{"streamed chat asks for usage", testOpenAI, "POST", "v1/chat/completions", "application/json", `{"model":"deepseek-chat","stream":true}`, "deepseek-chat", true, `{"model":"deepseek-chat","stream":true,"stream_options":{"include_usage":true}}`, ""},
		{"streamed chat with other options", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"deepseek-chat","stream":true,"stream_options":{"x":1}}`, "deepseek-chat", true, `{"model":"deepseek-chat","stream":true,"stream_options":{"include_usage":true,"x":1}}`, ""},
		{"client's own include_usage kept", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"deepseek-chat","stream":true,"stream_options":{"include_usage":false}}`, "deepseek-chat", true, `{"model":"deepseek-chat","stream":true,"stream_options":{"include_usage":false}}`, ""},
		{"anthropic stream untouched", testAnthropic, "POST", "v1/messages", "application/json", `{"model":"claude-x","stream":true}`, "claude-x", true, `{"model":"claude-x","stream":true}`, ""},
		{"html characters kept", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"deepseek-chat","messages":[{"content":"<b>&</b>"}]}`, "deepseek-chat", false, `{"messages":[{"content":"<b>&</b>"}],"model":"deepseek-chat"}`, ""},
		{"duplicate model: the one checked is the one sent", testOpenAI, "POST", "chat/completions", "", `{"model":"gpt-5","model":"deepseek-chat"}`, "deepseek-chat", false, `{"model":"deepseek-chat"}`, ""},
		{"duplicate model ending unknown", testOpenAI, "POST", "chat/completions", "", `{"model":"deepseek-chat","model":"gpt-5"}`, "", false, "", ReasonModel},
		{"unknown model", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"gpt-5"}`, "", false, "", ReasonModel},
		{"model differing in case", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"DeepSeek-Chat"}`, "", false, "", ReasonModel},
		{"model not a string", testOpenAI, "POST", "chat/completions", "application/json", `{"model":["deepseek-chat"]}`, "", false, "", ReasonMalformed},
		{"no model on a model endpoint", testAnthropic, "POST", "v1/messages", "application/json", `{"max_tokens":1}`, "", false, "", ReasonMalformed},
		{"no body on a model endpoint", testOpenAI, "POST", "chat/completions", "", ``, "", false, "", ReasonMalformed},
		{"array body", testOpenAI, "POST", "chat/completions", "application/json", `[{"model":"deepseek-chat"}]`, "", false, "", ReasonMalformed},
		{"null body", testOpenAI, "POST", "embeddings", "application/json", `null`, "", false, "", ReasonMalformed},
		{"trailing garbage", testOpenAI, "POST", "chat/completions", "application/json", `{"model":"deepseek-chat"} {"model":"gpt-5"}`, "", false, "", ReasonMalformed},
		{"JSON elsewhere with an unknown model", testOpenAI, "POST", "v1/files", "application/json", `{"model":"gpt-5"}`, "", false, "", ReasonModel},
		{"JSON elsewhere not an object", testOpenAI, "POST", "v1/batches", "application/json; charset=utf-8", `"x"`, "", false, "", ReasonMalformed},
		{"JSON elsewhere without model", testOpenAI, "POST", "v1/batches", "application/json", `{"input_file_id":"f"}`, "", false, `{"input_file_id":"f"}`, ""},
		{"a GET without a body", testOpenAI, "GET", "chat/completions", "", ``, "", false, "", ""},
		{"not JSON elsewhere", testOpenAI, "POST", "v1/files", "multipart/form-data; boundary=x", "--x\r\n", "", false, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, ref := inspectRequest(tc.p, tc.method, tc.rest, tc.ctype, []byte(tc.body))
			if tc.refusal != "" {
				if ref == nil || ref.Reason != tc.refusal || ref.Status != 400 || ref.Message == "" {
					t.Fatalf("refusal %+v, want %q", ref, tc.refusal)
				}
				return
			}
			if ref != nil {
				t.Fatalf("refused: %+v", ref)
			}
			want := tc.forwarded
			if want == "" {
				want = tc.body
			}
			if in.Model != tc.model || in.Stream != tc.stream || string(in.Body) != want {
				t.Fatalf("got %q %v %s", in.Model, in.Stream, in.Body)
			}
		})
	}
}

func FuzzInspectRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"deepseek-chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"claude-x","stream":true,"stream_options":null}`,
		`{"model":"deepseek-chat","model":"gpt-5"}`, `{"stream_options":[1],"stream":true,"model":"deepseek-reasoner"}`, `[]`, ``, "\xff",
	} {
		f.Add([]byte(s), "chat/completions", "application/json", false)
		f.Add([]byte(s), "v1/messages", "", true)
	}
	f.Fuzz(func(t *testing.T, body []byte, rest, ctype string, anthropic bool) {
		p := testOpenAI
		if anthropic {
			p = testAnthropic
		}
		in, ref := inspectRequest(p, http.MethodPost, rest, ctype, body)
		if ref != nil {
			if ref.Status != 400 || ref.Message == "" {
				t.Fatalf("refusal %+v", ref)
			}
			return
		}
		if in.Model != "" && !slices.Contains(p.Models, in.Model) {
			t.Fatalf("forwarded unlisted model %q", in.Model)
		}
		if hasEndpoint(rest, modelEndpoints) && in.Model == "" {
			t.Fatal("a model endpoint's call forwarded without a model")
		}
		// What is forwarded says the same to a second reading: the model
		// the provider reads is the one checked.
		again, ref := inspectRequest(p, http.MethodPost, rest, ctype, in.Body)
		if ref != nil || again.Model != in.Model || string(again.Body) != string(in.Body) {
			t.Fatalf("forwarded body %q reads as %+v, %+v", in.Body, again, ref)
		}
		if in.Model != "" {
			var obj map[string]json.RawMessage
			if json.Unmarshal(in.Body, &obj) != nil {
				t.Fatalf("forwarded body %q is not a JSON object", in.Body)
			}
		}
	})
}
