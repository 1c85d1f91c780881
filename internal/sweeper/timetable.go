package sweeper

import (
	"container/heap"
	"sync"
	"time"
)

// timetable is when the leader next looks at each of a set of users: a
// sweep takes the users whose time has come, not every sandbox. Changes
// (the caches' OnChange, on every replica) put users in for now and take
// them out; the leader puts each user it looked at back for the moment
// its decision can next change, and drops one that has left the set (a
// look checks the record). One entry per user, so a standby that never
// takes any holds no more than there are users.
type timetable struct {
	mu sync.Mutex
	h  slots
	at map[string]*slot
}

type slot struct {
	user  string
	at    time.Time
	index int
}

// set puts user in at at, or moves it there if it is in for later: a
// change makes a look come sooner, never later. The leader puts back the
// users it took out, so a change that came meanwhile (it put the user in
// for now) wins over the leader's later time.
func (t *timetable) set(user string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.at[user]; ok {
		if at.Before(s.at) {
			s.at = at
			heap.Fix(&t.h, s.index)
		}
		return
	}
	if t.at == nil {
		t.at = map[string]*slot{}
	}
	s := &slot{user: user, at: at}
	heap.Push(&t.h, s)
	t.at[user] = s
}

// remove takes user out.
func (t *timetable) remove(user string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.at[user]; ok {
		heap.Remove(&t.h, s.index)
		delete(t.at, user)
	}
}

// due takes out and returns the users whose time is now or past, soonest
// first: the caller puts back those it still follows.
func (t *timetable) due(now time.Time) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for t.h.Len() > 0 && !t.h[0].at.After(now) {
		s := heap.Pop(&t.h).(*slot)
		delete(t.at, s.user)
		out = append(out, s.user)
	}
	return out
}

// all takes out and returns every user.
func (t *timetable) all() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.h))
	for _, s := range t.h {
		out = append(out, s.user)
	}
	t.h, t.at = nil, nil
	return out
}

func (t *timetable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.h)
}

// slots is a min-heap by time (container/heap).
type slots []*slot

func (h slots) Len() int           { return len(h) }
func (h slots) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h slots) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *slots) Push(x any) {
	s := x.(*slot)
	s.index = len(*h)
	*h = append(*h, s)
}
func (h *slots) Pop() any {
	old := *h
	s := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return s
}
