package lifecycle

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A scrape-time gauge whose value cannot be had is absent from the
// scrape, not a stand-in value; once it can be read, it is there.
func TestScrapeGaugeIsAbsentWhileUnknown(t *testing.T) {
	known, value := false, 7.0
	g := scrapeGauge{
		desc: prometheus.NewDesc("aaas_test_backlog", "test", nil, nil),
		read: func() (float64, bool) { return value, known },
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(g)
	if n := testutil.CollectAndCount(g); n != 0 {
		t.Fatalf("%d series while unknown, want none", n)
	}
	known = true
	if err := testutil.GatherAndCompare(reg, strings.NewReader("# HELP aaas_test_backlog test\n# TYPE aaas_test_backlog gauge\naaas_test_backlog 7\n"), "aaas_test_backlog"); err != nil {
		t.Fatal(err)
	}
}
