package lifecycle_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// TestNamedSandboxes: with MAX_SANDBOXES_PER_USER=3, an account gets two
// named sandboxes beside its first, each its own claim (dsh-<user>--<name>,
// of the profile asked for) and record; a third is refused, as is a name
// in use and a sandbox of no account, with no claim made. A named
// sandbox's recreate and delete touch it alone (the account's first
// sandbox keeps its claim), and the account's delete takes them all.
func TestNamedSandboxes(t *testing.T) {
	f := twoProfiles(t, map[string]string{"MAX_SANDBOXES_PER_USER": "3"})
	f.lifecycle("lc-a")
	f.signup("ann")
	first := f.claimOf("ann").UID
	listed := func(want ...string) {
		t.Helper()
		u, err := f.users.Get(ctx(t), "ann")
		if err != nil || !slices.Equal(u.Value.Sandboxes, want) {
			t.Fatalf("ann's record lists %q (%v), want %q", u.Value.Sandboxes, err, want)
		}
	}

	if res := f.command(events.NewSandbox("ann--work", "req-work", "large")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("ann--work: %+v", res)
	}
	f.expectProfile("ann--work", "large", "dsh-large")
	if c := f.claimOf("ann--work"); c.Labels[sandbox.UserLabel] != "ann" || c.Annotations[sandbox.TokenHashAnnotation] != "" {
		t.Fatalf("ann--work's claim: labels %v, annotations %v", c.Labels, c.Annotations)
	}
	if res := f.command(events.NewSandbox("ann--play", "req-play", "")); res.Outcome != state.OutcomeCreated {
		t.Fatalf("ann--play: %+v", res)
	}
	f.expectProfile("ann--play", "small", "dsh-pool")
	listed("work", "play")
	work := f.claimOf("ann--work").UID

	// Refusals, each changing nothing: a fourth sandbox, a name in use
	// (its claim is the same one), a sandbox of no account.
	if res := f.command(events.NewSandbox("ann--more", "req-more", "")); res.Outcome != state.OutcomeConflict || !strings.Contains(res.Error, "MAX_SANDBOXES_PER_USER") {
		t.Fatalf("a fourth sandbox: %+v", res)
	}
	if res := f.command(events.NewSandbox("ann--work", "req-work-again", "")); res.Outcome != state.OutcomeConflict {
		t.Fatalf("a name in use: %+v", res)
	}
	if res := f.command(events.NewSandbox("zed--work", "req-zed", "")); res.Outcome != state.OutcomeFailed {
		t.Fatalf("a sandbox of no account: %+v", res)
	}
	for _, c := range f.claims() {
		if c.Name == sandbox.ClaimName("ann--more") || c.Name == sandbox.ClaimName("zed--work") {
			t.Fatalf("claim %s made", c.Name)
		}
	}
	if f.claimOf("ann--work").UID != work {
		t.Fatal("a create of a name in use replaced its claim")
	}
	listed("work", "play")

	// A recreate of ann--work into small: a new claim of small; the
	// account's first sandbox keeps its own.
	if res := f.command(events.NewRecreate("ann--work", "req-work-re", "small")); res.Outcome != state.OutcomeRecreated {
		t.Fatalf("recreate of ann--work: %+v", res)
	}
	f.expectProfile("ann--work", "small", "dsh-pool")
	if f.claimOf("ann--work").UID == work || f.claimOf("ann").UID != first {
		t.Fatal("the recreate kept ann--work's claim, or replaced ann's")
	}
	listed("work", "play")

	// Deleting ann--play: its claim and record go, its place is free; the
	// rest stays.
	if res := f.command(events.NewDelete("ann--play", "req-play-del")); res.Outcome != state.OutcomeDeleted {
		t.Fatalf("delete of ann--play: %+v", res)
	}
	f.goneAll(t, "ann--play")
	listed("work")
	if f.claimOf("ann").UID != first {
		t.Fatal("a named sandbox's delete replaced the account's claim")
	}
	f.waitPhase("ann", state.PhaseReady)

	// The account's delete takes its named sandboxes with it.
	if res := f.command(events.NewDelete("ann", "req-ann-del")); res.Outcome != state.OutcomeDeleted {
		t.Fatalf("delete of ann: %+v", res)
	}
	f.goneAll(t, "ann", "ann--work")
	if _, err := f.users.Get(ctx(t), "ann"); err == nil {
		t.Fatal("ann's record outlived the account")
	}
}

// goneAll waits until no live claim and no record of keys is left.
func (f *fixture) goneAll(t *testing.T, keys ...string) {
	t.Helper()
	testutil.Eventually(t, time.Minute, func() error {
		for _, c := range f.claims() {
			for _, k := range keys {
				if c.Name == sandbox.ClaimName(k) && c.DeletionTimestamp == nil {
					return fmt.Errorf("claim %s still there", c.Name)
				}
			}
		}
		for _, k := range keys {
			if _, err := f.sandboxes.Get(ctx(t), k); err == nil {
				return fmt.Errorf("record of %s still there", k)
			}
		}
		return nil
	})
}
