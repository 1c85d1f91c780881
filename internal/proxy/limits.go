package proxy

import (
	"sync"
	"sync/atomic"
)

// Slots caps concurrent requests, WebSockets and status streams per user
// on this edge (MAX_IN_FLIGHT_PER_USER). The account endpoints' status
// streams share it with the proxy.
type Slots struct {
	max   int64
	users sync.Map // user -> *atomic.Int64
}

// NewSlots returns a cap of max per user.
func NewSlots(max int) *Slots { return &Slots{max: int64(max)} }

// Acquire takes one of user's slots, if one is free.
func (s *Slots) Acquire(user string) bool {
	v, ok := s.users.Load(user)
	if !ok {
		v, _ = s.users.LoadOrStore(user, new(atomic.Int64))
	}
	n := v.(*atomic.Int64)
	if n.Add(1) > s.max {
		n.Add(-1)
		return false
	}
	return true
}

// Release gives back a slot Acquire took.
func (s *Slots) Release(user string) {
	if v, ok := s.users.Load(user); ok {
		v.(*atomic.Int64).Add(-1)
	}
}
