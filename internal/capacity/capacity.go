// Package capacity decides who may start a sandbox when the platform is
// capped: MAX_RUNNING_SANDBOXES (sandboxes holding a pod, cluster-wide)
// and MAX_CONCURRENT_STARTS (sandboxes starting at once). A wake beyond
// either waits in the queue bucket; lifecycle's lease holder admits the
// oldest first as places free up (Admit), edges show each waiting user
// their position (Queue), and with IDLE_EVICT the sweeper suspends the
// longest-idle sandboxes to make room (Evict). Every count comes from the
// KV caches, so every replica sees the same numbers.
package capacity

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Limits are the caps; 0 means none.
type Limits struct {
	MaxRunning, MaxStarts int
	// Profiles caps, per profile named, its sandboxes that hold a pod
	// (a profile's max_running); a profile not named has no cap of its
	// own.
	Profiles map[string]int
}

// On reports whether any cap is set: only then do wakes queue.
func (l Limits) On() bool { return l.MaxRunning > 0 || l.MaxStarts > 0 || len(l.Profiles) > 0 }

// Usage is how many managed sandboxes hold a pod (Running), and of those
// how many are starting (Waking) and how many are giving theirs up
// (Suspending: places about to be free); Profiles is Running by profile.
type Usage struct {
	Running, Starting, Stopping int
	Profiles                    map[string]int
}

// add counts a sandbox's contribution to u, n times (-1 takes it back).
// Claims applied by hand (not managed) are not the gateway's to count.
func (u *Usage) add(managed bool, phase state.Phase, profile string, n int) {
	if !managed || !phase.Running() {
		return
	}
	if u.Profiles == nil {
		u.Profiles = map[string]int{}
	}
	u.Profiles[profile] += n
	u.Running += n
	switch phase {
	case state.PhaseWaking:
		u.Starting += n
	case state.PhaseSuspending:
		u.Stopping += n
	}
}

// Tally is the usage of the sandboxes a cache holds, kept as the cache
// changes: each change adds the sandbox it brought and takes back the one
// it replaced (kv.OnReplace), so reading it costs nothing per sandbox
// (a walk of them all took 34 ms at 200k sandboxes, every admission
// round) and it holds no copy of its own of any sandbox. Sums of such
// changes do not depend on their order, as the cache's subscribers may
// be told two changes of one key in either.
type Tally struct {
	// Default is the default profile's name, which a record that names
	// none is of; set before the first change.
	Default string
	mu      sync.Mutex
	u       Usage
}

// Counted is what a Tally reads of one sandbox record.
type Counted struct {
	Managed bool
	Phase   state.Phase
	Profile string
}

// Observe takes in one change of a cache of sandbox records (its
// kv.OnReplace).
func (t *Tally) Observe(_ string, was kv.Entry[state.Sandbox], had bool, e kv.Entry[state.Sandbox], deleted bool) {
	t.Change(Counted{was.Value.Managed, was.Value.Phase, was.Value.Profile}, had, Counted{e.Value.Managed, e.Value.Phase, e.Value.Profile}, !deleted)
}

// Change takes in one change of a sandbox: it replaced was (when had)
// and is now now (when present; else it was deleted).
func (t *Tally) Change(was Counted, had bool, now Counted, present bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if had {
		t.u.add(was.Managed, was.Phase, cmp.Or(was.Profile, t.Default), -1)
	}
	if present {
		t.u.add(now.Managed, now.Phase, cmp.Or(now.Profile, t.Default), 1)
	}
}

// Usage is the usage now (its own copy).
func (t *Tally) Usage() Usage {
	t.mu.Lock()
	defer t.mu.Unlock()
	u := t.u
	u.Profiles = maps.Clone(u.Profiles)
	return u
}

// free is how many more sandboxes may start now under l.
func (l Limits) free(u Usage) int {
	n := -1 // no cap
	if l.MaxRunning > 0 {
		n = max(l.MaxRunning-u.Running, 0)
	}
	if l.MaxStarts > 0 {
		s := max(l.MaxStarts-u.Starting, 0)
		if n < 0 || s < n {
			n = s
		}
	}
	return n
}

// Order is the queue's order, oldest first (ties by name): the order of
// admission and of the positions shown.
func Order(a, b state.Queued) int {
	return cmp.Or(a.Since.Compare(b.Since), cmp.Compare(a.User, b.User))
}

// Admit is who of the queue may start now, under l and with u in use:
// the oldest, as many as there are free places, passing over those whose
// profile (profileOf) is at its own cap: a full profile holds its own
// users back, not the others'.
func Admit(queue []state.Queued, profileOf func(user string) string, u Usage, l Limits) []string {
	free := l.free(u)
	if free < 0 {
		free = len(queue)
	}
	running := maps.Clone(u.Profiles)
	if running == nil {
		running = map[string]int{}
	}
	var out []string
	for _, q := range slices.SortedFunc(slices.Values(queue), Order) {
		if len(out) == free {
			break
		}
		p := profileOf(q.User)
		if c, ok := l.Profiles[p]; ok && running[p] >= c {
			continue
		}
		running[p]++
		out = append(out, q.User)
	}
	return out
}

// Candidate is a Ready sandbox the sweeper could suspend to make room.
type Candidate struct {
	User string
	// Last is when it was last used; Busy says work is in flight on some
	// edge (it is never evicted).
	Last time.Time
	Busy bool
}

// Evict is whom to suspend so that the waiting users can start: the
// longest-idle sandboxes with nothing in flight, one per waiting user
// beyond the free places, less those already being freed (suspends asked
// for this tick or still under way).
func Evict(waiting int, u Usage, l Limits, freeing int, cands []Candidate) []string {
	if l.MaxRunning <= 0 {
		return nil
	}
	need := waiting - max(l.MaxRunning-u.Running, 0) - freeing
	if need <= 0 {
		return nil
	}
	idle := slices.DeleteFunc(slices.Clone(cands), func(c Candidate) bool { return c.Busy })
	slices.SortFunc(idle, func(a, b Candidate) int { return cmp.Or(a.Last.Compare(b.Last), cmp.Compare(a.User, b.User)) })
	var out []string
	for _, c := range idle[:min(need, len(idle))] {
		out = append(out, c.User)
	}
	return out
}

// Queue is the edge's view of the queue: whether and where a user waits.
type Queue struct {
	Cache *kv.Cache[state.Queued]
	// places is every waiting user's place, made once per change of the
	// cache rather than by a walk of the queue per status read.
	places *places
}

// NewQueue is the view of the queue cache c.
func NewQueue(c *kv.Cache[state.Queued]) Queue { return Queue{Cache: c, places: &places{}} }

type places struct {
	mu sync.Mutex
	at uint64 // the cache's Updates when made
	of map[string]int
}

// Position is user's place in the queue (1 is next) and the queue's
// length; 0 when user does not wait.
func (q Queue) Position(user string) (pos, of int) {
	if q.Cache == nil {
		return 0, 0
	}
	if _, ok := q.Cache.Get(user); !ok {
		return 0, 0
	}
	p := q.places
	if p == nil {
		p = &places{}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if at := q.Cache.Updates(); p.of == nil || at != p.at {
		var all []state.Queued
		q.Cache.Range(func(e kv.Entry[state.Queued]) bool {
			all = append(all, e.Value)
			return true
		})
		slices.SortFunc(all, Order)
		p.of, p.at = make(map[string]int, len(all)), at
		for i, w := range all {
			p.of[w.User] = i + 1
		}
	}
	return p.of[user], len(p.of)
}

// Describe is box as a waiting user should see it: while they wait in the
// queue, phase Queued and their position. (Queued is only ever shown, never
// stored: the sandbox itself is still Suspended.)
func (q Queue) Describe(box state.Sandbox) state.Sandbox {
	if box.Phase != state.PhaseSuspended && box.Phase != state.PhaseSuspending {
		return box
	}
	if pos, of := q.Position(box.User); pos > 0 {
		box.Phase = PhaseQueued
		box.Reason = fmt.Sprintf("waiting for a free place: number %d of %d in the queue", pos, of)
	}
	return box
}

// PhaseQueued is the phase shown to a user whose wake waits for a place.
const PhaseQueued state.Phase = "Queued"
