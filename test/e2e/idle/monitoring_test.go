package idle_test

import (
	"encoding/json"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	aaas "github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// ruleFile is manifests/monitoring's PrometheusRule, as far as the tests
// read it.
type ruleFile struct {
	Spec struct {
		Groups []struct {
			Rules []struct {
				Alert, Expr string
				Annotations map[string]string
			}
		}
	}
}

// rules reads manifests/monitoring's PrometheusRule.
func rules(t *testing.T) ruleFile {
	t.Helper()
	b, err := fs.ReadFile(aaas.Manifests, "manifests/monitoring/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var r ruleFile
	if err := yaml.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestEveryAlertMetricIsExported reads manifests/monitoring's
// PrometheusRule and scrapes a running edge, lifecycle and sweeper: every
// aaas_ metric an alert names must be there, so no alert watches a metric
// that does not exist. The nats_varz_ ones come from
// prometheus-nats-exporter beside each NATS node, which is not run here
// (its module is not served): its collector names a varz metric
// <prefix>_varz_ and the path of the value in /varz's JSON joined by "_"
// (collector.fqName, v0.17.3), so each must be the path of a number in a
// real JetStream server's varz, and the sidecar must run with -varz and
// -prefix=nats.
func TestEveryAlertMetricIsExported(t *testing.T) {
	w := newStack(t, time.Hour)
	sw := w.Sweeper("sw-a", nil)
	edge := w.Edge("edge-a", nil)
	c := testenv.NewClient(t, edge.URL)
	c.Signup("mon", "")
	if r := c.Do(http.MethodGet, "/u/mon/api/files", nil); r.StatusCode != http.StatusOK {
		t.Fatalf("request: %d", r.StatusCode)
	}
	rule := rules(t)
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

	sidecar, err := fs.ReadFile(aaas.Manifests, "manifests/monitoring/nats-exporter.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{`"-varz"`, `"-prefix=nats"`} {
		if !strings.Contains(string(sidecar), flag) {
			t.Errorf("the exporter sidecar runs without %s", flag)
		}
	}
	v, err := natstest.Start(t).Varz(nil)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(v)
	var varz map[string]any
	if err := json.Unmarshal(raw, &varz); err != nil {
		t.Fatal(err)
	}
	numbers := map[string]bool{}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			switch v := v.(type) {
			case map[string]any:
				walk(prefix+k+"_", v)
			case float64:
				numbers[prefix+k] = true
			}
		}
	}
	walk("", varz)
	natsNames := regexp.MustCompile(`\bnats_varz_[a-z_]+`)
	checked = 0
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			for _, name := range natsNames.FindAllString(r.Expr, -1) {
				checked++
				if !numbers[strings.TrimPrefix(name, "nats_varz_")] {
					t.Errorf("alert %s uses %s, which the exporter does not make of a server's varz", r.Alert, name)
				}
			}
		}
	}
	if checked < 2 {
		t.Fatalf("only %d nats_varz_ names found in the rules", checked)
	}
}

// TestEveryAlertHasARunbook: each alert links a section of
// docs/RUNBOOK.md by its anchor (GitHub's: the heading in lower case),
// and says what it is about.
func TestEveryAlertHasARunbook(t *testing.T) {
	rule := rules(t)
	runbook, err := os.ReadFile(filepath.Join(testenv.Root(), "docs", "RUNBOOK.md"))
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, l := range strings.Split(string(runbook), "\n") {
		if h, ok := strings.CutPrefix(l, "### "); ok {
			anchors[strings.ToLower(h)] = true
		}
	}
	const base = "https://github.com/aaas-project/aaas/blob/main/docs/RUNBOOK.md#"
	n := 0
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			n++
			url := r.Annotations["runbook_url"]
			anchor, ok := strings.CutPrefix(url, base)
			switch {
			case !ok:
				t.Errorf("%s: runbook_url %q is not a section of docs/RUNBOOK.md", r.Alert, url)
			case anchor != strings.ToLower(r.Alert) || !anchors[anchor]:
				t.Errorf("%s: runbook_url %q names no section \"### %s\" of docs/RUNBOOK.md", r.Alert, url, r.Alert)
			}
			if r.Annotations["summary"] == "" {
				t.Errorf("%s has no summary", r.Alert)
			}
		}
	}
	if n < 15 {
		t.Fatalf("only %d alerts read", n)
	}
}
