package broker

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the broker's aggregate counters. None has a user label: the
// per-user record is the usage stream and bucket. Model labels are only
// ever configured models (an unknown one is refused before it is
// counted), so their number is bounded by the configuration.
type metrics struct {
	calls     *prometheus.CounterVec
	tokens    *prometheus.CounterVec
	cost      *prometheus.CounterVec
	firstByte *prometheus.HistogramVec
	refused   *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_broker_calls_total", Help: "Model calls forwarded, by provider, model and the provider's status class (none: no answer).",
		}, []string{"provider", "model", "code"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_broker_tokens_total", Help: "Tokens of forwarded calls, by provider, model and kind (input, output, cached, cache_write; cached and cache_write are part of input).",
		}, []string{"provider", "model", "kind"}),
		cost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_broker_cost_micro_usd_total", Help: "Cost of forwarded calls at the configured prices, in micro-USD, by who pays (organisation, or user for their own key).",
		}, []string{"provider", "model", "paid_by"}),
		firstByte: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aaas_broker_first_byte_seconds", Help: "Time from a call's arrival to the first byte of the provider's answer relayed.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}, []string{"provider"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_broker_refused_total", Help: "Calls answered by the broker itself and not forwarded, by reason.",
		}, []string{"reason"}),
	}
	reg.MustRegister(m.calls, m.tokens, m.cost, m.firstByte, m.refused)
	return m
}

// codeClass is a status as a label: 2xx, 4xx, 5xx, or none (no answer).
func codeClass(status int) string {
	switch {
	case status == 0:
		return "none"
	case status < 200 || status > 599:
		return "other"
	}
	return string(rune('0'+status/100)) + "xx"
}
