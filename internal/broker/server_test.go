package broker

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
)

// recordingLedger is a test double of the Ledger interface: it admits
// unless refuse is set and keeps every ended call's usage.
type recordingLedger struct {
	refuse error
	mu     sync.Mutex
	n      int
	ended  chan events.UsageEvent
	admits []bool   // charged, per Admit
	keys   []string // the sandbox key, per Admit
}

func newRecordingLedger() *recordingLedger {
	return &recordingLedger{ended: make(chan events.UsageEvent, 16)}
}

func (l *recordingLedger) Admit(_ context.Context, key string, charged bool) (Call, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.admits, l.keys = append(l.admits, charged), append(l.keys, key)
	if l.refuse != nil {
		return nil, l.refuse
	}
	l.n++
	return &recordedCall{id: fmt.Sprintf("call-%d", l.n), l: l}, nil
}

type recordedCall struct {
	id    string
	l     *recordingLedger
	ended atomic.Bool
}

func (c *recordedCall) ID() string { return c.id }
func (c *recordedCall) End(u events.UsageEvent) {
	if c.ended.Swap(true) {
		panic("End called twice")
	}
	c.l.ended <- u
}

// usage waits for the next ended call.
func (l *recordingLedger) usage(t *testing.T) events.UsageEvent {
	t.Helper()
	select {
	case u := <-l.ended:
		return u
	case <-time.After(10 * time.Second):
		t.Fatal("no call ended")
		return events.UsageEvent{}
	}
}

// farEnd is the provider's far end: an httptest server standing in for
// the real provider (the broker's upstream), counting what reached it.
type farEnd struct {
	*httptest.Server
	calls atomic.Int32
	mu    sync.Mutex
	last  *http.Request
	body  []byte
}

func newFarEnd(t *testing.T, h http.HandlerFunc) *farEnd {
	f := &farEnd{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.calls.Add(1)
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.last, f.body = r.Clone(context.Background()), b
		f.mu.Unlock()
		h(w, r)
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *farEnd) seen() (*http.Request, []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.last, f.body
}

type fixture struct {
	url    string
	ledger *recordingLedger
	reg    *prometheus.Registry
	index  *Index
	srv    *Server
}

// newFixture is a broker forwarding provider "oa" (openai) and "an"
// (anthropic) to far, with ann's sandbox at 127.0.0.1 (the test client's
// address).
func newFixture(t *testing.T, far string, adjust func(*Options)) *fixture {
	t.Helper()
	f := &fixture{ledger: newRecordingLedger(), reg: prometheus.NewRegistry(), index: NewIndex()}
	f.index.Set("ann", netip.MustParseAddr("127.0.0.1"))
	o := Options{
		Providers: []config.Provider{
			{Name: "oa", API: config.APIOpenAI, BaseURL: far + "/v1", Models: []string{"gpt-x", "gpt-y"}},
			{Name: "an", API: config.APIAnthropic, BaseURL: far, Models: []string{"claude-x"}},
		},
		Keys:          map[string]string{"oa": "sk-broker-oa", "an": "sk-broker-an"},
		Prices:        map[string]config.Price{"gpt-x": {Input: 1, Output: 2, Cached: 0.5}, "claude-x": {Input: 3, Output: 15, Cached: 0.3}},
		MaxBody:       4096,
		CallTimeout:   time.Minute,
		HeaderTimeout: 10 * time.Second, ShutdownTimeout: time.Second,
		Ledger: f.ledger, Index: f.index, Instance: "b1",
		Current: time.Now, MaxStaleness: time.Minute,
		Log: slog.New(slog.DiscardHandler), Metrics: f.reg,
	}
	if adjust != nil {
		adjust(&o)
	}
	srv, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	f.srv = srv
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	f.url = hs.URL
	return f
}

func (f *fixture) refused(reason string) float64 {
	return testutil.ToFloat64(f.srv.m.refused.WithLabelValues(reason))
}

func post(t *testing.T, url, body string, hdr ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// errorOf reads an error answer in either shape: (type, message, code).
func errorOf(t *testing.T, resp *http.Response, api string) (typ, msg, code string) {
	t.Helper()
	b, _ := io.ReadAll(resp.Body)
	var o struct {
		Type  string `json:"type"`
		Error struct {
			Type    string  `json:"type"`
			Message string  `json:"message"`
			Code    *string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(b, &o); err != nil {
		t.Fatalf("not JSON: %s", b)
	}
	if api == config.APIAnthropic && o.Type != "error" {
		t.Fatalf("not Anthropic's error shape: %s", b)
	}
	if api == config.APIOpenAI && o.Type != "" {
		t.Fatalf("not OpenAI's error shape: %s", b)
	}
	if o.Error.Message == "" {
		t.Fatalf("no message: %s", b)
	}
	if o.Error.Code != nil {
		code = *o.Error.Code
	}
	return o.Error.Type, o.Error.Message, code
}

// The first event reaches the client before the provider sends the
// second: nothing is buffered. The stream's final usage chunk is metered,
// and the broker asked for it (include_usage).
func TestStreamsEventByEvent(t *testing.T) {
	next := make(chan struct{})
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-next:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":20,\"prompt_tokens_details\":{\"cached_tokens\":40}}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	f := newFixture(t, far.URL, nil)
	resp := post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d, type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	rd := bufio.NewReader(resp.Body)
	got := make(chan string, 1)
	go func() {
		line, _ := rd.ReadString('\n')
		got <- line
	}()
	select {
	case line := <-got:
		if !strings.Contains(line, "Hel") {
			t.Fatalf("first event %q", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first event was held back until the provider sent more")
	}
	close(next) // only now does the provider send the rest
	rest, _ := io.ReadAll(rd)
	if !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("rest of the stream: %q", rest)
	}
	u := f.ledger.usage(t)
	want := events.UsageEvent{V: 1, ID: "call-1", User: "ann", Broker: "b1", Provider: "oa", Model: "gpt-x", Status: 200, Stream: true,
		InputTokens: 100, OutputTokens: 20, CachedTokens: 40, CostMicros: 60*1 + 40*0.5 + 20*2}
	u.Duration, u.At = 0, time.Time{}
	if u != want {
		t.Fatalf("usage\n got %+v\nwant %+v", u, want)
	}
	_, body := far.seen()
	var sent struct {
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if json.Unmarshal(body, &sent) != nil || !sent.StreamOptions.IncludeUsage {
		t.Fatalf("the provider was not asked for the stream's usage: %s", body)
	}
	if got := testutil.ToFloat64(f.srv.m.tokens.WithLabelValues("oa", "gpt-x", "output")); got != 20 {
		t.Fatalf("output tokens metric %v", got)
	}
	if got := testutil.ToFloat64(f.srv.m.calls.WithLabelValues("oa", "gpt-x", "2xx")); got != 1 {
		t.Fatalf("calls metric %v", got)
	}
}

// A client that leaves mid-stream ends the provider's call, and what
// was relayed is metered (estimated: the provider never reported usage).
// While the provider is between tokens (idle), nothing is written that
// could fail: only the broker's watch of the connection can tell.
func TestClientGoneCancelsUpstream(t *testing.T) {
	for _, idle := range []bool{false, true} {
		t.Run(map[bool]string{false: "streaming", true: "idle"}[idle], func(t *testing.T) {
			cancelled := make(chan struct{})
			far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				for {
					fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"word \"}}]}\n\n")
					w.(http.Flusher).Flush()
					next := time.After(10 * time.Millisecond)
					if idle {
						next = nil
					}
					select {
					case <-r.Context().Done():
						close(cancelled)
						return
					case <-next:
					}
				}
			})
			f := newFixture(t, far.URL, nil)
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.url+"/oa/v1/chat/completions", strings.NewReader(`{"model":"gpt-x","stream":true}`))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
				t.Fatal(err)
			}
			cancel()
			resp.Body.Close()
			select {
			case <-cancelled:
			case <-time.After(10 * time.Second):
				t.Fatal("the provider's call went on after the client left")
			}
			u := f.ledger.usage(t)
			if !u.Estimated || u.OutputTokens == 0 || u.Status != 200 {
				t.Fatalf("usage of a cut stream: %+v", u)
			}
		})
	}
}

// A provider that does not start answering within HeaderTimeout: 504 in
// its shape; one that cannot be reached: 502. Either ends the call once.
func TestProviderTimeoutAndUnreachable(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	f := newFixture(t, far.URL, func(o *Options) { o.HeaderTimeout = 200 * time.Millisecond })
	resp := post(t, f.url+"/an/v1/messages", `{"model":"claude-x","max_tokens":5}`)
	if resp.StatusCode != http.StatusGatewayTimeout {
		t.Fatalf("status %d, want 504", resp.StatusCode)
	}
	if typ, _, _ := errorOf(t, resp, config.APIAnthropic); typ != "api_error" {
		t.Fatalf("type %q", typ)
	}
	if u := f.ledger.usage(t); u.Status != 0 || u.InputTokens != 0 {
		t.Fatalf("usage of an unanswered call: %+v", u)
	}

	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := "http://" + ln.Addr().String()
	ln.Close()
	g := newFixture(t, dead, nil)
	resp = post(t, g.url+"/oa/chat/completions", `{"model":"gpt-x"}`)
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d, want 502", resp.StatusCode)
	}
	if typ, msg, _ := errorOf(t, resp, config.APIOpenAI); typ != "server_error" || !strings.Contains(msg, "cannot be reached") {
		t.Fatalf("type %q message %q", typ, msg)
	}
	if u := g.ledger.usage(t); u.Status != 0 || u.CostMicros != 0 {
		t.Fatalf("usage of an unreached provider: %+v", u)
	}
}

// Bad input is answered by the broker in the provider's shape and never
// reaches the provider, the ledger included (it costs nothing).
func TestBadInputNeverForwarded(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) { t.Errorf("forwarded: %s", r.URL) })
	f := newFixture(t, far.URL, nil)
	for _, tc := range []struct {
		name, path, body, encoding string
		status                     int
		api, typ, code, reason     string
	}{
		{"unknown model", "/oa/chat/completions", `{"model":"gpt-5-expensive","stream":true}`, "", 400, "openai", "invalid_request_error", "model_not_found", ReasonModel},
		{"unknown model anthropic", "/an/v1/messages", `{"model":"claude-opus"}`, "", 400, "anthropic", "invalid_request_error", "", ReasonModel},
		{"duplicate key ends on an unknown model", "/oa/chat/completions", `{"model":"gpt-x","model":"gpt-5"}`, "", 400, "openai", "invalid_request_error", "model_not_found", ReasonModel},
		{"malformed", "/oa/chat/completions", `{"model":"gpt-x",`, "", 400, "openai", "invalid_request_error", "", ReasonMalformed},
		{"no model", "/an/v1/messages", `{"max_tokens":1}`, "", 400, "anthropic", "invalid_request_error", "", ReasonMalformed},
		{"oversized", "/oa/chat/completions", `{"model":"gpt-x","x":"` + strings.Repeat("a", 5000) + `"}`, "", 413, "openai", "invalid_request_error", "", ReasonTooLarge},
		{"oversized anthropic", "/an/v1/messages", `{"model":"claude-x","x":"` + strings.Repeat("a", 5000) + `"}`, "", 413, "anthropic", "request_too_large", "", ReasonTooLarge},
		{"compressed", "/oa/chat/completions", `{"model":"gpt-x"}`, "gzip", 415, "openai", "invalid_request_error", "", ReasonEncoding},
		{"climbing path", "/oa/../an/v1/messages", `{"model":"claude-x"}`, "", 400, "openai", "invalid_request_error", "", ReasonPath},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := f.refused(tc.reason)
			req, _ := http.NewRequest(http.MethodPost, f.url+tc.path, strings.NewReader(tc.body))
			req.URL.Opaque = tc.path // keep the dots as sent
			if tc.encoding != "" {
				req.Header.Set("Content-Encoding", tc.encoding)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.status)
			}
			typ, _, code := errorOf(t, resp, tc.api)
			if typ != tc.typ || code != tc.code {
				t.Fatalf("type %q code %q, want %q %q", typ, code, tc.typ, tc.code)
			}
			if f.refused(tc.reason) != before+1 {
				t.Fatalf("refusal not counted as %q", tc.reason)
			}
		})
	}
	if far.calls.Load() != 0 || len(f.ledger.admits) != 0 {
		t.Fatalf("bad input reached the provider (%d) or the ledger (%d)", far.calls.Load(), len(f.ledger.admits))
	}
}

// Whatever key the sandbox sends is dropped; the provider sees the
// broker's own (or the user's brought one, not charged), and none of the
// client's identity headers.
func TestKeysStrippedAndInjected(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":10,"output_tokens":3}}`)
	})
	hostile := []string{"Authorization", "Bearer sk-stolen", "X-Api-Key", "sk-stolen", "Api-Key", "sk-stolen",
		"X-Forwarded-For", "10.9.9.9", "Cookie", "aaas_session=bob", "Openai-Organization", "org-bob", "Anthropic-Beta", "tools-1"}
	for _, tc := range []struct {
		name, path, body, header, want string
		byok                           bool
	}{
		{"openai", "/oa/chat/completions", `{"model":"gpt-x"}`, "Authorization", "Bearer sk-broker-oa", false},
		{"anthropic", "/an/v1/messages", `{"model":"claude-x"}`, "X-Api-Key", "sk-broker-an", false},
		{"anthropic brought key", "/an/v1/messages", `{"model":"claude-x"}`, "X-Api-Key", "sk-ann-own", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, far.URL, func(o *Options) {
				if tc.byok {
					o.Credentials = func(_ context.Context, user, provider string) (string, bool, error) {
						return "sk-ann-own", user == "ann" && provider == "an", nil
					}
				}
			})
			resp := post(t, f.url+tc.path, tc.body, hostile...)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			io.Copy(io.Discard, resp.Body)
			seen, _ := far.seen()
			if got := seen.Header.Get(tc.header); got != tc.want {
				t.Fatalf("%s %q, want %q", tc.header, got, tc.want)
			}
			for _, h := range []string{"Authorization", "X-Api-Key", "Api-Key", "X-Forwarded-For", "Cookie", "Openai-Organization", "Forwarded"} {
				if v := seen.Header.Get(h); v != "" && h != tc.header {
					t.Errorf("the provider saw %s: %q", h, v)
				}
			}
			if strings.Contains(fmt.Sprint(seen.Header), "sk-stolen") {
				t.Errorf("the client's key reached the provider: %v", seen.Header)
			}
			if strings.HasPrefix(tc.path, "/an/") && (seen.Header.Get("Anthropic-Version") != "2023-06-01" || seen.Header.Get("Anthropic-Beta") != "tools-1") {
				t.Errorf("anthropic headers: %v", seen.Header)
			}
			u := f.ledger.usage(t)
			if u.BYOK != tc.byok || f.ledger.admits[0] == tc.byok {
				t.Fatalf("byok %v, charged %v", u.BYOK, f.ledger.admits[0])
			}
		})
	}
}

// A refusal from the ledger (budget spent, too many calls) is the
// answer, in the shape, and nothing is forwarded.
func TestLedgerRefusal(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) { t.Errorf("forwarded: %s", r.URL) })
	for _, api := range []string{config.APIOpenAI, config.APIAnthropic} {
		f := newFixture(t, far.URL, nil)
		f.ledger.refuse = &Refusal{Status: 429, Reason: "budget", RetryAfter: 90 * time.Second,
			Message: "your model budget of $5.00 for 2026-12 is spent ($5.01 used); it renews on 2027-01-01"}
		path, body := "/oa/chat/completions", `{"model":"gpt-x","stream":true}`
		if api == config.APIAnthropic {
			path, body = "/an/v1/messages", `{"model":"claude-x","stream":true}`
		}
		resp := post(t, f.url+path, body)
		if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "90" {
			t.Fatalf("%s: status %d retry-after %q", api, resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		if typ, msg, _ := errorOf(t, resp, api); typ != "rate_limit_error" || !strings.Contains(msg, "budget of $5.00") {
			t.Fatalf("%s: type %q message %q", api, typ, msg)
		}
		if f.refused("budget") != 1 {
			t.Fatal("refusal not counted")
		}
	}
	if far.calls.Load() != 0 {
		t.Fatal("a refused call reached the provider")
	}
}

// /models is answered from the configuration, in each API's list shape.
func TestModelsAnsweredLocally(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) { t.Errorf("forwarded: %s", r.URL) })
	f := newFixture(t, far.URL, nil)
	for _, tc := range []struct{ path, want string }{
		{"/oa/models", `{"data":[{"created":0,"id":"gpt-x","object":"model","owned_by":"oa"},{"created":0,"id":"gpt-y","object":"model","owned_by":"oa"}],"object":"list"}`},
		{"/oa/v1/models", `{"data":[{"created":0,"id":"gpt-x","object":"model","owned_by":"oa"},{"created":0,"id":"gpt-y","object":"model","owned_by":"oa"}],"object":"list"}`},
		{"/an/v1/models", `{"data":[{"created_at":"1970-01-01T00:00:00Z","display_name":"claude-x","id":"claude-x","type":"model"}],"first_id":"claude-x","has_more":false,"last_id":"claude-x"}`},
	} {
		resp, err := http.Get(f.url + tc.path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != tc.want {
			t.Fatalf("%s: %d %s", tc.path, resp.StatusCode, b)
		}
	}
}

// Nothing a request carries names the user: another user's key, a
// forwarded-for address of another sandbox, a user field in the body.
// The call from ann's address is ann's; a call from an address no
// sandbox has is refused whatever it claims, and reaches nothing.
func TestHostileRequestsChangeNothing(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":7,"completion_tokens":1}}`)
	})
	f := newFixture(t, far.URL, nil)
	f.index.Set("bob", netip.MustParseAddr("127.0.0.9"))
	forged := []string{"Authorization", "Bearer aaas-broker-bob", "X-Api-Key", "bob", "X-Forwarded-For", "127.0.0.9",
		"X-Real-Ip", "127.0.0.9", "Forwarded", "for=127.0.0.9", "X-Aaas-User", "bob"}
	resp := post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x","user":"bob"}`, forged...)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	io.Copy(io.Discard, resp.Body)
	if u := f.ledger.usage(t); u.User != "ann" || u.InputTokens != 7 {
		t.Fatalf("charged %+v, want ann", u)
	}
	seen, _ := far.seen()
	for _, h := range []string{"X-Forwarded-For", "X-Real-Ip", "Forwarded", "X-Aaas-User", "X-Api-Key"} {
		if seen.Header.Get(h) != "" {
			t.Errorf("the provider saw %s", h)
		}
	}

	f.index.Set("ann", netip.Addr{}) // ann's sandbox is no longer Ready
	calls := far.calls.Load()
	resp = post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x","user":"bob"}`, forged...)
	if resp.StatusCode != 403 {
		t.Fatalf("status %d, want 403", resp.StatusCode)
	}
	if typ, msg, _ := errorOf(t, resp, config.APIOpenAI); typ != "permission_error" || !strings.Contains(msg, "not a running sandbox") {
		t.Fatalf("type %q message %q", typ, msg)
	}
	if far.calls.Load() != calls || len(f.ledger.admits) != 1 {
		t.Fatal("an unattributed call was forwarded or admitted")
	}
	if f.refused(ReasonUnattributed) != 1 {
		t.Fatal("refusal not counted")
	}
}

// Non-streamed answers are metered from their usage object; a provider's
// error is relayed as it is and costs nothing.
func TestPlainAnswersMetered(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if strings.Contains(r.URL.Path, "messages") {
			fmt.Fprint(w, `{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"Hi!"}],"model":"claude-x","stop_reason":"end_turn","usage":{"input_tokens":12,"cache_read_input_tokens":100,"output_tokens":6}}`)
			return
		}
		w.WriteHeader(500)
		fmt.Fprint(w, `{"error":{"message":"boom","type":"server_error"}}`)
	})
	f := newFixture(t, far.URL, nil)
	resp := post(t, f.url+"/an/v1/messages?beta=true", `{"model":"claude-x","max_tokens":10}`)
	io.Copy(io.Discard, resp.Body)
	u := f.ledger.usage(t)
	if u.InputTokens != 112 || u.CachedTokens != 100 || u.OutputTokens != 6 || u.Estimated || u.CostMicros != 12*3+30+6*15 {
		t.Fatalf("usage %+v", u)
	}
	if seen, _ := far.seen(); seen.URL.RawQuery != "beta=true" || seen.URL.Path != "/v1/messages" {
		t.Fatalf("forwarded to %s", seen.URL)
	}
	resp = post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x"}`)
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 500 || !strings.Contains(string(b), "boom") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if u := f.ledger.usage(t); u.Status != 500 || u.CostMicros != 0 || u.InputTokens != 0 {
		t.Fatalf("usage of a failed call %+v", u)
	}
	if seen, _ := far.seen(); seen.URL.Path != "/v1/chat/completions" {
		t.Fatalf("forwarded to %s", seen.URL)
	}
}

// A provider's stream that breaks off reaches the client broken, not as
// a complete answer, and the call is recorded all the same.
func TestBrokenStreamStaysBroken(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n")
		w.(http.Flusher).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		conn.Close() // the provider dies mid-stream
	})
	f := newFixture(t, far.URL, nil)
	resp := post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x","stream":true}`)
	b, err := io.ReadAll(resp.Body)
	if err == nil {
		t.Fatalf("a broken stream read as complete: %q", b)
	}
	if !strings.Contains(string(b), "Hel") {
		t.Fatalf("the part sent before the break is missing: %q", b)
	}
	if u := f.ledger.usage(t); u.Status != 200 || !u.Estimated || u.OutputTokens == 0 {
		t.Fatalf("usage %+v", u)
	}
}

// A copy of the sandboxes bucket not confirmed current for longer than
// MaxStaleness attributes nothing: the address may be another tenant's
// by now.
func TestStaleIndexAttributesNothing(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) { t.Errorf("forwarded: %s", r.URL) })
	f := newFixture(t, far.URL, func(o *Options) {
		o.Current = func() time.Time { return time.Now().Add(-2 * time.Minute) }
	})
	resp := post(t, f.url+"/an/v1/messages", `{"model":"claude-x"}`)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if typ, _, _ := errorOf(t, resp, config.APIAnthropic); typ != "overloaded_error" {
		t.Fatalf("type %q", typ)
	}
	if f.refused(ReasonStale) != 1 || len(f.ledger.admits) != 0 {
		t.Fatal("not refused as stale, or admitted")
	}
}

// A forwarded body is let go as it is sent: the transport keeps the
// request until a stream ends, minutes later, and must not keep an
// agent's whole conversation with it.
func TestSendOnceLetsGoOfWhatItSent(t *testing.T) {
	want := strings.Repeat("conversation ", 1000)
	o := &sendOnce{b: []byte(want)}
	got, err := io.ReadAll(io.LimitReader(o, int64(len(want))))
	if err != nil || string(got) != want {
		t.Fatalf("read %d bytes, %v", len(got), err)
	}
	if o.b != nil {
		t.Fatalf("after the last byte it still holds %d bytes (cap %d)", len(o.b), cap(o.b))
	}
	if n, err := o.Read(make([]byte, 8)); n != 0 || err != io.EOF {
		t.Fatalf("read after the end: %d, %v", n, err)
	}
}

// A streamed answer to an HTTP/1.1 client is chunked, ends with its last
// chunk (a whole stream reads as whole) and closes the connection; the
// headers the client may see are relayed, line breaks and all dropped.
func TestStreamFramingOverHTTP11(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		w.Header().Set("X-Request-Id", "req-1")
		w.Header().Set("Set-Cookie", "provider=1")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n")
		w.(http.Flusher).Flush()
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n")
	})
	f := newFixture(t, far.URL, nil)
	resp := post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x","stream":true}`)
	b, err := io.ReadAll(resp.Body)
	if err != nil || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Fatalf("stream read %q, %v", b, err)
	}
	if !slices.Equal(resp.TransferEncoding, []string{"chunked"}) || !resp.Close || resp.Header.Get("Content-Type") != "text/event-stream; charset=utf-8" ||
		resp.Header.Get("X-Request-Id") != "req-1" || resp.Header.Get("X-Accel-Buffering") != "no" || resp.Header.Get("Set-Cookie") != "" || resp.Header.Get("Date") == "" {
		t.Fatalf("framing %v close=%v, headers %v", resp.TransferEncoding, resp.Close, resp.Header)
	}
	if u := f.ledger.usage(t); u.Status != 200 || u.InputTokens != 7 || u.OutputTokens != 3 || u.Estimated {
		t.Fatalf("usage %+v", u)
	}
}

// An HTTP/1.0 client gets the stream delimited by the connection's end,
// as net/http would answer it.
func TestStreamOverHTTP10(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\ndata: [DONE]\n\n")
	})
	f := newFixture(t, far.URL, nil)
	conn, err := net.Dial("tcp", strings.TrimPrefix(f.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"gpt-x","stream":true}`
	fmt.Fprintf(conn, "POST /oa/chat/completions HTTP/1.0\r\nHost: broker\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	b, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	head, rest, _ := strings.Cut(string(b), "\r\n\r\n")
	if !strings.HasPrefix(head, "HTTP/1.0 200 OK\r\n") || strings.Contains(head, "Transfer-Encoding") || rest != "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\ndata: [DONE]\n\n" {
		t.Fatalf("answer %q", b)
	}
}

// Shutting down, the broker lets a stream in flight finish within
// ShutdownTimeout; one that runs longer is ended then, its client sees
// it broken and the call is recorded. Serve returns once both are done.
func TestShutdownDrainsStreams(t *testing.T) {
	release := make(chan struct{})
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n")
		w.(http.Flusher).Flush()
		if strings.Contains(r.URL.RawQuery, "long") {
			<-r.Context().Done()
			return
		}
		select {
		case <-release:
			fmt.Fprint(w, "data: [DONE]\n\n")
		case <-r.Context().Done():
		}
	})
	f := newFixture(t, far.URL, func(o *Options) { o.ShutdownTimeout = 2 * time.Second })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- f.srv.Serve(ctx, ln) }()
	open := func(query string) (*bufio.Reader, *http.Response) {
		resp := post(t, "http://"+ln.Addr().String()+"/oa/chat/completions?"+query, `{"model":"gpt-x","stream":true}`)
		rd := bufio.NewReader(resp.Body)
		if line, err := rd.ReadString('\n'); err != nil || !strings.Contains(line, "Hel") {
			t.Fatalf("first event %q, %v", line, err)
		}
		return rd, resp
	}
	short, _ := open("short")
	long, _ := open("long")
	stop()
	// Draining: the short stream finishes when its provider does.
	close(release)
	if rest, err := io.ReadAll(short); err != nil || string(rest) != "\ndata: [DONE]\n\n" {
		t.Fatalf("the stream let finish: %q, %v", rest, err)
	}
	// The long one is ended when the shutdown's time is up.
	if rest, err := io.ReadAll(long); err == nil {
		t.Fatalf("a stream ended by the shutdown read as whole: %q", rest)
	}
	select {
	case err := <-served:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Serve did not return")
	}
	if u := f.ledger.usage(t); u.Status != 200 {
		t.Fatalf("first call recorded %+v", u)
	}
	if u := f.ledger.usage(t); u.Status != 200 || !u.Estimated {
		t.Fatalf("second call recorded %+v", u)
	}
}

// Which calls go on a connection of their own: streams to a provider
// over plain HTTP with no proxy in front; everything else through
// http.Transport.
func TestDirectIsForPlainHTTPStreams(t *testing.T) {
	f := newFixture(t, "http://provider.test", nil)
	proxied := newFixture(t, "http://provider.test", nil)
	proxied.srv.transport.Proxy = func(*http.Request) (*url.URL, error) { return url.Parse("http://proxy.test:3128") }
	for _, c := range []struct {
		srv    *Server
		url    string
		stream bool
		want   bool
	}{
		{f.srv, "http://provider.test/v1/chat/completions", true, true},
		{f.srv, "http://provider.test/v1/chat/completions", false, false},
		{f.srv, "https://api.provider.test/v1/chat/completions", true, false},
		{proxied.srv, "http://provider.test/v1/chat/completions", true, false},
	} {
		req, _ := http.NewRequest(http.MethodPost, c.url, nil)
		if got := c.srv.direct(req, c.stream); got != c.want {
			t.Errorf("%s stream=%v proxied=%v: direct %v, want %v", c.url, c.stream, c.srv == proxied.srv, got, c.want)
		}
	}
}

// A stream on a connection of its own fails as one through
// http.Transport does: 504 when the provider does not start answering
// within HeaderTimeout, 502 when it cannot be reached or its head is not
// HTTP; informational answers are passed over and an error answer is
// relayed whole.
func TestDirectStreamAnswers(t *testing.T) {
	body := `{"model":"gpt-x","stream":true}`
	t.Run("slow", func(t *testing.T) {
		far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
		f := newFixture(t, far.URL, func(o *Options) { o.HeaderTimeout = 200 * time.Millisecond })
		if resp := post(t, f.url+"/oa/chat/completions", body); resp.StatusCode != http.StatusGatewayTimeout {
			t.Fatalf("status %d, want 504", resp.StatusCode)
		}
		if u := f.ledger.usage(t); u.Status != 0 {
			t.Fatalf("usage %+v", u)
		}
	})
	t.Run("unreachable", func(t *testing.T) {
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		dead := "http://" + ln.Addr().String()
		ln.Close()
		f := newFixture(t, dead, nil)
		if resp := post(t, f.url+"/oa/chat/completions", body); resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("status %d, want 502", resp.StatusCode)
		}
	})
	t.Run("not HTTP", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				conn, err := ln.Accept()
				if err != nil {
					return
				}
				go func() {
					defer conn.Close()
					_, _ = bufio.NewReader(conn).ReadString('\n')
					_, _ = io.WriteString(conn, "SSH-2.0-OpenSSH_9.9\r\n"+strings.Repeat("x", 2<<20))
				}()
			}
		}()
		f := newFixture(t, "http://"+ln.Addr().String(), nil)
		if resp := post(t, f.url+"/oa/chat/completions", body); resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("status %d, want 502", resp.StatusCode)
		}
	})
	t.Run("early hints", func(t *testing.T) {
		far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\ndata: [DONE]\n\n")
		})
		f := newFixture(t, far.URL, nil)
		resp := post(t, f.url+"/oa/chat/completions", body)
		if b, err := io.ReadAll(resp.Body); resp.StatusCode != http.StatusOK || err != nil || !strings.HasSuffix(string(b), "[DONE]\n\n") {
			t.Fatalf("%d %q %v", resp.StatusCode, b, err)
		}
	})
	t.Run("error answer", func(t *testing.T) {
		far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "7")
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprint(w, `{"error":{"message":"slow down","type":"rate_limit"}}`)
		})
		f := newFixture(t, far.URL, nil)
		resp := post(t, f.url+"/oa/chat/completions", body)
		if b, err := io.ReadAll(resp.Body); resp.StatusCode != http.StatusTooManyRequests || err != nil || resp.Header.Get("Retry-After") != "7" || !strings.Contains(string(b), "slow down") {
			t.Fatalf("%d %q %v %v", resp.StatusCode, b, err, resp.Header)
		}
		if u := f.ledger.usage(t); u.Status != http.StatusTooManyRequests || u.CostMicros != 0 {
			t.Fatalf("usage %+v", u)
		}
	})
}

// A call from a named sandbox (ann--work) is admitted as that sandbox's,
// so its beacons keep it awake, and recorded as its owner's. Neither is
// ever the provider key the broker injects: a key shaped like an account
// name once took the sandbox's place, and calls were charged to an
// "account" named after the organisation's key.
func TestACallIsItsSandboxsAndItsOwnersNeverTheKeys(t *testing.T) {
	far := newFarEnd(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c1","object":"chat.completion","model":"gpt-x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	})
	f := newFixture(t, far.URL, func(o *Options) { o.Keys["oa"] = "org-key-shaped-like-a-name" })
	f.index.Set("ann", netip.Addr{})
	f.index.Set("ann--work", netip.MustParseAddr("127.0.0.1"))
	resp := post(t, f.url+"/oa/chat/completions", `{"model":"gpt-x"}`)
	io.Copy(io.Discard, resp.Body)
	if u := f.ledger.usage(t); u.User != "ann" {
		t.Fatalf("the call was recorded as %q's", u.User)
	}
	f.ledger.mu.Lock()
	defer f.ledger.mu.Unlock()
	if len(f.ledger.keys) != 1 || f.ledger.keys[0] != "ann--work" {
		t.Fatalf("the ledger admitted the calls of %q", f.ledger.keys)
	}
}
