package idle_test

import (
	"io/fs"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	aaas "github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/testenv"
)

// TestEveryAlertMetricIsExported reads manifests/monitoring's
// PrometheusRule and scrapes a running edge, lifecycle and sweeper: every
// aaas_ metric an alert names must be there, so no alert watches a metric
// that does not exist. (The nats_ ones come from prometheus-nats-exporter,
// which is not run here.)
func TestEveryAlertMetricIsExported(t *testing.T) {
	w := newStack(t, time.Hour)
	sw := w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("mon", "")
	if r := c.Do(http.MethodGet, "/u/mon/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("request: %d", r.StatusCode)
	}
	b, err := fs.ReadFile(aaas.Manifests, "manifests/monitoring/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rule struct {
		Spec struct {
			Groups []struct {
				Rules []struct{ Alert, Expr string }
			}
		}
	}
	if err := yaml.Unmarshal(b, &rule); err != nil {
		t.Fatal(err)
	}
	procs := []*testenv.Proc{edge.Proc, sw}
	for _, p := range w.Procs {
		if p.Name == "lifecycle" {
			procs = append(procs, p)
		}
	}
	names := regexp.MustCompile(`\baaas_[a-z_]+`)
	checked := 0
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			for _, name := range names.FindAllString(r.Expr, -1) {
				checked++
				found := false
				for _, p := range procs {
					if m, err := p.Metric(name); err == nil && (strings.HasPrefix(m, name+" ") || strings.HasPrefix(m, name+"{")) {
						found = true
					}
				}
				if !found {
					t.Errorf("alert %s uses %s, which no process exports", r.Alert, name)
				}
			}
		}
	}
	if checked < 5 {
		t.Fatalf("only %d metric names found in the rules", checked)
	}
}
