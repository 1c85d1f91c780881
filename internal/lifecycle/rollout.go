package lifecycle

import (
	"context"
	"errors"
	"hash/fnv"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// rollForward gives a sleeping sandbox its profile's current pod template
// before it wakes, when ROLLOUT is next-wake and the sandbox is in the
// canary (ROLLOUT_PERCENT): its next pod runs the new image on the same
// volume. A running sandbox is never touched; it takes the new template
// at a wake after it sleeps. The write holds only for the version of the
// Sandbox the cache had, so one woken or rolled meanwhile makes the wake
// fail and be redelivered, to decide afresh.
func (w *Worker) rollForward(ctx context.Context, key string, sb *sandboxv1beta1.Sandbox) error {
	if w.o.Rollout != "next-wake" || sb.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeRunning {
		return nil
	}
	if in, err := w.inRollout(ctx, key); err != nil || !in {
		return err
	}
	st := w.k8s.Lookup(key)
	if st.Claim == nil {
		return nil
	}
	profile := w.o.Profiles.Kept(st.Claim.Annotations[sandbox.ProfileAnnotation])
	t, rev, err := w.k8s.Template(ctx, profile.WarmPool)
	if err != nil {
		return w.kubeFail(ctx, "get template", err)
	}
	// The cache may lag a suspend of a moment ago: the decision is on the
	// Sandbox as the API server has it.
	live, err := w.k8s.GetSandbox(ctx, sb.Name)
	if err != nil {
		return w.kubeFail(ctx, "get sandbox", err)
	}
	cur := sandbox.Revision(live)
	if rev == cur || live.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeRunning {
		return nil
	}
	if w.k8s.Halted(rev) {
		// A pod of rev failed some sandbox it was rolled to: no more.
		w.m.rollouts.WithLabelValues("halted").Inc()
		return nil
	}
	detail := "sandbox " + live.Name + ", profile " + profile.Name + ": revision " + cur + " -> " + rev
	switch err := w.k8s.Roll(ctx, live, t); {
	case apierrors.IsInvalid(err):
		// Woken meanwhile (the patch holds only while it sleeps): nothing
		// to roll. Else the new template cannot be applied to this
		// sandbox: it wakes as it was, and the operator reads why.
		if now, gerr := w.k8s.GetSandbox(ctx, live.Name); gerr == nil && now.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeRunning {
			return nil
		}
		w.m.rollouts.WithLabelValues("failed").Inc()
		w.audit(ctx, events.AuditEvent{Kind: events.AuditRollout, User: key, Outcome: "failed", Detail: clip(detail + ": " + err.Error())})
		return nil
	case err != nil:
		return w.kubeFail(ctx, "roll sandbox", err)
	}
	w.m.rollouts.WithLabelValues("rolled").Inc()
	w.audit(ctx, events.AuditEvent{Kind: events.AuditRollout, User: key, Outcome: "rolled", Detail: detail})
	return nil
}

// rollBack rolls back a sandbox whose pod of the revision it was rolled
// to has failed (why: ended, or failing as sandbox.PodFailing says)
// within ROLLOUT_PROBATION of the rollout: its previous pod template goes
// back (the pod recover then deletes is remade of it, on the same
// volume), and the revision is halted for every sandbox (sandbox.Halted).
// It reports whether it rolled back.
func (m *mirror) rollBack(ctx context.Context, key string, sb *sandboxv1beta1.Sandbox, why string) (bool, error) {
	w := m.w
	at, rolled := sandbox.RolledAt(sb)
	if !rolled || time.Since(at) > w.o.RolloutProbation || m.unrolled[key] == sb.ResourceVersion {
		return false, nil
	}
	rev, back := sandbox.Revision(sb), sb.Annotations[sandbox.PreviousRevisionAnnotation]
	if _, err := w.k8s.Unroll(ctx, sb); err != nil {
		return false, w.kubeErr("roll back", err)
	}
	m.unrolled[key] = sb.ResourceVersion
	w.m.rollouts.WithLabelValues("rolled_back").Inc()
	w.log.Warn("rollout halted: a pod of the new revision failed", "user", key, "sandbox", sb.Name, "revision", rev, "back_to", back, "why", why)
	w.pub.Audit(events.AuditEvent{Kind: events.AuditRollout, User: key, Outcome: "rolled_back",
		Detail: clip("sandbox " + sb.Name + ": revision " + rev + " halted, back to " + back + ": its pod failed " + time.Since(at).Round(time.Second).String() + " after the rollout (" + why + ")")})
	return true, nil
}

// inRollout reports whether the sandbox of key is among those a rollout
// reaches: in ROLLOUT_PERCENT's share, or its owner in one of
// ROLLOUT_GROUPS as an edge last saw them sign in.
func (w *Worker) inRollout(ctx context.Context, key string) (bool, error) {
	if inCanary(key, w.o.RolloutPercent) {
		return true, nil
	}
	if w.userGroups == nil {
		return false, nil
	}
	g, err := w.userGroups.Get(ctx, ident.OwnerOf(key))
	switch {
	case errors.Is(err, kv.ErrNotFound):
		return false, nil
	case err != nil:
		return false, err
	}
	return slices.ContainsFunc(g.Value.Groups, func(n string) bool { return slices.Contains(w.o.RolloutGroups, n) }), nil
}

// inCanary reports whether the sandbox of key is among the percent of
// sandboxes a rollout reaches: by a hash of its key, so the same
// sandboxes are in at every wake, on every replica, and raising the
// percentage only adds to them.
func inCanary(key string, percent int) bool {
	if percent >= 100 {
		return true
	}
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32()%100) < percent
}

// revisionsDesc is aaas_sandboxes: how far a rollout has come.
var revisionsDesc = prometheus.NewDesc("aaas_sandboxes", "Sandboxes by the SandboxTemplate revision their pod template is of (\"\": not known yet).", []string{"revision"}, nil)

// revisions counts the sandboxes of each profile and revision, and those
// rolled back from each revision, as their records change (kv.OnReplace
// on the sandboxes cache): a scrape, or a report of the rollouts, reads
// the counts, never the records, at any number of sandboxes.
type revisions struct {
	mu sync.Mutex
	// n counts by revision, halted by the revision rolled back from;
	// the profile is the record's ("": the default).
	n, halted map[revisionOf]int
}

type revisionOf struct{ profile, revision string }

// Observe takes in one change of a sandbox record.
func (r *revisions) Observe(_ string, was kv.Entry[state.Sandbox], had bool, e kv.Entry[state.Sandbox], deleted bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n, r.halted = map[revisionOf]int{}, map[revisionOf]int{}
	}
	if had {
		count(r.n, revisionOf{was.Value.Profile, was.Value.Revision}, -1)
		if was.Value.Halted != "" {
			count(r.halted, revisionOf{was.Value.Profile, was.Value.Halted}, -1)
		}
	}
	if !deleted {
		count(r.n, revisionOf{e.Value.Profile, e.Value.Revision}, 1)
		if e.Value.Halted != "" {
			count(r.halted, revisionOf{e.Value.Profile, e.Value.Halted}, 1)
		}
	}
}

// count adds d to m[k]; a key counted down to nothing leaves m (a
// revision no sandbox is of any more leaves the gauge and the report).
func count(m map[revisionOf]int, k revisionOf, d int) {
	if m[k] += d; m[k] == 0 {
		delete(m, k)
	}
}

// Rollouts are the counts of each profile's sandboxes, by its name
// (nameOf: a record's profile as PROFILES names it).
func (r *revisions) Rollouts(nameOf func(string) string) map[string]state.Rollout {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]state.Rollout{}
	add := func(m map[revisionOf]int, halted bool) {
		for k, v := range m {
			name := nameOf(k.profile)
			ro, ok := out[name]
			if !ok {
				ro = state.Rollout{Profile: name, Sandboxes: map[string]int{}}
			}
			if !halted {
				ro.Sandboxes[k.revision] += v
			} else {
				if ro.Halted == nil {
					ro.Halted = map[string]int{}
				}
				ro.Halted[k.revision] += v
			}
			out[name] = ro
		}
	}
	add(r.n, false)
	add(r.halted, true)
	return out
}

func (*revisions) Describe(ch chan<- *prometheus.Desc) { ch <- revisionsDesc }

func (r *revisions) Collect(ch chan<- prometheus.Metric) {
	r.mu.Lock()
	byRevision := map[string]int{}
	for k, v := range r.n {
		byRevision[k.revision] += v
	}
	r.mu.Unlock()
	for rev, n := range byRevision {
		ch <- prometheus.MustNewConstMetric(revisionsDesc, prometheus.GaugeValue, float64(n), rev)
	}
}

// reportRollouts writes each profile's rollout (state.Rollout) to the
// rollouts bucket, for the admin view, every rolloutReportEvery until ctx
// ends (the end of a term of leadership): a record when what it says has
// changed, and none for a profile PROFILES no longer names.
func (w *Worker) reportRollouts(ctx context.Context) {
	written, pruned := map[string]state.Rollout{}, false
	tick := time.NewTicker(rolloutReportEvery)
	defer tick.Stop()
	for {
		if w.boxCache.IsSynced() {
			err := w.reportRolloutsOnce(ctx, written)
			if err == nil && !pruned {
				err = w.pruneRollouts(ctx)
				pruned = err == nil
			}
			if err != nil && ctx.Err() == nil {
				w.log.Warn("rollout report failed; trying again", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// pruneRollouts removes the records of profiles PROFILES no longer names.
func (w *Worker) pruneRollouts(ctx context.Context) error {
	keys, err := w.rollouts.Keys(ctx, ">")
	if err != nil {
		return err
	}
	for _, k := range keys {
		if _, ok := w.o.Profiles.Find(k); !ok {
			if err := w.rollouts.Purge(ctx, k); err != nil {
				return err
			}
		}
	}
	return nil
}

// rolloutReportEvery is how often the lease holder looks at the counts
// and the templates' revisions: the admin view's rollouts lag by as much.
const rolloutReportEvery = 5 * time.Second

// reportRolloutsOnce writes what differs from written (this term's
// writes, so the first pass of a term writes every profile's).
func (w *Worker) reportRolloutsOnce(ctx context.Context, written map[string]state.Rollout) error {
	counted := w.revs.Rollouts(w.o.Profiles.NameOf)
	for _, p := range w.o.Profiles {
		ro, ok := counted[p.Name]
		if !ok {
			ro = state.Rollout{Profile: p.Name, Sandboxes: map[string]int{}}
		}
		if _, rev, err := w.k8s.Template(ctx, p.WarmPool); err == nil {
			ro.Target = rev
		} else {
			w.log.Debug("rollout report: template not read", "profile", p.Name, "err", err)
		}
		if last, ok := written[p.Name]; ok && last.Same(ro) {
			continue
		}
		ro.At = time.Now().UTC()
		if _, err := w.rollouts.Put(ctx, p.Name, ro); err != nil {
			return err
		}
		written[p.Name] = ro
	}
	return nil
}
