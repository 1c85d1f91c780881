// Package idle is the one rule for when a sandbox sleeps. Activity that
// keeps a sandbox awake is a request in flight, browser input (requests,
// and WebSocket frames from the browser) and the agent's own work (a
// broker's model call in flight); a stream that only stays open (a
// forgotten tab) counts for IDLE_CONNECTED_TIMEOUT after its last input,
// and then not at all. A sandbox nobody has been active on for
// IDLE_TIMEOUT, and with nothing in flight, is due; one awake for
// MAX_RUNTIME is due even if busy; a user's keep-awake holds either off
// until it ends. The sweeper decides by Policy.Decide, lifecycle's
// compare-and-suspend re-checks by Reason.Forced and state.KeepAwake, and
// the edge shows the same Decision to the user (suspend_at).
package idle

import (
	"fmt"
	"slices"
	"time"
)

// Reason says why a sandbox was (or will be) suspended.
type Reason string

// The reasons.
const (
	// ReasonIdle: nothing in flight and no activity for IDLE_TIMEOUT.
	ReasonIdle Reason = "idle"
	// ReasonIdleConnected: as idle, while a tab was still open on it
	// without input (IDLE_CONNECTED_TIMEOUT).
	ReasonIdleConnected Reason = "idle_connected"
	// ReasonMaxRuntime: awake for MAX_RUNTIME without a keep-awake.
	ReasonMaxRuntime Reason = "max_runtime"
	// ReasonEvicted: the longest idle while wakes waited for a place
	// (IDLE_EVICT).
	ReasonEvicted Reason = "evicted"
	// ReasonAdmin: an administrator suspended it.
	ReasonAdmin Reason = "admin"
	// ReasonUser: its user did.
	ReasonUser Reason = "user"
)

// Reasons lists every reason, for metrics and validation.
var Reasons = []Reason{ReasonIdle, ReasonIdleConnected, ReasonMaxRuntime, ReasonEvicted, ReasonAdmin, ReasonUser}

// Valid reports whether r is one of Reasons.
func (r Reason) Valid() bool { return slices.Contains(Reasons, r) }

// Forced reasons are carried out whatever activity came after the
// decision: a ceiling, or a person who asked.
func (r Reason) Forced() bool {
	return r == ReasonMaxRuntime || r == ReasonAdmin || r == ReasonUser
}

// Inactive reasons are the gateway's own decisions about a sandbox nobody
// was using. A page left open must not undo them: a background request of
// that page (a WebSocket reconnecting, a poll) does not wake such a
// sandbox; the user's navigation does.
func (r Reason) Inactive() bool {
	return r == ReasonIdle || r == ReasonIdleConnected || r == ReasonMaxRuntime || r == ReasonEvicted
}

// Describe is the reason in words, for the user's pages: "because …".
func (r Reason) Describe(p Policy) string {
	switch r {
	case ReasonIdle:
		return "it was idle for " + Words(p.IdleTimeout)
	case ReasonIdleConnected:
		return "a tab was left open with no input and it was then idle for " + Words(p.IdleTimeout)
	case ReasonMaxRuntime:
		return "it had been running for " + Words(p.MaxRuntime) + ", the longest this gateway allows without a keep-awake"
	case ReasonEvicted:
		return "it was idle while other users waited for a place"
	case ReasonAdmin:
		return "an administrator suspended it"
	case ReasonUser:
		return "you suspended it"
	}
	return "of " + string(r)
}

// Ahead is the reason of a suspend to come, in words: "… (Ahead)".
func (r Reason) Ahead(p Policy) string {
	switch r {
	case ReasonIdle:
		return "idle for " + Words(p.IdleTimeout) + " by then"
	case ReasonIdleConnected:
		return "idle for " + Words(p.IdleTimeout) + " by then: an open tab without input does not count"
	case ReasonMaxRuntime:
		return "running for " + Words(p.MaxRuntime) + " by then, the longest allowed without a keep-awake"
	}
	return string(r)
}

// Words is d for people: "15 minutes", "2 hours", "90 seconds".
func Words(d time.Duration) string {
	unit := func(n int64, s string) string {
		if n == 1 {
			return "1 " + s
		}
		return fmt.Sprintf("%d %ss", n, s)
	}
	switch {
	case d >= time.Hour && d%time.Hour == 0:
		return unit(int64(d/time.Hour), "hour")
	case d >= time.Minute && d%time.Minute == 0:
		return unit(int64(d/time.Minute), "minute")
	}
	return unit(int64(d.Round(time.Second)/time.Second), "second")
}

// Policy is the operator's settings of the rule.
type Policy struct {
	// IdleTimeout is IDLE_TIMEOUT.
	IdleTimeout time.Duration
	// MaxRuntime is MAX_RUNTIME (0: no ceiling).
	MaxRuntime time.Duration
	// DormantAfter is DORMANT_AFTER: an account whose sandbox has been
	// asleep this long is dormant (0: never). DormantDeleteAfter is
	// DORMANT_DELETE_AFTER: a dormant account is deleted, volume and all,
	// this much later (0: never).
	DormantAfter, DormantDeleteAfter time.Duration
}

// Dormancy is what the rule says of an account whose sandbox has been
// asleep since asleep (zero: it is not): whether it is dormant, and when
// it will be deleted (zero: never). Waking the sandbox ends it.
func (p Policy) Dormancy(asleep, now time.Time) (dormant bool, deleteAt time.Time) {
	if p.DormantAfter <= 0 || asleep.IsZero() {
		return false, time.Time{}
	}
	if p.DormantDeleteAfter > 0 {
		deleteAt = asleep.Add(p.DormantAfter + p.DormantDeleteAfter)
	}
	return now.Sub(asleep) >= p.DormantAfter, deleteAt
}

// Sandbox is what the rule needs of a Ready sandbox besides its clock.
type Sandbox struct {
	// ReadySince is when it last became Ready: its clock's floor, and
	// where MAX_RUNTIME counts from.
	ReadySince time.Time
	// KeepAwakeUntil is the user's keep-awake (zero: none).
	KeepAwakeUntil time.Time
}

// Decision is the rule's answer for one sandbox at a moment.
type Decision struct {
	// SuspendAt is when the sandbox falls due if nothing changes; zero
	// while it is busy and no ceiling applies.
	SuspendAt time.Time
	// Reason is why it would be suspended then.
	Reason Reason
	// Due: SuspendAt has come.
	Due bool
	// Busy: work is in flight.
	Busy bool
	// Last is the clock: the last activity, or ReadySince if later.
	Last time.Time
}

// Decide applies the rule to v, a Ready sandbox's clock, at now.
func (p Policy) Decide(v View, s Sandbox, now time.Time) Decision {
	d := Decision{Busy: v.Busy, Last: v.Last}
	if s.ReadySince.After(d.Last) {
		d.Last = s.ReadySince
	}
	if !v.Busy {
		d.SuspendAt, d.Reason = later(d.Last.Add(p.IdleTimeout), s.KeepAwakeUntil), ReasonIdle
		if v.IdleStreams > 0 {
			d.Reason = ReasonIdleConnected
		}
	}
	if p.MaxRuntime > 0 && !s.ReadySince.IsZero() {
		if at := later(s.ReadySince.Add(p.MaxRuntime), s.KeepAwakeUntil); d.SuspendAt.IsZero() || at.Before(d.SuspendAt) {
			d.SuspendAt, d.Reason = at, ReasonMaxRuntime
		}
	}
	d.Due = !d.SuspendAt.IsZero() && !now.Before(d.SuspendAt)
	return d
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
