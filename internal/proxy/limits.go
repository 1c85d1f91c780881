package proxy

import (
	"sync"
	"sync/atomic"
)

// slots caps concurrent requests plus WebSockets per user on this edge.
type slots struct {
	max   int64
	users sync.Map // user -> *atomic.Int64
}

func (s *slots) acquire(user string) bool {
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

func (s *slots) release(user string) {
	if v, ok := s.users.Load(user); ok {
		v.(*atomic.Int64).Add(-1)
	}
}
