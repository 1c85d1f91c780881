package auth

import (
	"fmt"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// The edge's budget is shared, a client's is its own; clients beyond
// maxFetchClients share one budget until idle ones are forgotten, so a
// crowd of addresses cannot grow the table without bound.
func TestFetchBudget(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	b := newFetchBudget()
	take := func(client string, n int) (got int) {
		for range n {
			if _, ok := b.allow(client, now); ok {
				got++
			}
		}
		return got
	}
	if got := take("a", 100); got != clientBurst {
		t.Fatalf("client a: %d reads at once, want its burst %d", got, clientBurst)
	}
	if got := take("b", 100); got != clientBurst {
		t.Fatalf("client b after a: %d reads, want %d", got, clientBurst)
	}
	if got := take("c", 100); got != fetchBurst-2*clientBurst {
		t.Fatalf("client c: %d reads, want what the edge has left (%d)", got, fetchBurst-2*clientBurst)
	}
	// A refusal by the edge's budget costs the client nothing.
	now = now.Add(time.Second)
	if got := take("c", 100); got != clientBurst {
		t.Fatalf("client c a second later: %d reads, want %d", got, clientBurst)
	}

	// A full table of busy clients (the edge's own budget lifted, so that
	// each can spend all of its own): newcomers share the overflow budget,
	// a second later too, as long as the others are busy; once they are
	// idle (their buckets full again) they are forgotten.
	now = now.Add(time.Hour)
	b = newFetchBudget()
	b.edge = rate.NewLimiter(rate.Inf, 0)
	for i := range maxFetchClients {
		take(fmt.Sprint("busy-", i), clientBurst)
	}
	if got := take("new-1", 100) + take("new-2", 100); got != clientBurst {
		t.Fatalf("two newcomers to a full table: %d reads, want one shared burst of %d", got, clientBurst)
	}
	if len(b.clients) != maxFetchClients+1 {
		t.Fatalf("table holds %d clients, want %d and the overflow", len(b.clients), maxFetchClients)
	}
	now = now.Add(time.Second)
	if got := take("new-3", 100); got != clientRate {
		t.Fatalf("a newcomer a second later, the others still busy: %d reads, want the overflow's refill %d", got, clientRate)
	}
	now = now.Add(time.Hour) // every client idle: its bucket full again
	if got := take("new-4", 100); got != clientBurst {
		t.Fatalf("a newcomer once the idle were forgotten: %d reads, want %d", got, clientBurst)
	}
	if len(b.clients) > 2 {
		t.Fatalf("%d clients kept after they all went idle", len(b.clients))
	}
}

// The miss memory forgets only misses that have faded: a full memory of
// live misses keeps them all (a new one is simply not remembered), so no
// client's cookies can make the edge forget what others' reads found.
func TestMissMemoryKeepsLiveMisses(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	s := &Store{now: func() time.Time { return now }, misses: map[string]time.Time{}}
	s.miss("kept")
	for i := range maxMisses - 1 {
		s.miss(fmt.Sprint("live-", i))
	}
	s.miss("one too many")
	if !s.missed("kept") || s.missed("one too many") || len(s.misses) != maxMisses {
		t.Fatalf("a full memory of live misses: kept=%v newest=%v len=%d", s.missed("kept"), s.missed("one too many"), len(s.misses))
	}
	now = now.Add(missTTL)
	s.miss("after")
	if !s.missed("after") || len(s.misses) != 1 {
		t.Fatalf("faded misses not forgotten: %d remembered", len(s.misses))
	}
}

// A read that found a session earns back what it spent: a client whose
// reads all find sessions is never refused, and one whose reads then
// find nothing is, after its credits and its burst.
func TestFetchBudgetGivesBackWhatFound(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	b := newFetchBudget()
	for i := range 10 * fetchBurst {
		found, ok := b.allow("nat", now)
		if !ok {
			t.Fatalf("read %d of sessions found, from one client at one instant, refused", i)
		}
		found()
	}
	got := 0
	for range 100 {
		if _, ok := b.allow("nat", now); ok {
			got++
		}
	}
	// The first read spent a token and earned the credit every later one
	// spent and earned back: one credit and the burst less one are left.
	if got != clientBurst {
		t.Fatalf("after the found reads, %d misses allowed at once, want %d", got, clientBurst)
	}
}
