package testenv

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
)

// Sweeps follows a sweeper's rounds of decisions from its own metrics
// (aaas_sweeper_tick_seconds: one observation per round, taken when the
// round ends), so a test can bound when a decision had to come by the
// rounds the sweeper actually made, however slowly a loaded machine ran
// them, instead of by a wall-clock window. A restarted process's count
// continues the previous run's.
type Sweeps struct {
	p       *Proc
	mu      sync.Mutex
	samples []sweepSample
	// base is the rounds of earlier runs of the process, run the number
	// of the current one (a new process start time is a new run).
	base, last, run int
	started         string
}

// sweepSample is the count of completed rounds (and their total time)
// read by one scrape sent at sent and answered at got: the count is as of
// an instant between the two.
type sweepSample struct {
	sent, got time.Time
	rounds    int
	// busy is the run's total time in rounds.
	busy float64
	run  int
}

// FollowSweeps scrapes p's metrics every 100ms until the test ends.
func FollowSweeps(t testing.TB, p *Proc) *Sweeps {
	s := &Sweeps{p: p}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			s.scrape()
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

func (s *Sweeps) scrape() {
	sent := time.Now()
	m, err := s.p.Metric("")
	if err != nil {
		return // not running, or not serving yet
	}
	got := time.Now()
	rounds, busy, started := -1, 0.0, ""
	for _, l := range strings.Split(m, "\n") {
		name, v, _ := strings.Cut(l, " ")
		switch name {
		case "aaas_sweeper_tick_seconds_count":
			rounds, _ = strconv.Atoi(v)
		case "aaas_sweeper_tick_seconds_sum":
			busy, _ = strconv.ParseFloat(v, 64)
		case "process_start_time_seconds":
			started = v
		}
	}
	if rounds < 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if started != s.started && s.started != "" {
		s.base += s.last // a new run of the process
		s.run++
	}
	s.started = started
	s.last = rounds
	s.samples = append(s.samples, sweepSample{sent: sent, got: got, rounds: s.base + rounds, busy: busy, run: s.run})
}

// Count is the rounds completed as of the first scrape sent at or after
// at; ok is false until there is one.
func (s *Sweeps) Count(at time.Time) (n int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, x := range s.samples {
		if !x.sent.Before(at) {
			return x.rounds, true
		}
	}
	return 0, false
}

// Reached is when a scrape first saw n rounds completed (the n-th ended
// before it); ok is false until one has.
func (s *Sweeps) Reached(n int) (at time.Time, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, x := range s.samples {
		if x.rounds >= n {
			return x.got, true
		}
	}
	return time.Time{}, false
}

// DecidedBy is the latest time by which a round begun after due had
// ended: a round may be under way at due (it may have judged the clocks
// just before), so it is the second to end after the first scrape from
// due on. ok is false until the scrapes show it.
func (s *Sweeps) DecidedBy(due time.Time) (at time.Time, ok bool) {
	n, ok := s.Count(due)
	if !ok {
		return time.Time{}, false
	}
	return s.Reached(n + 2)
}

// Rounds is the rounds completed so far.
func (s *Sweeps) Rounds() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.samples) == 0 {
		return 0
	}
	return s.samples[len(s.samples)-1].rounds
}

// Longest is an upper bound on the longest round so far: the time spent
// in rounds between two scrapes that saw exactly one end (more than one:
// their total).
func (s *Sweeps) Longest() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	var longest float64
	for i := 1; i < len(s.samples); i++ {
		a, b := s.samples[i-1], s.samples[i]
		if b.rounds > a.rounds && a.run == b.run {
			longest = max(longest, b.busy-a.busy)
		}
	}
	return time.Duration(longest * float64(time.Second))
}

// DecidedOnTime waits for the audited decision to suspend user and checks
// it against the user's idle clock in the activity stream (read when
// called: call it before any newer activity of the user): not before the
// user fell due after idle, and made in a round the deciding sweeper (one
// of sweeps, by INSTANCE_ID) began after that: its second round to end
// from then on, however long a loaded machine made its rounds take. It
// returns how long after due the decision came.
func (s *Stack) DecidedOnTime(user string, idle time.Duration, sweeps map[string]*Sweeps) time.Duration {
	s.t.Helper()
	due := s.Idleness(user).Due(idle)
	var d events.AuditEvent
	testutil.Eventually(s.t, time.Minute, func() error {
		var ok bool
		if d, ok = s.Decision(user); !ok {
			return fmt.Errorf("no decision to suspend %s audited", user)
		}
		return nil
	})
	if d.At.Before(due) {
		s.t.Errorf("%s decided to suspend %s %s before it fell due", d.Source, user, due.Sub(d.At))
		return d.At.Sub(due)
	}
	sw, ok := sweeps[d.Source]
	if !ok {
		s.t.Fatalf("decision by %q, not a sweeper the test follows", d.Source)
	}
	// The stream keeps each edge's newest beacon only: the sweeper may
	// have kept an earlier in-flight one's stamp, later by its stamp lag.
	const keptStamp = time.Second
	var by time.Time
	testutil.Eventually(s.t, time.Minute, func() error {
		if by, ok = sw.DecidedBy(due.Add(keptStamp)); !ok {
			return fmt.Errorf("%s has not made two rounds since %s fell due", d.Source, user)
		}
		return nil
	})
	s.t.Logf("%s decided to suspend %s %s after it fell due (the end of its second round after: %s)",
		d.Source, user, d.At.Sub(due).Round(time.Millisecond), by.Sub(due).Round(time.Millisecond))
	if d.At.After(by) {
		s.t.Errorf("%s decided to suspend %s %s after it fell due, later than the rounds it made meanwhile allow (%s)", d.Source, user, d.At.Sub(due), by.Sub(due))
	}
	return d.At.Sub(due)
}
