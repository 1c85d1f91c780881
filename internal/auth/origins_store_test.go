package auth_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A sandbox origin's session lives and dies with its gateway session:
// it neither counts toward MAX_SESSIONS_PER_USER nor is trimmed by it, so
// opening sandbox origins never signs the user out of the gateway.
func TestSandboxSessionsAreNotCountedTowardTheCap(t *testing.T) {
	js := bus(t)
	store := newStore(t, context.Background(), js, 2)
	ctx := natstest.Context(t, time.Minute)
	gw1, err := store.Create(ctx, "bob", "login")
	if err != nil {
		t.Fatal(err)
	}
	sum := sumOf(gw1)
	parent := hex.EncodeToString(sum[:])
	var keys []string
	for range 2 {
		time.Sleep(5 * time.Millisecond) // distinct creation times
		sid, err := store.CreateSandbox(ctx, "bob", "bob.sbx.example", parent, "", time.Now().Add(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, state.SessionKey("bob", ident.HashHex(sid)))
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if store.Len() != 3 {
			return fmt.Errorf("%d sessions cached", store.Len())
		}
		return nil
	})
	if n, _ := store.Count(ctx, "bob"); n["bob"] != 1 {
		t.Fatalf("bob holds %d sessions by the cap's count, want 1 (the gateway session)", n["bob"])
	}
	time.Sleep(5 * time.Millisecond)
	if _, err := store.Create(ctx, "bob", "login"); err != nil {
		t.Fatal(err)
	}
	// Create trims before it returns: nothing of bob's was over the cap.
	sessions, err := kv.Open[state.Session](ctx, js, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range append(keys, state.SessionKey("bob", parent)) {
		if _, err := sessions.Get(ctx, k); errors.Is(err, kv.ErrNotFound) {
			t.Fatalf("session %s was trimmed", k)
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if n, _ := store.Count(ctx, "bob"); n["bob"] != 2 {
		t.Fatalf("bob holds %d sessions by the cap's count, want 2", n["bob"])
	}
}
