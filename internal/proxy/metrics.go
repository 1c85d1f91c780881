package proxy

import (
	"time"

	"github.com/aaas-project/aaas/internal/web"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	requests       *prometheus.CounterVec
	durations      *prometheus.HistogramVec
	upstreamErrors *prometheus.CounterVec
	wakes          *prometheus.CounterVec
	wakeDuration   prometheus.Histogram
	inFlight       prometheus.Gauge
	websockets     prometheus.Gauge
	revoked        prometheus.Counter
	staleRefusals  prometheus.Counter
	// Body bytes by direction, resolved once: they are counted on every
	// request and WebSocket message.
	bytesUp, bytesDown prometheus.Counter
	// The requests counter and duration histogram by source and class,
	// resolved once (index: source, classIndex).
	byClass    [len(sources)][len(classes)]prometheus.Counter
	durByClass [len(sources)][len(classes)]prometheus.Observer
}

var classes = [...]string{"1xx", "2xx", "3xx", "4xx", "5xx"}

// Who decided an answer's status: the tenant's DSH (its own answer,
// passed on: a tenant can answer 500 to every request, which must not
// page the operator), the gateway (the edge refused or failed), or the
// client (it left before the answer; nginx's 499, counted as 4xx).
const (
	sourceTenant = iota
	sourceGateway
	sourceClient
)

var sources = [...]string{"tenant", "gateway", "client"}

// sourceOf is the source of an answer with code; failed says the edge
// answered itself.
func sourceOf(code int, failed bool) int {
	switch {
	case code == web.StatusClientClosed:
		return sourceClient
	case failed:
		return sourceGateway
	}
	return sourceTenant
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_edge_requests_total", Help: "Proxied requests by status class (1xx for WebSockets) and by who decided the status: tenant (DSH's own answer), gateway (the edge's refusal or failure), client (it left: nginx's 499, class 4xx).",
		}, []string{"class", "source"}),
		durations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aaas_edge_request_duration_seconds", Help: "Time to the upstream response headers, by status class and source (as aaas_edge_requests_total).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 14),
		}, []string{"class", "source"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_edge_upstream_errors_total", Help: "Failures talking to DSH, by kind.",
		}, []string{"kind"}),
		wakes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_edge_wakes_total", Help: "Requests that had to wait for a sandbox, by outcome.",
		}, []string{"outcome"}),
		wakeDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "aaas_edge_wake_duration_seconds", Help: "How long requests waited for a sandbox to be Ready.",
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 12),
		}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aaas_edge_in_flight", Help: "Proxied requests and WebSockets open on this edge.",
		}),
		websockets: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aaas_edge_websockets_open", Help: "WebSockets bridged by this edge.",
		}),
		revoked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_edge_revoked_streams_total", Help: "WebSockets and streamed responses ended because their credentials were revoked.",
		}),
		staleRefusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_edge_stale_route_refusals_total", Help: "Requests and WebSockets refused because the sandboxes cache was not confirmed current within ROUTE_MAX_STALENESS.",
		}),
	}
	bytes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "aaas_edge_proxied_bytes_total", Help: "Body bytes proxied, by direction (up: to DSH, down: to browsers).",
	}, []string{"direction"})
	m.bytesUp, m.bytesDown = bytes.WithLabelValues("up"), bytes.WithLabelValues("down")
	for i, src := range sources {
		for j, c := range classes {
			m.byClass[i][j], m.durByClass[i][j] = m.requests.WithLabelValues(c, src), m.durations.WithLabelValues(c, src)
		}
	}
	reg.MustRegister(m.requests, m.durations, m.upstreamErrors, m.wakes, m.wakeDuration, m.inFlight, m.websockets, m.revoked, m.staleRefusals, bytes)
	return m
}

// registerStateAge exposes how long ago the sandboxes cache was last
// confirmed current: what ROUTE_MAX_STALENESS is compared with.
func registerStateAge(reg prometheus.Registerer, current func() time.Time) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "aaas_edge_sandboxes_state_age_seconds", Help: "Seconds since this edge last confirmed its copy of the sandboxes bucket current (ROUTE_MAX_STALENESS bounds it for routing).",
	}, func() float64 { return time.Since(current()).Seconds() }))
}

// classIndex is code's status class in classes (a client that left is
// 4xx; 1xx counts WebSockets).
func classIndex(code int) int {
	switch {
	case code == web.StatusClientClosed:
		return 3
	case code < 200:
		return 0
	case code >= 500:
		return 4
	}
	return code/100 - 1
}

// count records one request answered with code, decided by source.
func (m *metrics) count(code, source int) { m.byClass[source][classIndex(code)].Inc() }

// observe records how long a request took to its response headers.
func (m *metrics) observe(code, source int, d time.Duration) {
	m.durByClass[source][classIndex(code)].Observe(d.Seconds())
}
