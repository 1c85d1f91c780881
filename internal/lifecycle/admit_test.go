package lifecycle_test

import (
	"errors"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// A queue entry for a sandbox that runs already (a wake that read the
// informer just before admission's patch showed in it) waits for
// nothing: it leaves the queue at once, even with no place free, instead
// of standing in line ahead of the users who do wait.
func TestAQueueEntryForARunningSandboxLeavesTheQueue(t *testing.T) {
	f := setup(t, nil)
	f.Env["MAX_RUNNING_SANDBOXES"] = "1"
	f.lifecycle("lc-a")
	f.signup("ran") // the one place, taken
	queue, err := kv.Open[state.Queued](ctx(t), f.JS, state.BucketQueue)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := queue.Create(ctx(t), "ran", state.Queued{User: "ran", Since: time.Now().UTC()}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if _, err := queue.Get(ctx(t), "ran"); !errors.Is(err, kv.ErrNotFound) {
			return errors.New("ran, running already, still waits in the queue")
		}
		return nil
	})
	// And a wake of a running sandbox does not queue it.
	box, _ := f.boxes.Get("ran")
	f.command(events.NewWake("ran", box.Revision))
	time.Sleep(time.Second) // four rounds of admission
	if _, err := queue.Get(ctx(t), "ran"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("a wake of a running sandbox queued it: %v", err)
	}
}
