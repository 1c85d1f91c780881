package proxy

import (
	"strconv"
	"testing"

	"github.com/aaas-project/aaas/internal/auth"
)

// A change re-checks the exchanges of the users it names, and only
// theirs; a burst naming more users than maxChanged re-checks every
// exchange; an exchange that ended is no longer checked.
func TestChangesNameTheExchangesToCheck(t *testing.T) {
	var l live
	bob1, bob2 := &exchange{id: auth.Identity{User: "bob"}}, &exchange{id: auth.Identity{User: "bob"}}
	ann := &exchange{id: auth.Identity{User: "ann"}}
	for _, x := range []*exchange{bob1, bob2, ann} {
		l.add(x)
	}
	c := NewChanges()
	c.User("bob")
	select {
	case <-c.C:
	default:
		t.Fatal("no signal for a change")
	}
	users, all := c.take()
	if got := l.of(users, all); all || len(got) != 2 || got[0].id.User != "bob" || got[1].id.User != "bob" {
		t.Fatalf("bob's change checks %d exchanges (all %v), want bob's two", len(got), all)
	}
	if users, all := c.take(); len(users) != 0 || all {
		t.Fatalf("a second take: %v %v", users, all)
	}
	for i := range maxChanged + 1 {
		c.User("u" + strconv.Itoa(i))
	}
	users, all = c.take()
	if got := l.of(users, all); !all || len(got) != 3 {
		t.Fatalf("a burst of %d changes checks %d exchanges (all %v), want all three", maxChanged+1, len(got), all)
	}
	l.remove(bob1)
	l.remove(ann)
	if got := l.of(nil, true); len(got) != 1 || got[0] != bob2 {
		t.Fatalf("after two ended: %d exchanges", len(got))
	}
	if len(l.byUser) != 1 {
		t.Fatalf("%d users indexed, want bob alone", len(l.byUser))
	}
}
