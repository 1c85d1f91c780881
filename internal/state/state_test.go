package state_test

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/jsconfig"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

func TestHandshakeKey(t *testing.T) {
	a, b := state.HandshakeKey("bob", "pod-1", "GW.example:8443"), state.HandshakeKey("bob", "pod-1", "gw.example:8443")
	if a != b || a != "bob.pod-1."+state.HostKey("gw.example:8443") || len(state.HostKey("x")) != 16 {
		t.Fatalf("%q %q", a, b)
	}
}

func TestEnsureBucketsUpdatesOnlyWhatChanged(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 20*time.Second)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	holds := func(c state.BucketsConfig) map[string]bool {
		t.Helper()
		out := map[string]bool{}
		for _, bc := range state.BucketConfigs(c) {
			b, err := js.KeyValue(ctx, bc.Bucket)
			if err != nil {
				t.Fatal(err)
			}
			st, err := b.Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			out[bc.Bucket] = jsconfig.Holds(st.Config(), bc)
		}
		return out
	}
	for name, ok := range holds(state.DefaultBucketsConfig()) {
		if !ok {
			t.Errorf("bucket %s would be updated on every start", name)
		}
	}
	cfg := state.DefaultBucketsConfig()
	cfg.SessionTTL = 2 * time.Hour
	if holds(cfg)[state.BucketSessions] {
		t.Fatal("a changed session TTL is not seen as a change")
	}
	if err := state.EnsureBuckets(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	if !holds(cfg)[state.BucketSessions] {
		t.Fatal("the changed session TTL was not applied")
	}
}

// Every bucket has a byte cap, and all of them together leave room in the
// 6 GiB store of the embedded server for the streams (1.75 GiB).
func TestEveryBucketIsBounded(t *testing.T) {
	var sum int64
	for _, bc := range state.BucketConfigs(state.DefaultBucketsConfig()) {
		if bc.MaxBytes <= 0 {
			t.Errorf("bucket %s has no byte cap", bc.Bucket)
		}
		sum += bc.MaxBytes
	}
	// 2.625 GiB: with the streams' 1.75 GiB, 4.4 of the 6 GiB at most.
	if sum > 2<<30+640<<20 {
		t.Errorf("buckets reserve %d MiB", sum>>20)
	}
}

// A summary is a Sandbox record read for less: each field it reads is the
// record's field of the same JSON name and type, it reads the versions
// (and, the day there are any, the migrations) the record reads, and it
// is never written.
func TestSandboxSummaryReadsTheRecord(t *testing.T) {
	read := reflect.TypeFor[state.SandboxSummaryJSON]()
	sameFields(t, read, reflect.TypeFor[state.Sandbox]())
	last, _ := read.FieldByName("LastSuspend")
	sameFields(t, last.Type.Elem(), reflect.TypeFor[state.Suspension]())
	_, summaryMigrates := any(state.SandboxSummary{}).(kv.Migrating)
	_, recordMigrates := any(state.Sandbox{}).(kv.Migrating)
	if summaryMigrates != recordMigrates || (state.SandboxSummary{}).SchemaVersion() != (state.Sandbox{}).SchemaVersion() {
		t.Fatal("the summary does not read the versions the record reads")
	}
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	full := state.Sandbox{User: "ann", Phase: state.PhaseSuspended, Managed: true, Claim: "dsh-ann", PodName: "p", PodUID: "uid", Address: "10.0.0.1:8080",
		Reason: "idle", ReadySince: at.Add(-time.Hour), LastSuspend: &state.Suspension{At: at, Reason: "idle", Detail: "idle for 15m"}, Updated: at.Add(time.Minute), Profile: "gpu"}
	for _, tc := range []struct {
		name       string
		rec        state.Sandbox
		readySince time.Time
		asleep     time.Time
		profile    string
	}{
		{"suspended by the gateway", full, full.ReadySince, at, "gpu"},
		{"never suspended by it: asleep since its last change", func() state.Sandbox { r := full; r.LastSuspend = nil; return r }(), full.ReadySince, full.Updated, "gpu"},
		{"never ready", func() state.Sandbox { r := full; r.ReadySince = time.Time{}; return r }(), time.Time{}, at, "gpu"},
		{"of no profile (made before profiles)", func() state.Sandbox { r := full; r.Profile = ""; return r }(), full.ReadySince, at, ""},
	} {
		data, err := kv.Encode(tc.rec)
		if err != nil {
			t.Fatal(err)
		}
		var got state.SandboxSummary
		if err := json.Unmarshal(data, &got); err != nil {
			t.Fatal(err)
		}
		if got.Phase != full.Phase || !got.Managed || !got.ReadySince().Equal(tc.readySince) || got.ReadySince().IsZero() != tc.readySince.IsZero() || !got.Asleep().Equal(tc.asleep) || got.Profile() != tc.profile {
			t.Errorf("%s: summary %+v (ready since %s, asleep %s)", tc.name, got, got.ReadySince(), got.Asleep())
		}
	}
	if _, err := kv.Encode(state.SandboxSummary{}); !errors.Is(err, state.ErrSummaryWritten) {
		t.Fatalf("a summary encoded: %v, want ErrSummaryWritten", err)
	}
}

// sameFields fails unless every field of part is a field of whole with
// the same JSON name and type (a struct pointer's struct compared in
// turn).
func sameFields(t *testing.T, part, whole reflect.Type) {
	t.Helper()
	name := func(f reflect.StructField) string { n, _, _ := strings.Cut(f.Tag.Get("json"), ","); return n }
	byName := map[string]reflect.StructField{}
	for i := range whole.NumField() {
		byName[name(whole.Field(i))] = whole.Field(i)
	}
	for i := range part.NumField() {
		f := part.Field(i)
		w, ok := byName[name(f)]
		switch {
		case !ok || name(f) == "":
			t.Errorf("%s.%s: %s has no field %q", part.Name(), f.Name, whole.Name(), name(f))
		case f.Type.Kind() == reflect.Pointer && w.Type.Kind() == reflect.Pointer && f.Type.Elem().Kind() == reflect.Struct:
			// Compared as a pair of its own (LastSuspend's).
		case f.Type != w.Type:
			t.Errorf("%s.%s is %s, the record's %s", part.Name(), f.Name, f.Type, w.Type)
		}
	}
}
