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

// The revision gauge follows each record's changes: a sandbox counts under
// its revision, moves when it is rolled, and leaves when deleted; a
// revision no sandbox is of leaves the gauge.
func TestRevisionsCountAsRecordsChange(t *testing.T) {
	var r revisions
	rec := func(rev string) kv.Entry[state.Sandbox] {
		return kv.Entry[state.Sandbox]{Value: state.Sandbox{Revision: rev}}
	}
	none := kv.Entry[state.Sandbox]{}
	r.Observe("ann", none, false, rec(""), false)       // signed up, revision not known yet
	r.Observe("ann", rec(""), true, rec("aaaa"), false) // Ready
	r.Observe("bob", none, false, rec("aaaa"), false)
	r.Observe("ann", rec("aaaa"), true, rec("bbbb"), false) // rolled
	r.Observe("cid", none, false, rec("bbbb"), false)
	r.Observe("cid", rec("bbbb"), true, rec("bbbb"), true) // deleted
	want := map[string]int{"aaaa": 1, "bbbb": 1}
	if !maps.Equal(r.n, want) {
		t.Fatalf("counts %v, want %v", r.n, want)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(&r)
	got, err := reg.Gather()
	if err != nil || len(got) != 1 || len(got[0].Metric) != 2 {
		t.Fatalf("gathered %v, %v", got, err)
	}
}
