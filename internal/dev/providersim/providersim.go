// Package providersim is the model provider stand-in: an OpenAI-compatible
// (chat completions, models) and Anthropic-compatible (messages) server
// that answers deterministically, streams event by event and reports usage
// in each API's own fields. Tests use it only as the far end of a call (the
// broker's upstream, or dshsim's provider): what it answers is a fixture,
// what it records (GET /_sim/calls) is what a provider would have seen.
//
// Switches are model name suffixes, so a chat in the browser can pick them
// by model name: -slow, -fail, -nousage and -long (see Switches). They
// combine: "deepseek-chat-slow-nousage".
package providersim

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Options configures the stand-in; OptionsFromEnv fills it.
type Options struct {
	Listen string   // PROVIDERSIM_LISTEN; default ":8091"
	Keys   []string // PROVIDERSIM_KEYS, comma-separated; required
	// Slow (PROVIDERSIM_SLOW, default 5s) is how long a -slow model waits
	// before its first byte.
	Slow time.Duration
	// TokenInterval (PROVIDERSIM_TOKEN_INTERVAL, default 100ms) separates
	// the tokens of -slow and -long streams.
	TokenInterval time.Duration
}

const (
	defaultListen        = ":8091"
	defaultSlow          = 5 * time.Second
	defaultTokenInterval = 100 * time.Millisecond
	// maxBody bounds a request body; a larger one is answered 413.
	maxBody = 4 << 20
	// maxCalls bounds the call log; the oldest entries go first.
	maxCalls = 10000
)

// OptionsFromEnv reads the PROVIDERSIM_* variables.
func OptionsFromEnv(getenv func(string) string) (Options, error) {
	o := Options{Listen: getenv("PROVIDERSIM_LISTEN"), Slow: defaultSlow, TokenInterval: defaultTokenInterval}
	if o.Listen == "" {
		o.Listen = defaultListen
	}
	for k := range strings.SplitSeq(getenv("PROVIDERSIM_KEYS"), ",") {
		if k = strings.TrimSpace(k); k != "" {
			o.Keys = append(o.Keys, k)
		}
	}
	if len(o.Keys) == 0 {
		return Options{}, errors.New("PROVIDERSIM_KEYS is required: the keys the stand-in accepts, comma-separated")
	}
	for name, d := range map[string]*time.Duration{"PROVIDERSIM_SLOW": &o.Slow, "PROVIDERSIM_TOKEN_INTERVAL": &o.TokenInterval} {
		v := getenv(name)
		if v == "" {
			continue
		}
		parsed, err := time.ParseDuration(v)
		if err != nil || parsed < 0 {
			return Options{}, fmt.Errorf("parse %s: %q is not a non-negative duration", name, v)
		}
		*d = parsed
	}
	return o, nil
}

// Call is one request the stand-in answered, as GET /_sim/calls lists it.
type Call struct {
	// KeyHint is the last 4 characters of the key presented (all of it
	// when shorter), empty when none was: enough to tell keys apart
	// without the log holding one.
	KeyHint string `json:"key_hint"`
	API     string `json:"api"` // openai or anthropic
	Path    string `json:"path"`
	Model   string `json:"model,omitempty"`
	Stream  bool   `json:"stream"`
	Status  int    `json:"status"`
	// Remote is the host of the caller's address (port dropped): the
	// source address the provider saw.
	Remote string `json:"remote"`
	// Tokens are counted by the rule of CountTokens; for a stream cut
	// short, OutputTokens is what was sent.
	InputTokens  int `json:"input_tokens"`
	CachedTokens int `json:"cached_tokens"`
	OutputTokens int `json:"output_tokens"`
}

// Server is the stand-in's HTTP handler.
type Server struct {
	opts Options
	mux  *http.ServeMux

	mu    sync.Mutex
	calls []Call
	seq   int // message ids
}

// New returns the stand-in for o.
func New(o Options) *Server {
	s := &Server{opts: o, mux: http.NewServeMux()}
	s.mux.HandleFunc("POST /v1/chat/completions", s.serveChat)
	s.mux.HandleFunc("POST /chat/completions", s.serveChat)
	s.mux.HandleFunc("GET /v1/models", s.serveModels)
	s.mux.HandleFunc("GET /models", s.serveModels)
	s.mux.HandleFunc("POST /v1/messages", s.serveMessages)
	s.mux.HandleFunc("GET /_sim/calls", s.serveCalls)
	s.mux.HandleFunc("DELETE /_sim/calls", s.resetCalls)
	return s
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Calls returns the calls served so far, oldest first.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Call{}, s.calls...)
}

func (s *Server) record(c Call) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.calls) >= maxCalls {
		s.calls = append(s.calls[:0], s.calls[1:]...)
	}
	s.calls = append(s.calls, c)
}

func (s *Server) nextID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return s.seq
}

func (s *Server) serveCalls(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.Calls())
}

func (s *Server) resetCalls(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	s.calls = nil
	s.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// authorized compares the key in constant time with every accepted key.
func (s *Server) authorized(key string) bool {
	ok := false
	for _, k := range s.opts.Keys {
		if subtle.ConstantTimeCompare([]byte(k), []byte(key)) == 1 {
			ok = true
		}
	}
	return key != "" && ok
}

func keyHint(key string) string {
	if len(key) <= 4 {
		return key
	}
	return key[len(key)-4:]
}

func remoteHost(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// wait sleeps for d or until ctx ends; false when ctx ended.
func wait(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// Run serves on ln until ctx ends. Open streams (a -long one never ends by
// itself) are cut when ctx ends.
func Run(ctx context.Context, o Options, ln net.Listener) error {
	hs := &http.Server{
		Handler:           New(o),
		ReadHeaderTimeout: 30 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	select {
	case err := <-served:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := hs.Shutdown(sctx); err != nil {
			_ = hs.Close()
		}
		return nil
	}
}

// readBody reads a request body of at most maxBody bytes; tooBig reports
// that the limit was hit.
func readBody(w http.ResponseWriter, r *http.Request) (body []byte, tooBig bool, err error) {
	body, err = io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	var mbe *http.MaxBytesError
	return body, errors.As(err, &mbe), err
}
