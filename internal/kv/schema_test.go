package kv_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
)

// note1 is a record as release 1 has it; note2 the same record as
// release 2 does, where "text" became "body": a rename that release 1,
// decoding plainly, would silently drop (and lose on its next write).
type note1 struct {
	Text string `json:"text,omitempty"`
}

func (note1) SchemaVersion() int { return 1 }

type note2 struct {
	Body string `json:"body"`
}

func (note2) SchemaVersion() int { return 2 }

func (note2) Migrate(from int, f map[string]json.RawMessage) error {
	if from != 1 {
		return fmt.Errorf("no migration from %d", from)
	}
	f["body"] = f["text"]
	delete(f, "text")
	return nil
}

// notes is one bucket as the two releases see it, and the raw KV.
func notes(t *testing.T) (*kv.Bucket[note1], *kv.Bucket[note2], jetstream.KeyValue) {
	_, js := setup(t)
	ctx := natstest.Context(t, 10*time.Second)
	raw, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "notes"})
	if err != nil {
		t.Fatal(err)
	}
	return testutil.Open[note1](t, js, "notes"), testutil.Open[note2](t, js, "notes"), raw
}

// Each record carries its version first; a reader migrates an older one
// (one from before versions included) and refuses a newer one, in Get,
// Mutate and a Cache alike, without touching it.
func TestRecordsCarryTheirSchemaVersion(t *testing.T) {
	r1, r2, raw := notes(t)
	ctx := natstest.Context(t, 20*time.Second)

	if _, err := r1.Put(ctx, "a", note1{Text: "hello"}); err != nil {
		t.Fatal(err)
	}
	if _, err := r1.Put(ctx, "empty", note1{}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"a": `{"v":1,"text":"hello"}`, "empty": `{"v":1}`} {
		e, err := raw.Get(ctx, key)
		if err != nil || string(e.Value()) != want {
			t.Fatalf("%s stored as %q (%v), want %s", key, e.Value(), err, want)
		}
	}
	// A record from before versions, as an earlier release wrote it.
	if _, err := raw.Put(ctx, "old", []byte(`{"text":"from before"}`)); err != nil {
		t.Fatal(err)
	}

	// Release 2 reads release 1's records, and older, migrated.
	for key, want := range map[string]string{"a": "hello", "old": "from before"} {
		e, err := r2.Get(ctx, key)
		if err != nil || e.Value.Body != want {
			t.Fatalf("release 2 reads %s as %+v, %v; want body %q", key, e.Value, err, want)
		}
	}

	// Release 2 writes; release 1 refuses what it cannot read.
	rev, err := r2.Put(ctx, "b", note2{Body: "new"})
	if err != nil {
		t.Fatal(err)
	}
	before := kv.NewerRecords()
	if _, err := r1.Get(ctx, "b"); !errors.Is(err, kv.ErrNewerRecord) {
		t.Fatalf("release 1 reading a version 2 record: %v, want ErrNewerRecord", err)
	}
	wrote := false
	if _, err := r1.Mutate(ctx, "b", func(cur note1, ok bool) (note1, bool, error) {
		wrote = true
		return note1{Text: "clobbered"}, true, nil
	}); !errors.Is(err, kv.ErrNewerRecord) || wrote {
		t.Fatalf("release 1 changing a version 2 record: %v (changed: %v)", err, wrote)
	}
	if e, err := raw.Get(ctx, "b"); err != nil || e.Revision() != rev {
		t.Fatalf("the version 2 record was touched: %v", err)
	}

	// A cache of release 1 leaves the newer record out, and holds the rest.
	cache, err := kv.NewCache(ctx, r1, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	<-cache.Synced()
	if e, ok := cache.Get("a"); !ok || e.Value.Text != "hello" {
		t.Fatalf("release 1's cache: a = %+v, %v", e, ok)
	}
	if e, ok := cache.Get("b"); ok {
		t.Fatalf("release 1's cache holds the version 2 record as %+v", e.Value)
	}
	// And one it held goes when release 2 rewrites it.
	if _, err := r2.Put(ctx, "a", note2{Body: "rewritten"}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if e, ok := cache.Get("a"); ok {
			return fmt.Errorf("release 1's cache still holds a as %+v", e.Value)
		}
		return nil
	})
	if n := kv.NewerRecords() - before; n < 4 {
		t.Fatalf("%d refusals counted, want at least Get's, Mutate's and the cache's two", n)
	}
}
