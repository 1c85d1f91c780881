// Package testutil holds the small helpers tests share.
package testutil

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/nats-io/nats.go/jetstream"
)

// Eventually polls cond until it returns nil or timeout passes, then fails
// the test with cond's last error. It is for asserting that a distributed
// effect arrives; it never stands in for a sleep.
func Eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	wait := 5 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not true after %s: %v", timeout, err)
		}
		time.Sleep(wait)
		if wait < 200*time.Millisecond {
			wait *= 2
		}
	}
}

// Buffer is a bytes.Buffer safe for one writer (a process's output, a
// logger) and readers at once.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String is everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Open opens the KV bucket name as a Bucket of T, failing the test when
// it cannot.
func Open[T any](t testing.TB, js jetstream.JetStream, name string) *kv.Bucket[T] {
	t.Helper()
	b, err := kv.Open[T](context.Background(), js, name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
