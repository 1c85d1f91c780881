package lifecycle

import (
	"fmt"
	"maps"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A canary takes about its share of sandboxes, the same ones every time,
// and a larger share only adds to a smaller one's.
func TestInCanary(t *testing.T) {
	const n = 10000
	for _, percent := range []int{1, 10, 50, 99} {
		in := 0
		for i := range n {
			key := fmt.Sprintf("user%d", i)
			if inCanary(key, percent) {
				in++
				if !inCanary(key, percent+1) || !inCanary(key, 100) {
					t.Fatalf("%s is in at %d%% but not at %d%%", key, percent, percent+1)
				}
			}
		}
		if got := float64(in) / n * 100; got < float64(percent)*0.8-0.5 || got > float64(percent)*1.2+0.5 {
			t.Errorf("%d%%: %.1f%% of sandboxes in", percent, got)
		}
	}
}

// The revision gauge and the rollouts' counts follow each record's
// changes: a sandbox counts under its profile and revision, moves when it
// is rolled or rolled back (counted then under the revision it left,
// halted), and leaves when deleted; a revision no sandbox is of leaves
// the gauge and the counts.
func TestRevisionsCountAsRecordsChange(t *testing.T) {
	var r revisions
	rec := func(profile, rev, halted string) kv.Entry[state.Sandbox] {
		return kv.Entry[state.Sandbox]{Value: state.Sandbox{Profile: profile, Revision: rev, Halted: halted}}
	}
	none := kv.Entry[state.Sandbox]{}
	r.Observe("ann", none, false, rec("", "", ""), false)                   // signed up, revision not known yet
	r.Observe("ann", rec("", "", ""), true, rec("", "aaaa", ""), false)     // Ready
	r.Observe("bob", none, false, rec("small", "aaaa", ""), false)          // the default, named
	r.Observe("ann", rec("", "aaaa", ""), true, rec("", "bbbb", ""), false) // rolled
	r.Observe("cid", none, false, rec("", "bbbb", ""), false)
	r.Observe("cid", rec("", "bbbb", ""), true, rec("", "bbbb", ""), true) // deleted
	r.Observe("dan", none, false, rec("large", "cccc", ""), false)
	r.Observe("dan", rec("large", "cccc", ""), true, rec("large", "dddd", ""), false)     // rolled
	r.Observe("dan", rec("large", "dddd", ""), true, rec("large", "cccc", "dddd"), false) // rolled back
	r.Observe("eve", none, false, rec("large", "eeee", "ffff"), false)                    // rolled back, then deleted
	r.Observe("eve", rec("large", "eeee", "ffff"), true, rec("large", "eeee", "ffff"), true)
	nameOf := func(p string) string {
		if p == "" {
			return "small"
		}
		return p
	}
	got := r.Rollouts(nameOf)
	want := map[string]state.Rollout{
		"small": {Profile: "small", Sandboxes: map[string]int{"aaaa": 1, "bbbb": 1}},
		"large": {Profile: "large", Sandboxes: map[string]int{"cccc": 1}, Halted: map[string]int{"dddd": 1}},
	}
	if len(got) != len(want) {
		t.Fatalf("rollouts %v, want %v", got, want)
	}
	for name, w := range want {
		if !got[name].Same(w) {
			t.Errorf("%s: %+v, want %+v", name, got[name], w)
		}
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(&r)
	gathered, err := reg.Gather()
	if err != nil || len(gathered) != 1 || len(gathered[0].Metric) != 3 {
		t.Fatalf("gathered %v, %v", gathered, err)
	}
	byRevision := map[string]float64{}
	for _, m := range gathered[0].Metric {
		byRevision[m.Label[0].GetValue()] = m.Gauge.GetValue()
	}
	if wantGauge := map[string]float64{"aaaa": 1, "bbbb": 1, "cccc": 1}; !maps.Equal(byRevision, wantGauge) {
		t.Fatalf("aaas_sandboxes %v, want %v", byRevision, wantGauge)
	}
}
