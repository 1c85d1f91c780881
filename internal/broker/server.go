package broker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
)

// Ledger admits calls (budget, concurrency slot) and records them.
type Ledger interface {
	// Admit returns a *Refusal error when the call must not go ahead.
	// charged is false for a BYOK call (not held to the budget).
	Admit(ctx context.Context, user string, charged bool) (Call, error)
}

// Call is one admitted call; End is called exactly once when it ends
// (the usage filled in: tokens, cost, status, duration), releasing its
// slot, recording its usage and ending its activity beacons.
type Call interface {
	ID() string
	End(u events.UsageEvent)
}

// Credentials finds the key user brought for provider (BYOK): ok is false
// when they brought none, and err when it cannot be told.
type Credentials func(ctx context.Context, user, provider string) (key string, ok bool, err error)

// Options configure a Server.
type Options struct {
	Providers []config.Provider
	// Keys are the providers' keys by provider name (LoadKeys); a
	// provider without one is called without a key.
	Keys map[string]string
	// Prices are by model; a model without one costs nothing.
	Prices map[string]config.Price
	// MaxBody is the largest request body (413 beyond).
	MaxBody int
	// CallTimeout bounds a whole call, its stream included;
	// HeaderTimeout the wait for the provider's answer to start (504).
	CallTimeout, HeaderTimeout time.Duration
	// ShutdownTimeout is how long Serve lets calls in flight finish once
	// its context ends.
	ShutdownTimeout time.Duration
	Ledger          Ledger
	// Credentials, when set (BROKER_BYOK), is asked for the user's own
	// key before each forwarded call.
	Credentials Credentials
	// Index says whose call a connection's address makes it; Current is
	// when its source (the sandboxes watch) was last confirmed current.
	// Older than MaxStaleness, the index may name a user whose pod's
	// address has gone to another tenant: calls answer 503.
	Index        *Index
	Current      func() time.Time
	MaxStaleness time.Duration
	// Instance is this broker's INSTANCE_ID, in the usage events.
	Instance string
	Log      *slog.Logger
	Metrics  prometheus.Registerer
}

// Server is the broker's HTTP side: sandboxes call
// /<provider>/<path>, which it forwards to the provider's base URL.
type Server struct {
	o         Options
	providers map[string]provider
	transport *http.Transport
	m         *metrics
}

type provider struct {
	config.Provider
	base *url.URL
}

// New validates o and makes a Server.
func New(o Options) (*Server, error) {
	switch {
	case len(o.Providers) == 0:
		return nil, errors.New("broker: no providers")
	case o.Ledger == nil || o.Index == nil || o.Current == nil || o.Log == nil || o.Metrics == nil:
		return nil, errors.New("broker: Ledger, Index, Current, Log and Metrics are required")
	case o.MaxBody <= 0 || o.CallTimeout <= 0 || o.HeaderTimeout <= 0 || o.MaxStaleness <= 0:
		return nil, errors.New("broker: MaxBody, CallTimeout, HeaderTimeout and MaxStaleness must be positive")
	}
	s := &Server{o: o, providers: map[string]provider{}, m: newMetrics(o.Metrics)}
	for _, p := range o.Providers {
		base, err := url.Parse(p.BaseURL)
		if err != nil || base.Host == "" {
			return nil, fmt.Errorf("broker: provider %s: base URL %q: %v", p.Name, p.BaseURL, err)
		}
		if _, dup := s.providers[p.Name]; dup {
			return nil, fmt.Errorf("broker: provider %s listed twice", p.Name)
		}
		s.providers[p.Name] = provider{Provider: p, base: base}
	}
	dialer := &net.Dialer{Timeout: min(o.HeaderTimeout, 30*time.Second), KeepAlive: 30 * time.Second}
	s.transport = &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           dialer.DialContext,
		ForceAttemptHTTP2:     true,
		TLSHandshakeTimeout:   min(o.HeaderTimeout, 30*time.Second),
		ResponseHeaderTimeout: o.HeaderTimeout,
		// Every call of every user goes to a few hosts: a small idle pool
		// would close most connections after each call at a few hundred
		// concurrent streams and pay a TLS handshake on the next.
		MaxIdleConnsPerHost: 1024,
		IdleConnTimeout:     90 * time.Second,
		// The meter reads the answer as the provider sends it; compressed
		// answers would be unreadable (Accept-Encoding: identity is sent).
		DisableCompression: true,
	}
	return s, nil
}

// Serve answers on ln until ctx ends, then lets calls in flight finish
// for ShutdownTimeout.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(s.o.Log.Handler(), slog.LevelDebug),
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), s.o.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	s.transport.CloseIdleConnections()
	return nil
}

// refuse answers r itself in api's shape and counts why.
func (s *Server) refuse(w http.ResponseWriter, api string, ref *Refusal) {
	s.m.refused.WithLabelValues(ref.Reason).Inc()
	code := ""
	switch ref.Reason {
	case ReasonModel:
		code = "model_not_found"
	case "budget":
		code = "insufficient_quota"
	}
	writeError(w, api, ref.Status, code, ref.Message, ref.RetryAfter)
}

// ServeHTTP is one model call: attribute, check, admit, forward, relay,
// meter.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	name, rest, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	p, ok := s.providers[name]
	if !ok {
		s.refuse(w, config.APIOpenAI, &Refusal{Status: http.StatusNotFound, Reason: ReasonProvider,
			Message: fmt.Sprintf("no provider is configured at /%s; call /<provider>/… with one of: %s", truncate(name, 32), s.names())})
		return
	}
	if age := time.Since(s.o.Current()); age > s.o.MaxStaleness {
		s.refuse(w, p.API, &Refusal{Status: http.StatusServiceUnavailable, Reason: ReasonStale, RetryAfter: 5 * time.Second,
			Message: "the broker cannot confirm which sandbox calls from this address right now; try again shortly"})
		return
	}
	ip, ok := peer(r.RemoteAddr)
	user, reason := "", ReasonUnattributed
	if ok {
		user, reason = s.o.Index.Lookup(ip)
	}
	if user == "" {
		s.refuse(w, p.API, &Refusal{Status: http.StatusForbidden, Reason: reason, Message: "this address is not a running sandbox: model calls are taken from sandboxes only"})
		return
	}
	if r.Method == http.MethodGet && (rest == "models" || rest == "v1/models") {
		writeModels(w, p.Provider)
		return
	}
	if ref := s.check(r, rest); ref != nil {
		s.refuse(w, p.API, ref)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(s.o.MaxBody)))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			s.refuse(w, p.API, &Refusal{Status: http.StatusRequestEntityTooLarge, Reason: ReasonTooLarge,
				Message: fmt.Sprintf("the request body is over the broker's limit of %d bytes", s.o.MaxBody)})
		} else {
			s.refuse(w, p.API, bad(ReasonMalformed, "the request body could not be read"))
		}
		return
	}
	in, ref := inspectRequest(p.Provider, r.Method, rest, r.Header.Get("Content-Type"), body)
	if ref != nil {
		s.refuse(w, p.API, ref)
		return
	}
	key, byok := s.o.Keys[p.Name], false
	if s.o.Credentials != nil {
		own, ok, err := s.o.Credentials(r.Context(), user, p.Name)
		if err != nil {
			s.o.Log.Warn("reading a brought key failed", "user", user, "provider", p.Name, "err", err)
			s.refuse(w, p.API, &Refusal{Status: http.StatusServiceUnavailable, Reason: ReasonUnavailable, RetryAfter: 5 * time.Second,
				Message: "the broker cannot read your stored key right now; try again shortly"})
			return
		}
		if ok {
			key, byok = own, true
		}
	}
	call, err := s.o.Ledger.Admit(r.Context(), user, !byok)
	if err != nil {
		if !errors.As(err, &ref) {
			s.o.Log.Warn("admitting a call failed", "user", user, "err", err)
			ref = &Refusal{Status: http.StatusServiceUnavailable, Reason: ReasonUnavailable, RetryAfter: 5 * time.Second,
				Message: "the broker cannot check your model budget right now; try again shortly"}
		}
		s.refuse(w, p.API, ref)
		return
	}
	ev := events.UsageEvent{V: events.SchemaVersion, ID: call.ID(), User: user, Broker: s.o.Instance,
		Provider: p.Name, Model: in.Model, Stream: in.Stream, BYOK: byok, At: start}
	defer func() { s.end(call, &ev, start) }()
	s.forward(w, r, p, rest, key, in, &ev, start)
}

// check refuses what the broker cannot inspect or forward faithfully: a
// path that climbs out of the provider's base URL, or a compressed body
// (the model check reads the body as sent).
func (s *Server) check(r *http.Request, rest string) *Refusal {
	for _, seg := range strings.Split(rest, "/") {
		if seg == "." || seg == ".." {
			return &Refusal{Status: http.StatusBadRequest, Reason: ReasonPath, Message: "the path may not contain . or .. segments"}
		}
	}
	if ce := r.Header.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
		return &Refusal{Status: http.StatusUnsupportedMediaType, Reason: ReasonEncoding, Message: "compressed request bodies are not accepted; send the body uncompressed"}
	}
	return nil
}

// forwardedHeaders are the only request headers passed to a provider:
// what shapes the answer, never who the caller is or what key it holds.
var forwardedHeaders = []string{"Content-Type", "Accept", "User-Agent", "Anthropic-Version", "Anthropic-Beta", "Openai-Beta"}

// relayedHeaders are the only provider headers passed back.
var relayedHeaders = []string{"Content-Type", "Content-Encoding", "Cache-Control", "Retry-After", "X-Request-Id", "Request-Id"}

// forward calls the provider and relays its answer as it comes, filling
// ev's status and tokens.
func (s *Server) forward(w http.ResponseWriter, r *http.Request, p provider, rest, key string, in inspected, ev *events.UsageEvent, start time.Time) {
	ctx, cancel := context.WithTimeout(r.Context(), s.o.CallTimeout)
	defer cancel()
	u := *p.base
	u.Path = strings.TrimSuffix(p.base.Path, "/") + "/" + rest
	u.RawPath = ""
	if esc := strings.TrimPrefix(r.URL.EscapedPath(), "/"+p.Name+"/"); esc != rest {
		u.RawPath = strings.TrimSuffix(p.base.EscapedPath(), "/") + "/" + esc
	}
	u.RawQuery = r.URL.RawQuery
	req, err := http.NewRequestWithContext(ctx, r.Method, u.String(), bytes.NewReader(in.Body))
	if err != nil {
		writeError(w, p.API, http.StatusBadRequest, "", "the request cannot be forwarded", 0)
		return
	}
	req.ContentLength = int64(len(in.Body))
	for _, h := range forwardedHeaders {
		if v := r.Header.Values(h); len(v) > 0 {
			req.Header[h] = v
		}
	}
	req.Header.Set("Accept-Encoding", "identity")
	switch {
	case p.API == config.APIAnthropic:
		if req.Header.Get("Anthropic-Version") == "" {
			req.Header.Set("Anthropic-Version", "2023-06-01")
		}
		if key != "" {
			req.Header.Set("X-Api-Key", key)
		}
	case key != "":
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := s.transport.RoundTrip(req)
	if err != nil {
		s.failed(w, r, p, err)
		return
	}
	defer resp.Body.Close()
	ev.Status = resp.StatusCode
	for _, h := range relayedHeaders {
		if v := resp.Header.Values(h); len(v) > 0 {
			w.Header()[h] = v
		}
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	m := newMeter(p.API, mt == "text/event-stream")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	// Small: a stream holds its buffer while it waits for the next event
	// (an agent's call can sit for minutes between tokens), and events are
	// a few hundred bytes; 32 KiB made 5,000 idle streams 358 MiB.
	buf := make([]byte, 4<<10)
	first, clientGone := true, false
	var rerr error
	for {
		var n int
		n, rerr = resp.Body.Read(buf)
		if n > 0 {
			if first {
				first = false
				s.m.firstByte.WithLabelValues(p.Name).Observe(time.Since(start).Seconds())
			}
			// Metered as the provider sent it (and charged for it), whether
			// or not the client is still there to take it.
			m.Write(buf[:n])
			if _, werr := w.Write(buf[:n]); werr != nil || rc.Flush() != nil {
				// The client left: cancel (deferred) ends the provider's call.
				clientGone = true
				break
			}
		}
		if rerr != nil {
			break
		}
	}
	if resp.StatusCode/100 == 2 {
		u := m.Result(len(in.Body))
		ev.InputTokens, ev.OutputTokens, ev.CachedTokens, ev.CacheWriteTokens, ev.Estimated = u.Input, u.Output, u.Cached, u.CacheWrite, u.Estimated
		ev.CostMicros = Cost(u, s.o.Prices[in.Model])
	}
	if !clientGone && rerr != io.EOF {
		// The provider's answer broke off (or the call ran out of time):
		// the client must see a broken answer, not a complete one. The
		// deferred end records the call first.
		panic(http.ErrAbortHandler)
	}
}

// failed answers a call the provider did not answer: 504 when it took
// too long to start, 502 when it could not be reached; nothing when the
// client left.
func (s *Server) failed(w http.ResponseWriter, r *http.Request, p provider, err error) {
	if r.Context().Err() != nil {
		return
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		writeError(w, p.API, http.StatusGatewayTimeout, "", fmt.Sprintf("the provider %s did not answer within %s", p.Name, s.o.HeaderTimeout), 0)
		return
	}
	s.o.Log.Warn("provider unreachable", "provider", p.Name, "err", err)
	writeError(w, p.API, http.StatusBadGateway, "", fmt.Sprintf("the provider %s cannot be reached", p.Name), 0)
}

// end records a call once it is over.
func (s *Server) end(call Call, ev *events.UsageEvent, start time.Time) {
	ev.Duration = time.Since(start)
	s.m.calls.WithLabelValues(ev.Provider, ev.Model, codeClass(ev.Status)).Inc()
	if ev.Status/100 == 2 {
		s.m.tokens.WithLabelValues(ev.Provider, ev.Model, "input").Add(float64(ev.InputTokens))
		s.m.tokens.WithLabelValues(ev.Provider, ev.Model, "output").Add(float64(ev.OutputTokens))
		s.m.tokens.WithLabelValues(ev.Provider, ev.Model, "cached").Add(float64(ev.CachedTokens))
		s.m.tokens.WithLabelValues(ev.Provider, ev.Model, "cache_write").Add(float64(ev.CacheWriteTokens))
		paidBy := "organisation"
		if ev.BYOK {
			paidBy = "user"
		}
		s.m.cost.WithLabelValues(ev.Provider, ev.Model, paidBy).Add(float64(ev.CostMicros))
	}
	s.o.Log.Debug("model call", "call", ev.ID, "user", ev.User, "provider", ev.Provider, "model", ev.Model, "status", ev.Status,
		"input", ev.InputTokens, "output", ev.OutputTokens, "cached", ev.CachedTokens, "cache_write", ev.CacheWriteTokens, "estimated", ev.Estimated,
		"cost_micros", ev.CostMicros, "byok", ev.BYOK, "duration", ev.Duration)
	call.End(*ev)
}

func (s *Server) names() string {
	names := make([]string, len(s.o.Providers))
	for i, p := range s.o.Providers {
		names[i] = p.Name
	}
	return strings.Join(names, ", ")
}
