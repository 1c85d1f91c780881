package broker

import (
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
	"github.com/aaas-project/aaas/internal/ident"
)

// Ledger admits calls (budget, concurrency slot) and records them.
type Ledger interface {
	// Admit returns a *Refusal error when the call must not go ahead.
	// charged is false for a BYOK call (not held to the budget).
	Admit(ctx context.Context, key string, charged bool) (Call, error)
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
	// dialer connects the calls that go on a connection of their own
	// (direct), as transport does its own.
	dialer *net.Dialer
	m      *metrics
	// streams are the event streams answered on detached connections.
	streams streams
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
	s.dialer = &net.Dialer{Timeout: min(o.HeaderTimeout, 30*time.Second), KeepAlive: 30 * time.Second}
	s.transport = &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           s.dialer.DialContext,
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
		ReadBufferSize:     1 << 10,
		WriteBufferSize:    1 << 10,
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
	s.streams.drain(sctx)
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
	c := s.admit(w, r, start)
	if c == nil {
		return
	}
	// A detached stream records its call itself when it ends; any other
	// call here, even one whose answer broke off (forward panics).
	detached := false
	defer func() {
		if !detached {
			s.end(c, start)
		}
	}()
	detached = s.forward(w, r, c, start)
}

// admitted is a call the broker has let through: to whom it goes, with
// which key, what it asks, and its usage record so far.
type admitted struct {
	p    provider
	rest string
	key  string
	in   inspected
	// sent is the forwarded body's length: in.Body itself is let go once
	// sent (see sendOnce), and an estimate of the input needs only this.
	sent int
	call Call
	ev   events.UsageEvent
}

// admit is everything before the provider is called: the call is
// attributed, checked and admitted, or answered here (nil). It is a
// function of its own so that its frame is gone while a stream waits:
// a goroutine's stack shrinks to half only when it uses under a quarter,
// and 5,000 idle streams each kept 16 KiB where 8 KiB do.
func (s *Server) admit(w http.ResponseWriter, r *http.Request, start time.Time) *admitted {
	name, rest, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	p, ok := s.providers[name]
	if !ok {
		s.refuse(w, config.APIOpenAI, &Refusal{Status: http.StatusNotFound, Reason: ReasonProvider,
			Message: fmt.Sprintf("no provider is configured at /%s; call /<provider>/… with one of: %s", truncate(name, 32), s.names())})
		return nil
	}
	if age := time.Since(s.o.Current()); age > s.o.MaxStaleness {
		s.refuse(w, p.API, &Refusal{Status: http.StatusServiceUnavailable, Reason: ReasonStale, RetryAfter: 5 * time.Second,
			Message: "the broker cannot confirm which sandbox calls from this address right now; try again shortly"})
		return nil
	}
	ip, ok := peer(r.RemoteAddr)
	sandbox, reason := "", ReasonUnattributed
	if ok {
		sandbox, reason = s.o.Index.Lookup(ip)
	}
	// The sandbox's key names the sandbox whose agent is at work (its
	// beacons keep that one awake); its owner's account pays, with the
	// owner's keys and budget.
	user := ident.OwnerOf(sandbox)
	if user == "" {
		s.refuse(w, p.API, &Refusal{Status: http.StatusForbidden, Reason: reason, Message: "this address is not a running sandbox: model calls are taken from sandboxes only"})
		return nil
	}
	if r.Method == http.MethodGet && (rest == "models" || rest == "v1/models") {
		writeModels(w, p.Provider)
		return nil
	}
	if ref := s.check(r, rest); ref != nil {
		s.refuse(w, p.API, ref)
		return nil
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
		return nil
	}
	in, ref := inspectRequest(p.Provider, r.Method, rest, r.Header.Get("Content-Type"), body)
	if ref != nil {
		s.refuse(w, p.API, ref)
		return nil
	}
	key, byok := s.o.Keys[p.Name], false
	if s.o.Credentials != nil {
		own, ok, err := s.o.Credentials(r.Context(), user, p.Name)
		if err != nil {
			s.o.Log.Warn("reading a brought key failed", "user", user, "provider", p.Name, "err", err)
			s.refuse(w, p.API, &Refusal{Status: http.StatusServiceUnavailable, Reason: ReasonUnavailable, RetryAfter: 5 * time.Second,
				Message: "the broker cannot read your stored key right now; try again shortly"})
			return nil
		}
		if ok {
			key, byok = own, true
		}
	}
	call, err := s.o.Ledger.Admit(r.Context(), sandbox, !byok)
	if err != nil {
		if !errors.As(err, &ref) {
			s.o.Log.Warn("admitting a call failed", "user", user, "err", err)
			ref = &Refusal{Status: http.StatusServiceUnavailable, Reason: ReasonUnavailable, RetryAfter: 5 * time.Second,
				Message: "the broker cannot check your model budget right now; try again shortly"}
		}
		s.refuse(w, p.API, ref)
		return nil
	}
	return &admitted{p: p, rest: rest, key: key, in: in, call: call,
		ev: events.UsageEvent{V: events.SchemaVersion, ID: call.ID(), User: user, Broker: s.o.Instance,
			Provider: p.Name, Model: in.Model, Stream: in.Stream, BYOK: byok, At: start}}
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
// c's status and tokens, or detaches an event stream (true: the stream
// ends the call). It keeps its own frame small, as admit does: an idle
// stream waits in relay below it.
func (s *Server) forward(w http.ResponseWriter, r *http.Request, c *admitted, start time.Time) (detached bool) {
	// The call's own context: net/http cancels r's when the handler
	// returns, which a detached stream outlives. Until then the client
	// leaving (r's context) ends the call.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), s.o.CallTimeout)
	stop := context.AfterFunc(r.Context(), cancel)
	defer func() {
		if !detached {
			stop()
			cancel()
		}
	}()
	resp := s.roundTrip(ctx, w, r, c)
	if resp == nil {
		return false
	}
	sse := isEventStream(resp)
	if sse && resp.StatusCode/100 == 2 && s.detach(w, r, c, resp, ctx, cancel, stop, start) {
		return true
	}
	defer resp.Body.Close()
	m := s.answer(w, resp, c, sse)
	clientGone, err := s.relay(responseSink{w, http.NewResponseController(w)}, resp.Body, m, c.p.Name, start)
	s.metered(c, m, resp.StatusCode)
	if !clientGone && err != io.EOF {
		// The provider's answer broke off (or the call ran out of time):
		// the client must see a broken answer, not a complete one. The
		// deferred end records the call first.
		panic(http.ErrAbortHandler)
	}
	return false
}

// roundTrip sends c to its provider and returns the answer's head, or
// answers the client itself (nil) when there is none.
func (s *Server) roundTrip(ctx context.Context, w http.ResponseWriter, r *http.Request, c *admitted) *http.Response {
	req, err := s.request(ctx, r, c)
	if err != nil {
		writeError(w, c.p.API, http.StatusBadRequest, "", "the request cannot be forwarded", 0)
		return nil
	}
	var resp *http.Response
	if s.direct(req, c.in.Stream) {
		resp, err = s.roundTripDirect(ctx, req)
	} else {
		resp, err = s.transport.RoundTrip(req)
	}
	if err != nil {
		s.failed(w, r, c.p, err)
		return nil
	}
	c.ev.Status = resp.StatusCode
	return resp
}

// answer sends the client the provider's status and the headers it may
// see, and returns the meter for the body that follows.
func (s *Server) answer(w http.ResponseWriter, resp *http.Response, c *admitted, sse bool) *meter {
	relayHeaders(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	return newMeter(c.p.API, sse)
}

// relayHeaders sets in dst the headers of a provider's answer a client
// may see, and tells a buffering proxy in between (nginx) to pass the
// answer on as it comes.
func relayHeaders(dst, src http.Header) {
	for _, h := range relayedHeaders {
		if v := src.Values(h); len(v) > 0 {
			dst[h] = v
		}
	}
	dst.Set("X-Accel-Buffering", "no")
}

// isEventStream tells an answer that streams events (a streamed
// completion) from a whole one.
func isEventStream(resp *http.Response) bool {
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	return mt == "text/event-stream"
}

// metered fills c's tokens and cost from what the meter read, for an
// answer the provider gave as a success.
func (s *Server) metered(c *admitted, m *meter, status int) {
	if status/100 != 2 {
		return
	}
	u := m.Result(c.sent)
	c.ev.InputTokens, c.ev.OutputTokens, c.ev.CachedTokens, c.ev.CacheWriteTokens, c.ev.Estimated = u.Input, u.Output, u.Cached, u.CacheWrite, u.Estimated
	c.ev.CostMicros = Cost(u, s.o.Prices[c.in.Model])
}

// request is the provider's request for c: its URL under the provider's
// base, only the headers that shape the answer, and the broker's key (or
// the user's own).
func (s *Server) request(ctx context.Context, r *http.Request, c *admitted) (*http.Request, error) {
	p := c.p
	u := *p.base
	u.Path = strings.TrimSuffix(p.base.Path, "/") + "/" + c.rest
	u.RawPath = ""
	if esc := strings.TrimPrefix(r.URL.EscapedPath(), "/"+p.Name+"/"); esc != c.rest {
		u.RawPath = strings.TrimSuffix(p.base.EscapedPath(), "/") + "/" + esc
	}
	u.RawQuery = r.URL.RawQuery
	c.sent = len(c.in.Body)
	var body io.Reader = http.NoBody
	if c.sent > 0 {
		body = &sendOnce{b: c.in.Body}
	}
	req, err := http.NewRequestWithContext(ctx, r.Method, u.String(), body)
	if err != nil {
		return nil, err
	}
	c.in.Body = nil
	req.ContentLength = int64(c.sent)
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
		if c.key != "" {
			req.Header.Set("X-Api-Key", c.key)
		}
	case c.key != "":
		req.Header.Set("Authorization", "Bearer "+c.key)
	}
	return req, nil
}

// sendOnce is a request body that lets go of its bytes as it sends
// them. An agent's request carries its whole conversation (often hundreds
// of KiB) and its answer can stream for minutes; the transport keeps the
// request, and so its body, until the answer ends, and a bytes.Reader
// would keep every byte with it. A call is never sent twice (a POST is not
// retried), so nothing needs them again.
type sendOnce struct{ b []byte }

func (o *sendOnce) Read(p []byte) (int, error) {
	if len(o.b) == 0 {
		o.b = nil
		return 0, io.EOF
	}
	n := copy(p, o.b)
	if o.b = o.b[n:]; len(o.b) == 0 {
		o.b = nil
	}
	return n, nil
}

// sink is where relay writes the answer: net/http's response, or a
// detached stream's connection (framed).
type sink interface {
	io.Writer
	Flush() error
}

type responseSink struct {
	http.ResponseWriter
	rc *http.ResponseController
}

func (r responseSink) Flush() error { return r.rc.Flush() }

// relay copies the provider's answer to the client as it comes, through
// the meter. It returns whether the client left, and the error that ended
// the answer (io.EOF when it was whole).
func (s *Server) relay(w sink, body io.Reader, m *meter, provider string, start time.Time) (clientGone bool, err error) {
	_ = w.Flush()
	// Small: a stream holds its buffer while it waits for the next event
	// (an agent's call can sit for minutes between tokens), and events are
	// a few hundred bytes, each relayed as it comes; 32 KiB made 5,000 idle
	// streams 358 MiB. A whole answer (not an event stream) comes at once
	// and is copied in larger pieces.
	size := 4 << 10
	if m.sse {
		size = 1 << 10
	}
	buf := make([]byte, size)
	first := true
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			if first {
				first = false
				s.m.firstByte.WithLabelValues(provider).Observe(time.Since(start).Seconds())
			}
			// Metered as the provider sent it (and charged for it), whether
			// or not the client is still there to take it.
			m.Write(buf[:n])
			if _, werr := w.Write(buf[:n]); werr != nil || w.Flush() != nil {
				// The client left: the caller's cancel ends the provider's
				// call.
				return true, rerr
			}
		}
		if rerr != nil {
			return false, rerr
		}
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
func (s *Server) end(c *admitted, start time.Time) {
	ev := &c.ev
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
	// The broker's access line: its request id is the call's, the id of
	// its usage event.
	s.o.Log.Info("model call", "request_id", ev.ID, "user", ev.User, "provider", ev.Provider, "model", ev.Model, "status", ev.Status,
		"input", ev.InputTokens, "output", ev.OutputTokens, "cached", ev.CachedTokens, "cache_write", ev.CacheWriteTokens, "estimated", ev.Estimated,
		"cost_micros", ev.CostMicros, "byok", ev.BYOK, "duration_ms", float64(ev.Duration.Microseconds())/1000)
	c.call.End(*ev)
}

func (s *Server) names() string {
	names := make([]string, len(s.o.Providers))
	for i, p := range s.o.Providers {
		names[i] = p.Name
	}
	return strings.Join(names, ", ")
}
