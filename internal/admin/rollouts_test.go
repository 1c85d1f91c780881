package admin

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/state"
)

func TestRolloutRows(t *testing.T) {
	for _, tc := range []struct {
		name        string
		ro          state.Rollout
		done, total int
		order       []string // revisions as shown
		halted      map[string]int
	}{
		{"nothing rolled", state.Rollout{Target: "aaaaaaaa", Sandboxes: map[string]int{"aaaaaaaa": 5}}, 5, 5, []string{"aaaaaaaa"}, nil},
		{"half way, the target first", state.Rollout{Target: "bbbbbbbb", Sandboxes: map[string]int{"aaaaaaaa": 7, "bbbbbbbb": 3, "": 1}}, 3, 11, []string{"bbbbbbbb", "aaaaaaaa", ""}, nil},
		{"the target no sandbox is on yet", state.Rollout{Target: "cccccccc", Sandboxes: map[string]int{"aaaaaaaa": 2}}, 0, 2, []string{"aaaaaaaa"}, nil},
		{"halted: its sandboxes are back, counted under the revision left", state.Rollout{Target: "dddddddd", Sandboxes: map[string]int{"aaaaaaaa": 4}, Halted: map[string]int{"dddddddd": 1}},
			0, 4, []string{"dddddddd", "aaaaaaaa"}, map[string]int{"dddddddd": 1}},
		{"a template not read", state.Rollout{Sandboxes: map[string]int{"aaaaaaaa": 1, "bbbbbbbb": 2}}, 0, 3, []string{"bbbbbbbb", "aaaaaaaa"}, nil},
		{"a template not read, a revision not known yet", state.Rollout{Sandboxes: map[string]int{"aaaaaaaa": 1, "": 2}}, 0, 3, []string{"", "aaaaaaaa"}, nil},
		{"a revision of another shape is not shown", state.Rollout{Target: "aaaaaaaa", Sandboxes: map[string]int{"aaaaaaaa": 1, "<b>x</b>": 9}}, 1, 1, []string{"aaaaaaaa"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := rolloutRows(tc.ro)
			var order []string
			halted := map[string]int{}
			for _, r := range got.Revisions {
				order = append(order, r.Revision)
				if r.Halted > 0 {
					halted[r.Revision] = r.Halted
				}
				if r.Target != (r.Revision == tc.ro.Target && tc.ro.Target != "") {
					t.Errorf("%q marked target: %v", r.Revision, r.Target)
				}
			}
			if got.Done != tc.done || got.Total != tc.total || !slices.Equal(order, tc.order) || len(halted) != len(tc.halted) {
				t.Fatalf("%d of %d, revisions %q, halted %v; want %d of %d, %q, %v", got.Done, got.Total, order, halted, tc.done, tc.total, tc.order, tc.halted)
			}
		})
	}
}

// The view and the API show each profile's rollout as lifecycle wrote it,
// in PROFILES order, and no record of a profile PROFILES no longer names;
// to administrators only.
func TestRolloutsAreShown(t *testing.T) {
	s, token, js := fixtureJS(t, 3, Options{})
	a := app(t, s)
	ctx := natstest.Context(t, time.Minute)
	b := testutil.Open[state.Rollout](t, js, state.BucketRollouts)
	for _, ro := range []state.Rollout{
		{Profile: "gpu", Target: "bbbbbbbb", Sandboxes: map[string]int{"aaaaaaaa": 1, "bbbbbbbb": 3}, Halted: map[string]int{"cccccccc": 1}},
		{Profile: "small", Target: "aaaaaaaa", Sandboxes: map[string]int{"aaaaaaaa": 2}},
		{Profile: "gone", Target: "dddddddd", Sandboxes: map[string]int{"dddddddd": 1}},
	} {
		if _, err := b.Put(ctx, ro.Profile, ro); err != nil {
			t.Fatal(err)
		}
	}
	var got struct{ Rollouts []state.Rollout }
	testutil.Eventually(t, 30*time.Second, func() error {
		status, body := get(t, a, "gw.example", "/_/admin/rollouts", token)
		if err := json.Unmarshal([]byte(body), &got); status != http.StatusOK || err != nil {
			return fmt.Errorf("%d %s", status, body)
		}
		if len(got.Rollouts) != 2 {
			return fmt.Errorf("rollouts %+v", got.Rollouts)
		}
		return nil
	})
	if got.Rollouts[0].Profile != "small" || got.Rollouts[1].Profile != "gpu" || got.Rollouts[1].Halted["cccccccc"] != 1 {
		t.Fatalf("rollouts %+v", got.Rollouts)
	}
	status, page := get(t, a, "gw.example", "/_/admin", token)
	row := page[strings.Index(page, `id="rollout-gpu"`):]
	row = row[:strings.Index(row, "</tr>")]
	if status != http.StatusOK || !strings.Contains(row, "3 of 4") || !strings.Contains(row, `id="rollout-gpu-cccccccc"`) || !strings.Contains(row, "1 rolled back, halted") || strings.Contains(page, "rollout-gone") {
		t.Fatalf("the page's gpu rollout: %d %s", status, row)
	}
	if status, _ := get(t, a, "gw.example", "/_/admin/rollouts", ""); status != http.StatusNotFound {
		t.Fatalf("rollouts without a sign-in: %d", status)
	}
}
