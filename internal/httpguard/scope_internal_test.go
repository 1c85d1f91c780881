package httpguard

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
)

// A pooled scope serves one request after another: a departure noticed
// for an earlier one (Run reads the generation while that request is in
// flight) ends nothing of the next, and the next's own end still works.
func TestScopeGenerations(t *testing.T) {
	s := newScope(nil, nil)
	first := s.gen
	s.reset(nil, nil) // recycled, serving the next request
	s.endIf(first)
	if s.Err() != nil {
		t.Fatal("a departure seen for the previous request ended the next one")
	}
	s.endIf(s.gen)
	if !errors.Is(s.Err(), context.Canceled) {
		t.Fatalf("its own end: %v", s.Err())
	}
	select {
	case <-s.Done():
	default:
		t.Fatal("Done made after the end is not closed")
	}
}

// The scope is a context: the request id as its value, AfterFunc as
// context.AfterFunc behaves (the first watcher in the scope's own slot,
// more beside it, each stoppable once, each run when the scope ends, and
// one registered after the end run at once), and contexts made from it
// end with it.
func TestScopeContext(t *testing.T) {
	s := newScope(nil, nil)
	s.idLen = copy(s.id[:], "abc-1")
	if got := ident.RequestIDOf(s); got != "abc-1" {
		t.Fatalf("request id %q", got)
	}
	ran := make(chan string, 4)
	stopFirst := s.AfterFunc(func() { ran <- "first" })
	stopSecond := s.AfterFunc(func() { ran <- "second" })
	_ = s.AfterFunc(func() { ran <- "third" })
	if !stopSecond() || stopSecond() {
		t.Fatal("stopping the second watcher: want true once, then false")
	}
	child, cancel := context.WithTimeout(s, time.Minute)
	defer cancel()
	s.end()
	got := map[string]bool{}
	for range 2 {
		select {
		case n := <-ran:
			got[n] = true
		case <-time.After(5 * time.Second):
			t.Fatalf("watchers run: %v", got)
		}
	}
	if !got["first"] || !got["third"] || got["second"] {
		t.Fatalf("watchers run: %v; want first and third", got)
	}
	if stopFirst() {
		t.Fatal("a watcher that ran was stopped")
	}
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a context made from the scope did not end with it")
	}
	_ = s.AfterFunc(func() { ran <- "late" })
	select {
	case n := <-ran:
		if n != "late" {
			t.Fatalf("ran %s", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a watcher registered after the end did not run")
	}
}

// A scope goes back to the pool only when nothing can hold it.
func TestScopeRecyclable(t *testing.T) {
	for _, tt := range []struct {
		name string
		use  func(s *scope)
		want bool
	}{
		{"context never asked for", func(s *scope) {}, true},
		{"context asked for, not detached", func(s *scope) { s.ctxUsed = true; s.end() }, false},
		{"detached and ended in the handler", func(s *scope) { s.ctxUsed, s.detached = true, true; s.end() }, true},
		{"detached, still running (a stream)", func(s *scope) { s.ctxUsed, s.detached = true, true }, false},
		{"its Done taken", func(s *scope) { s.ctxUsed, s.detached = true, true; s.Done(); s.end() }, false},
		{"its line deferred", func(s *scope) { s.deferred = true }, false},
	} {
		s := newScope(nil, nil)
		tt.use(s)
		if got := s.recyclable(); got != tt.want {
			t.Errorf("%s: recyclable %v, want %v", tt.name, got, tt.want)
		}
	}
}
