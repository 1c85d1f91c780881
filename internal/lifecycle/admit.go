package lifecycle

import (
	"context"
	"fmt"
	"time"

	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/capacity"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// admitEvery is how often the lease holder looks at the queue: a place
// freed is taken within it.
const admitEvery = 250 * time.Millisecond

// admitted remembers the sandboxes admit has started, and of which
// profile, until their KV record says so itself (the mirror writes it a
// moment after the patch): meanwhile they count as starting, or one place
// could be given twice.
type admitted map[string]admission

type admission struct {
	at      time.Time
	profile string
}

// admitLag bounds how long an admitted sandbox counts without its record.
const admitLag = 30 * time.Second

// admit starts queued sandboxes, oldest first, as MAX_RUNNING_SANDBOXES
// and MAX_CONCURRENT_STARTS allow, until ctx ends. Only the lease holder
// runs it, so two replicas never give away the same last place; a new
// holder starts from the queue in KV.
func (w *Worker) admit(ctx context.Context) {
	t := time.NewTicker(admitEvery)
	defer t.Stop()
	pending := admitted{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := w.admitOnce(ctx, pending, time.Now()); err != nil && ctx.Err() == nil {
				w.log.Warn("queue not admitted from", "err", err)
			}
		}
	}
}

func (w *Worker) admitOnce(ctx context.Context, pending admitted, now time.Time) error {
	var queue []state.Queued
	var settled []string
	// Each waiting user's entry and sandbox as this round read them: the
	// informer and the cache may move on before the round admits them.
	type waiter struct {
		since   time.Time
		sb      *sandboxv1beta1.Sandbox
		profile string
	}
	waiting := map[string]waiter{}
	w.queueCache.Range(func(e kv.Entry[state.Queued]) bool {
		st := w.k8s.Lookup(e.Value.User)
		if st.Sandbox == nil || st.Sandbox.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeRunning {
			// Running already, or gone: it waits for nothing, and left in
			// the queue it would hold a place in line (and push everyone
			// behind it down) until a place freed. A wake that read the
			// informer just before it saw admission's patch leaves such an
			// entry behind.
			settled = append(settled, e.Value.User)
			return true
		}
		queue = append(queue, e.Value)
		var named string
		if st.Claim != nil {
			named = st.Claim.Annotations[sandbox.ProfileAnnotation]
		}
		waiting[e.Value.User] = waiter{e.Value.Since, st.Sandbox, w.o.Profiles.NameOf(named)}
		return true
	})
	for _, user := range settled {
		if err := w.queue.Purge(ctx, user); err != nil {
			return err
		}
	}
	use := w.usage.Usage()
	for user, a := range pending {
		if b, ok := w.boxCache.Get(user); (ok && b.Value.Phase != state.PhaseSuspended) || now.Sub(a.at) > admitLag {
			delete(pending, user)
			continue
		}
		use.Running++
		use.Starting++
		if use.Profiles == nil {
			use.Profiles = map[string]int{}
		}
		use.Profiles[a.profile]++
	}
	if len(queue) == 0 {
		return nil
	}
	profileOf := func(user string) string { return waiting[user].profile }
	for _, user := range capacity.Admit(queue, profileOf, use, w.o.Limits) {
		wt := waiting[user]
		if _, err := w.start(ctx, user, wt.sb, fmt.Sprintf("after %s in the queue", now.Sub(wt.since).Round(time.Second))); err != nil {
			return fmt.Errorf("start %s: %w", user, err)
		}
		pending[user] = admission{now, wt.profile}
		if err := w.queue.Purge(ctx, user); err != nil {
			return err
		}
	}
	return nil
}
