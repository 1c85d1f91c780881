package natsconn_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/natsconn"
)

// Fill reports each stream's bytes against its cap, and a stream that
// does not answer as unavailable, not as absent.
func TestFillReportsBytesCapsAndAvailability(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, time.Minute)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CAPPED", Subjects: []string{"capped"}, MaxBytes: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "sessions"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "k", make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(natsconn.Fill(js, []string{"CAPPED", "MISSING"}, []string{"sessions"}))
	want := func(name, stream string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				if mf.GetName() == name && m.GetLabel()[0].GetValue() == stream {
					return m.GetGauge().GetValue()
				}
			}
		}
		return -1
	}
	if got := want("aaas_nats_stream_max_bytes", "CAPPED"); got != 1<<20 {
		t.Errorf("CAPPED's cap %v", got)
	}
	if got := want("aaas_nats_stream_bytes", "KV_sessions"); got < 1000 {
		t.Errorf("KV_sessions holds %v bytes, want at least 1000", got)
	}
	if got := want("aaas_nats_stream_max_bytes", "KV_sessions"); got != -1 {
		t.Errorf("an uncapped bucket has a cap of %v", got)
	}
	for stream, up := range map[string]float64{"CAPPED": 1, "KV_sessions": 1, "MISSING": 0} {
		if got := want("aaas_nats_stream_available", stream); got != up {
			t.Errorf("%s available %v, want %v", stream, got, up)
		}
	}
	// NATS gone: every stream says so (fillTimeout bounds the scrape).
	s.Shutdown()
	if n := testutil.CollectAndCount(reg, "aaas_nats_stream_available"); n != 3 {
		t.Fatalf("%d availability series with NATS gone, want 3", n)
	}
	if got := want("aaas_nats_stream_available", "CAPPED"); got != 0 {
		t.Errorf("CAPPED available %v with NATS gone", got)
	}
}
