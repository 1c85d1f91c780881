package proxy

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests       *prometheus.CounterVec
	duration       *prometheus.HistogramVec
	upstreamErrors *prometheus.CounterVec
	wakes          *prometheus.CounterVec
	wakeDuration   prometheus.Histogram
	inFlight       prometheus.Gauge
	websockets     prometheus.Gauge
	revoked        prometheus.Counter
	// Body bytes by direction, resolved once: they are counted on every
	// request and WebSocket message.
	bytesUp, bytesDown prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_edge_requests_total", Help: "Proxied requests by status class (1xx for WebSockets, 499 for clients that left).",
		}, []string{"class"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aaas_edge_request_duration_seconds", Help: "Time to the upstream response headers, by status class.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 14),
		}, []string{"class"}),
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
	}
	bytes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "aaas_edge_proxied_bytes_total", Help: "Body bytes proxied, by direction (up: to DSH, down: to browsers).",
	}, []string{"direction"})
	m.bytesUp, m.bytesDown = bytes.WithLabelValues("up"), bytes.WithLabelValues("down")
	reg.MustRegister(m.requests, m.duration, m.upstreamErrors, m.wakes, m.wakeDuration, m.inFlight, m.websockets, m.revoked, bytes)
	return m
}

func class(code int) string {
	switch {
	case code == 499:
		return "499"
	case code < 200:
		return "1xx"
	case code < 300:
		return "2xx"
	case code < 400:
		return "3xx"
	case code < 500:
		return "4xx"
	}
	return "5xx"
}
