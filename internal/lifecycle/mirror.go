package lifecycle

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/util/workqueue"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// recreateGrace is how long an account marked as being recreated keeps its
// record without a claim before the mirror treats it as deleted.
const recreateGrace = 30 * time.Minute

// mirror writes what the informers see into the users and sandboxes
// buckets. Every replica's informers feed its queue, but only the replica
// holding the lease drains it, so exactly one writer mirrors at a time.
type mirror struct {
	w     *Worker
	queue workqueue.TypedRateLimitingInterface[string]
	// restarts counts, per user, the ended pods deleted since the sandbox
	// was last Ready, and when the last one was (only Lead's loop touches
	// it).
	restarts map[string]restart
	// unrolled is, per sandbox key, the version of the Sandbox last rolled
	// back, so a cache that has not caught up does not have it rolled
	// back twice (only Lead's loop touches it).
	unrolled map[string]string
}

type restart struct {
	count int
	at    time.Time
}

func newMirror(w *Worker) *mirror {
	return &mirror{w: w, queue: workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()), restarts: map[string]restart{}, unrolled: map[string]string{}}
}

// Restarts of ended pods back off: the first at once, then 10 s, 20 s, …
// up to 5 minutes between them, until the sandbox is Ready again.
const (
	restartBackoff    = 10 * time.Second
	restartBackoffMax = 5 * time.Minute
)

// recover deletes user's ended pod (Failed, evicted) or the failing pod
// of a revision just rolled back, why as it failed, so the controller
// makes a new one on the same volume, no sooner than the backoff allows
// (requeueing the user for then), and returns the record the user should
// see meanwhile: starting again, not failed.
func (m *mirror) recover(ctx context.Context, user string, pod *corev1.Pod, why string, next state.Sandbox) (state.Sandbox, error) {
	r := m.restarts[user]
	wait := time.Duration(0)
	if r.count > 0 {
		wait = min(restartBackoff<<(r.count-1), restartBackoffMax) - time.Since(r.at)
	}
	if wait > 0 {
		m.queue.AddAfter(user, wait)
	} else {
		if err := m.w.k8s.DeletePod(ctx, pod); err != nil {
			return next, m.w.kubeErr("delete pod", err)
		}
		m.restarts[user] = restart{count: r.count + 1, at: time.Now()}
		m.w.m.podRestarts.Inc()
		m.w.log.Info("pod deleted for a new one", "user", user, "pod", pod.Name, "why", why, "restarts", r.count+1)
		m.w.pub.Audit(events.AuditEvent{Kind: events.AuditStateChange, User: user, Outcome: "restarting",
			Detail: "pod " + pod.Name + " " + why})
	}
	next.Phase = state.PhaseWaking
	next.Reason = "restarting: the previous pod " + why
	next.PodName, next.PodUID = "", ""
	return next, nil
}

func (m *mirror) enqueue(user string) { m.queue.Add(user) }

// Lead mirrors until ctx ends: first every user Kubernetes or KV knows,
// then whatever changes. The lease runs it. It returns only once the
// term's admission, pruning and rollout reports have stopped too: the
// lease may start the next term the moment it returns, and two terms
// never run at once, not even in one process.
func (w *Worker) Lead(ctx context.Context) {
	m := w.mirror
	w.m.leading.Set(1)
	defer w.m.leading.Set(0)
	w.log.Info("mirroring kubernetes into kv")
	var term sync.WaitGroup
	defer term.Wait()
	ctx, end := context.WithCancel(ctx)
	defer end() // before the Wait: the mirror may stop first (its queue shut down)
	if w.o.Limits.On() {
		term.Go(func() { w.admit(ctx) })
	}
	term.Go(func() { w.pruner.run(ctx) })
	term.Go(func() { w.reportRollouts(ctx) })
	for _, u := range w.k8s.Users() {
		m.enqueue(u)
	}
	// KV may know users whose claims vanished while no replica mirrored.
	for _, u := range append(w.userCache.Keys(), w.boxCache.Keys()...) {
		m.enqueue(u)
	}
	for ctx.Err() == nil {
		user, shutdown := m.getWithContext(ctx)
		if shutdown {
			return
		}
		if err := m.reconcile(ctx, user); err != nil && ctx.Err() == nil {
			w.log.Warn("mirror failed; retrying", "user", user, "err", err)
			m.queue.AddRateLimited(user)
		} else {
			m.queue.Forget(user)
		}
		m.queue.Done(user)
	}
}

// getWithContext is queue.Get that gives up when ctx ends, without
// shutting the queue down (another term of leadership may follow).
func (m *mirror) getWithContext(ctx context.Context) (string, bool) {
	type item struct {
		key      string
		shutdown bool
	}
	ch := make(chan item, 1)
	go func() {
		k, s := m.queue.Get()
		ch <- item{k, s}
	}()
	select {
	case it := <-ch:
		return it.key, it.shutdown
	case <-ctx.Done():
		// Hand the item we may still receive back to the queue.
		go func() {
			it := <-ch
			if !it.shutdown {
				m.queue.Add(it.key)
				m.queue.Done(it.key)
			}
		}()
		return "", true
	}
}

func (m *mirror) reconcile(ctx context.Context, user string) error {
	w := m.w
	st := w.k8s.Lookup(user)
	if st.Claim == nil {
		return m.claimGone(ctx, user)
	}
	if live, err := m.claimLive(ctx, user, st); err != nil || !live {
		return err
	}
	// A named sandbox has no account record of its own to keep.
	if !named(user) {
		if err := m.syncUser(ctx, user, st); err != nil {
			return err
		}
	}
	prev, _ := w.boxCache.Get(user)
	next := w.k8s.Derive(user, st, prev.Value)
	if podLeft(prev.Value, next, st) {
		// The pod and sandbox informers are separate watches: a suspend's
		// pod can be seen going before the suspend itself, which would
		// read as a restart. The API server says which it was (one read
		// per pod that goes); if it cannot, the caches' view stands until
		// the sandbox informer brings the rest.
		switch live, err := w.k8s.GetSandbox(ctx, st.Sandbox.Name); {
		case err == nil:
			st.Sandbox = live
			next = w.k8s.Derive(user, st, prev.Value)
		case !apierrors.IsNotFound(err):
			w.log.Warn("sandbox unreadable; its pod's going reads as a restart", "user", user, "err", w.kubeErr("get sandbox", err))
		}
	}
	running := next.Managed && st.Sandbox != nil && st.Sandbox.Spec.OperatingMode != sandboxv1beta1.SandboxOperatingModeSuspended
	ended := sandbox.PodEnded(st.Pod)
	// A pod that ends is started again; one that fails while the kubelet
	// keeps it (an image that will not pull, a container that keeps
	// exiting) is left to the kubelet, unless it is a rollout's.
	why := sandbox.PodFailing(st.Pod)
	if ended {
		why = strings.ToLower(string(st.Pod.Status.Phase)) + reason(strings.TrimSpace(st.Pod.Status.Reason+" "+st.Pod.Status.Message))
	}
	switch {
	case running && why != "":
		back, err := m.rollBack(ctx, user, st.Sandbox, why)
		if err != nil {
			return err
		}
		if ended || back {
			if next, err = m.recover(ctx, user, st.Pod, why, next); err != nil {
				return err
			}
		}
	case next.Phase == state.PhaseReady:
		delete(m.restarts, user)
	}
	next = next.Clipped()
	if sameRecord(prev.Value, next) {
		return nil
	}
	rev, err := w.sandboxes.Put(ctx, user, next)
	if err != nil {
		return err
	}
	// The next decision compares against this write, even while the
	// watch has not brought it yet.
	w.boxCache.Note(user, next, rev)
	w.m.mirrorWrites.WithLabelValues(state.BucketSandboxes).Inc()
	if prev.Value.PodUID != "" && prev.Value.PodUID != next.PodUID {
		// The cookie of a pod that is gone can never work again.
		if _, err := w.handshakes.PurgePrefix(ctx, user+"."+prev.Value.PodUID); err != nil {
			return err
		}
	}
	if prev.Value.Phase != next.Phase {
		w.pub.Audit(events.AuditEvent{Kind: events.AuditStateChange, User: user, Outcome: string(next.Phase),
			Detail: string(prev.Value.Phase) + " -> " + string(next.Phase) + reason(next.Reason)})
	}
	return nil
}

// podLeft reports whether next reads as a restart only because the
// cached pod is going or gone while the cached sandbox still runs.
func podLeft(prev, next state.Sandbox, st sandbox.State) bool {
	return next.Phase == state.PhaseWaking && (prev.Phase == state.PhaseReady || prev.Phase == state.PhaseFailed) &&
		st.Sandbox != nil && (st.Pod == nil || st.Pod.DeletionTimestamp != nil)
}

func reason(r string) string {
	if r == "" {
		return ""
	}
	return ": " + r
}

// syncUser keeps the account record in step with its claim, for claims
// created or changed outside a command (a lifecycle crash between creating
// the claim and writing the record, or an operator's edit).
func (m *mirror) syncUser(ctx context.Context, user string, st sandbox.State) error {
	w := m.w
	cur, ok := w.userCache.Get(user)
	hash := st.Claim.Annotations[sandbox.TokenHashAnnotation]
	if ok && cur.Value.ClaimUID == string(st.Claim.UID) && cur.Value.TokenHash == hash {
		return nil
	}
	if ok && !cur.Value.RecreatingSince.IsZero() {
		return nil // the recreate command owns the record until it is done
	}
	// A mutation, not a put: the cache may lag a named sandbox's place
	// taken on the record a moment ago.
	e, err := w.users.Mutate(ctx, user, func(cur state.User, _ bool) (state.User, bool, error) {
		return state.User{Name: user, TokenHash: hash, Claim: st.Claim.Name, ClaimUID: string(st.Claim.UID), Managed: true, Created: st.Claim.CreationTimestamp.UTC(), Sandboxes: cur.Sandboxes}, true, nil
	})
	if err != nil {
		return err
	}
	w.userCache.Note(user, e.Value, e.Revision)
	w.m.mirrorWrites.WithLabelValues(state.BucketUsers).Inc()
	return nil
}

// claimLive reports whether the cached claim may have its records
// written. Where a record is missing, a claim being deleted may not, nor
// one the API server no longer has as cached. A delete command
// purges the records while the informer may still hold the claim, and
// writing them back from it would bring the deleted account back (its
// token working) until the informer caught up. One read per reconcile of
// a user without both records: signups, and deletions.
func (m *mirror) claimLive(ctx context.Context, user string, st sandbox.State) (bool, error) {
	w := m.w
	_, hasUser := w.userCache.Get(user)
	if owner, name, _ := ident.SplitSandboxKey(user); name != "" {
		// A named sandbox's account record is its owner's, which lists it.
		u, ok := w.userCache.Get(owner)
		hasUser = ok && slices.Contains(u.Value.Sandboxes, name)
	}
	_, hasBox := w.boxCache.Get(user)
	switch {
	case hasUser && hasBox:
		return true, nil // updated, a claim being deleted to Deleting
	case st.Claim.DeletionTimestamp != nil:
		return false, nil
	}
	live, err := w.k8s.GetClaim(ctx, user)
	switch {
	case apierrors.IsNotFound(err):
		return false, nil // the informer brings the deletion: claimGone then
	case err != nil:
		return false, w.kubeErr("get claim", err)
	}
	return live.UID == st.Claim.UID && live.DeletionTimestamp == nil, nil
}

// claimGone removes a user whose claim was deleted outside the gateway
// (kubectl delete), with their sessions, unless a recreate is under way.
// The cache may lag a fresh create, so the API server has the last word.
func (m *mirror) claimGone(ctx context.Context, user string) error {
	w := m.w
	u, hasUser := w.userCache.Get(user)
	box, hasBox := w.boxCache.Get(user)
	if !hasUser && !hasBox {
		return nil
	}
	if hasUser && !u.Value.RecreatingSince.IsZero() && time.Since(u.Value.RecreatingSince) < recreateGrace {
		return nil
	}
	// A named sandbox being recreated is Deleting while its old claim goes.
	if named(user) && box.Value.Phase == state.PhaseDeleting && time.Since(box.Value.Updated) < recreateGrace {
		return nil
	}
	claim, err := w.k8s.GetClaim(ctx, user)
	if err == nil && w.k8s.Managed(claim) {
		return errors.New("claim exists but is not in the cache yet")
	}
	if err != nil && !apierrors.IsNotFound(err) {
		return w.kubeErr("get claim", err)
	}
	if owner, name, _ := ident.SplitSandboxKey(user); name != "" {
		if err := w.forgetNamed(ctx, user); err != nil {
			return err
		}
		w.pub.Audit(events.AuditEvent{Kind: events.AuditDelete, User: owner, Outcome: state.OutcomeDeleted, Detail: "sandbox " + name + ": claim removed outside the gateway"})
		return nil
	}
	// The account's named sandboxes go with it.
	if err := w.deleteNamedOf(ctx, user); err != nil {
		return err
	}
	if err := w.forget(ctx, user); err != nil {
		return err
	}
	w.pub.Audit(events.AuditEvent{Kind: events.AuditDelete, User: user, Outcome: state.OutcomeDeleted, Detail: "claim removed outside the gateway"})
	return nil
}

// sameRecord compares records without their timestamps, and what
// LastSuspend points to rather than where: every derivation parses the
// annotation afresh, and a record that never compared equal would be
// rewritten on every reconcile, which its own write enqueues again.
func sameRecord(a, b state.Sandbox) bool {
	if !a.ReadySince.Equal(b.ReadySince) || !sameSuspension(a.LastSuspend, b.LastSuspend) {
		return false
	}
	a.Updated, b.Updated, a.ReadySince, b.ReadySince = time.Time{}, time.Time{}, time.Time{}, time.Time{}
	a.LastSuspend, b.LastSuspend = nil, nil
	return a == b
}

func sameSuspension(a, b *state.Suspension) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.At.Equal(b.At) && a.Reason == b.Reason && a.Detail == b.Detail
}
