package lifecycle

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	commands          *prometheus.HistogramVec
	kubeErrors        *prometheus.CounterVec
	handshakeFailures *prometheus.CounterVec
	mirrorWrites      *prometheus.CounterVec
	podRestarts       prometheus.Counter
	deadLettered      prometheus.Counter
	leading           prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		commands: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aaas_lifecycle_command_duration_seconds", Help: "Time to handle a command, by verb and outcome.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"verb", "outcome"}),
		kubeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_lifecycle_kubernetes_errors_total", Help: "Failed Kubernetes API calls, by operation.",
		}, []string{"op"}),
		handshakeFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_lifecycle_handshake_failures_total", Help: "DSH handshakes that failed, by reason.",
		}, []string{"reason"}),
		mirrorWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_lifecycle_mirror_writes_total", Help: "Writes of Kubernetes state into KV, by bucket.",
		}, []string{"bucket"}),
		podRestarts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_lifecycle_pod_restarts_total", Help: "Ended (failed, evicted) sandbox pods deleted so the controller makes new ones.",
		}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aaas_lifecycle_commands_dead_lettered_total", Help: "Commands given up after COMMAND_MAX_DELIVER deliveries.",
		}),
		leading: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aaas_lifecycle_mirror_leader", Help: "1 while this replica mirrors Kubernetes into KV.",
		}),
	}
	reg.MustRegister(m.commands, m.kubeErrors, m.handshakeFailures, m.mirrorWrites, m.podRestarts, m.deadLettered, m.leading)
	return m
}
