package sweeper

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// The timetable's rules: a user is in once; set moves a look sooner,
// never later; due takes out what has come, soonest first; remove and all
// take users out.
func TestTimetable(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	tests := []struct {
		name string
		do   func(*timetable)
		now  int
		due  []string
		left int
	}{
		{"soonest first, the rest stay", func(tt *timetable) { tt.set("c", at(3)); tt.set("a", at(1)); tt.set("b", at(2)); tt.set("z", at(9)) }, 3, []string{"a", "b", "c"}, 1},
		{"a change makes a look sooner", func(tt *timetable) { tt.set("a", at(9)); tt.set("a", at(1)) }, 1, []string{"a"}, 0},
		{"never later", func(tt *timetable) { tt.set("a", at(1)); tt.set("a", at(9)) }, 1, []string{"a"}, 0},
		{"removed", func(tt *timetable) { tt.set("a", at(1)); tt.set("b", at(1)); tt.remove("a"); tt.remove("nobody") }, 5, []string{"b"}, 0},
		{"nothing has come", func(tt *timetable) { tt.set("a", at(5)) }, 4, nil, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var tt timetable
			tc.do(&tt)
			if got := tt.due(at(tc.now)); !slices.Equal(got, tc.due) {
				t.Fatalf("due %v, want %v", got, tc.due)
			}
			if tt.len() != tc.left {
				t.Fatalf("%d left, want %d", tt.len(), tc.left)
			}
		})
	}
	var tt timetable
	for i := range 100 {
		tt.set(fmt.Sprint(i), at(100-i))
	}
	if all := tt.all(); len(all) != 100 || tt.len() != 0 || len(tt.due(at(1000))) != 0 {
		t.Fatalf("all took %d, left %d", len(all), tt.len())
	}
	tt.set("again", at(1))
	if got := tt.due(at(1)); !slices.Equal(got, []string{"again"}) {
		t.Fatalf("after all: due %v", got)
	}
}
