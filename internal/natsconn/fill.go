package natsconn

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// fillTimeout bounds one scrape's stream lookups: a NATS without quorum
// answers none, and the scrape must still end well within Prometheus's
// timeout.
const fillTimeout = 3 * time.Second

// Fill exports, at each scrape, how full the streams and buckets a
// process uses are and whether each can take writes, as that process
// sees them (it may look up exactly those: natsauth's grants):
// aaas_nats_stream_bytes and aaas_nats_stream_max_bytes (the cap, for a
// stream that has one), and aaas_nats_stream_available (1 when the stream
// answered and has a leader; 0 when it did not answer or has none: NATS
// without quorum for it). A full bucket refuses writes (a full sessions
// bucket refuses every sign-in), so alerts compare the two sizes; every
// replica reports the same stream, so they take the max per stream.
func Fill(js jetstream.JetStream, streams, buckets []string) prometheus.Collector {
	names := append([]string(nil), streams...)
	for _, b := range buckets {
		names = append(names, "KV_"+b)
	}
	return &fill{js: js, names: names,
		bytes:     prometheus.NewDesc("aaas_nats_stream_bytes", "Bytes stored in a JetStream stream (a bucket is KV_<bucket>) this process uses.", []string{"stream"}, nil),
		max:       prometheus.NewDesc("aaas_nats_stream_max_bytes", "The stream's cap in bytes (absent when it has none); at the cap, writes are refused.", []string{"stream"}, nil),
		available: prometheus.NewDesc("aaas_nats_stream_available", "1 when the stream answered this process and has a leader; 0 when it did not answer or has none (no quorum for it).", []string{"stream"}, nil),
	}
}

type fill struct {
	js                    jetstream.JetStream
	names                 []string
	bytes, max, available *prometheus.Desc
}

func (f *fill) Describe(ch chan<- *prometheus.Desc) { ch <- f.bytes; ch <- f.max; ch <- f.available }

func (f *fill) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), fillTimeout)
	defer cancel()
	for _, name := range f.names {
		up := 0.0
		if st, err := f.js.Stream(ctx, name); err == nil {
			info := st.CachedInfo()
			if info.Cluster == nil || info.Cluster.Leader != "" {
				up = 1
			}
			ch <- prometheus.MustNewConstMetric(f.bytes, prometheus.GaugeValue, float64(info.State.Bytes), name)
			if info.Config.MaxBytes > 0 {
				ch <- prometheus.MustNewConstMetric(f.max, prometheus.GaugeValue, float64(info.Config.MaxBytes), name)
			}
		}
		ch <- prometheus.MustNewConstMetric(f.available, prometheus.GaugeValue, up, name)
	}
}
