package auth_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/bulk"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
)

// An edge's session store starts empty however many sessions exist: at
// 100k sessions (20k accounts, five each) it holds none until one is
// used, then exactly that one, found by the key its cookies name. The
// bucket's own count, the control, says all 100k are there. (The scale
// benchmark, hack/scale, measures the times.)
func TestStoreStartsEmptyAgainst100kSessions(t *testing.T) {
	if testing.Short() {
		t.Skip("fills a bucket with 100k sessions")
	}
	js := bus(t)
	ctx := natstest.Context(t, 5*time.Minute)
	const accounts, each = 20_000, 5
	var last, lastUser string
	bw := bulk.New(js)
	for i := range accounts {
		user := fmt.Sprintf("u%06d", i)
		for range each {
			sid := ident.NewSecret()
			v, _ := json.Marshal(state.Session{User: user, Created: time.Now(), Expires: time.Now().Add(time.Hour), Via: "login"})
			bw.Put("$KV."+state.BucketSessions+"."+state.SessionKey(user, ident.HashHex(sid)), v)
			last, lastUser = sid, user
		}
	}
	if err := bw.Wait(ctx); err != nil {
		t.Fatal(err)
	}

	store := newStore(t, ctx, js, 10)
	if n := store.Len(); n != 0 {
		t.Fatalf("the store started holding %d sessions", n)
	}
	if sess, ok, err := store.Fetch(ctx, "10.0.0.1", lastUser, sumOf(last)); !ok || err != nil || sess.User != lastUser {
		t.Fatalf("the last session: %+v %v %v", sess, ok, err)
	}
	if n := store.Len(); n != 1 {
		t.Fatalf("%d sessions held after one was used", n)
	}

	kvs, err := js.KeyValue(ctx, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	st, err := kvs.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n := st.Values(); n != accounts*each {
		t.Fatalf("the bucket holds %d sessions, want %d", n, accounts*each)
	}
}
