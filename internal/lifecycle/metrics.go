package lifecycle

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	commands          *prometheus.HistogramVec
	kubeErrors        *prometheus.CounterVec
	handshakeFailures *prometheus.CounterVec
	mirrorWrites      *prometheus.CounterVec
	podRestarts       prometheus.Counter
	deadLettered      prometheus.Counter
	rollouts          *prometheus.CounterVec
	redelivered       *prometheus.CounterVec
	logBytes          prometheus.Histogram
	leading           prometheus.Gauge
	running           *prometheus.GaugeVec
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
		rollouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_lifecycle_rollouts_total", Help: "Sleeping sandboxes given their profile's new pod template as they woke (ROLLOUT=next-wake), by outcome: rolled; failed (the template could not be applied; the sandbox woke as it was); halted (not rolled: its revision failed another sandbox); rolled_back (its pod of the new revision failed within ROLLOUT_PROBATION).",
		}, []string{"outcome"}),
		logBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "aaas_lifecycle_handshake_log_bytes", Help: "Bytes of pod log one handshake read (at most DSH_LOG_LIMIT_BYTES).",
			Buckets: prometheus.ExponentialBuckets(1024, 4, 6),
		}),
		leading: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aaas_lifecycle_mirror_leader", Help: "1 while this replica mirrors Kubernetes into KV.",
		}),
	}
	// A worker that died mid-command shows only as the next one's
	// redelivery: the fault tests find the worker to kill by what it is
	// running, and prove the survivor took the command over.
	m.running = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "aaas_lifecycle_commands_running", Help: "Commands this replica is carrying out now, by verb.",
	}, []string{"verb"})
	m.redelivered = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "aaas_lifecycle_commands_redelivered_total", Help: "Commands taken up again after an earlier delivery ended without an acknowledgement (its worker died or asked for a retry), by verb.",
	}, []string{"verb"})
	// Every outcome is there from the start at 0: an alert on the first
	// rolled_back (AaasRolloutHalted) needs the series before it moves.
	for _, o := range []string{"rolled", "failed", "halted", "rolled_back"} {
		m.rollouts.WithLabelValues(o)
	}
	reg.MustRegister(m.commands, m.kubeErrors, m.handshakeFailures, m.mirrorWrites, m.podRestarts, m.deadLettered, m.rollouts, m.redelivered, m.logBytes, m.leading, m.running)
	return m
}
