package kv_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/bulk"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// LastOf reads the newest entry of every key its filters match, in one
// request: deleted and purged keys are left out, other users' keys are
// not read, a filter matching nothing adds nothing, and more matches than
// one read returns is ErrTooMany, not a short answer.
func TestLastOf(t *testing.T) {
	_, js := setup(t)
	ctx := natstest.Context(t, 30*time.Second)
	sessions := testutil.Open[state.Session](t, js, state.BucketSessions)
	put := func(key, via string) uint64 {
		t.Helper()
		rev, err := sessions.Put(ctx, key, state.Session{User: key[:3], Via: via})
		if err != nil {
			t.Fatal(err)
		}
		return rev
	}
	put("ann.1", "login")
	put("ann.2", "login")
	newest := put("ann.2", "sso") // written again: the newest counts
	put("ann.3", "login")
	put("ann.4", "login")
	put("bob.1", "login")
	put("cat.1", "login")
	e, err := sessions.Get(ctx, "ann.3")
	if err != nil {
		t.Fatal(err)
	}
	if err := sessions.Delete(ctx, "ann.3", e.Revision); err != nil {
		t.Fatal(err)
	}
	if err := sessions.Purge(ctx, "ann.4"); err != nil {
		t.Fatal(err)
	}
	got, err := sessions.LastOf(ctx, "ann.*", "bob.*", "nobody.*")
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, e := range got {
		keys = append(keys, e.Key)
		if e.Key == "ann.2" && (e.Value.Via != "sso" || e.Revision != newest) {
			t.Errorf("ann.2 read as %+v at %d, want the newest (sso, %d)", e.Value, e.Revision, newest)
		}
	}
	slices.Sort(keys)
	if want := []string{"ann.1", "ann.2", "bob.1"}; !slices.Equal(keys, want) {
		t.Fatalf("keys %v, want %v", keys, want)
	}
	if got, err := sessions.LastOf(ctx, "nobody.*"); err != nil || len(got) != 0 {
		t.Fatalf("nothing matching: %v, %v", got, err)
	}

	bw := bulk.New(js)
	for i := range kv.MaxLastOf + 1 {
		bw.Put(fmt.Sprintf("$KV.%s.many.%d", state.BucketSessions, i), []byte(`{"v":1,"user":"many"}`))
	}
	if err := bw.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sessions.LastOf(ctx, "many.*"); !errors.Is(err, kv.ErrTooMany) {
		t.Fatalf("%d matching keys: %v, want ErrTooMany", kv.MaxLastOf+1, err)
	}
}
