package lifecycle

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/notify"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// kubeFail counts a failed Kubernetes call (op) and marks the errors that
// retrying cannot fix. A refusal is one only from an API server that is
// serving: one that has just started answers Forbidden to everything its
// RBAC caches do not hold yet, exactly as for a verb the Role lacks, and
// only its readiness tells the two apart. Taken as final, that passing
// refusal failed a handshake for good right after an API server restart
// (TestAPIServerRestartMidOperation).
func (w *Worker) kubeFail(ctx context.Context, op string, err error) error {
	err = w.kubeErr(op, err)
	switch {
	case apierrors.IsForbidden(err):
		if !w.k8s.Serving(ctx) {
			return err
		}
		return events.Permanent(err)
	case apierrors.IsInvalid(err) || apierrors.IsBadRequest(err):
		return events.Permanent(err)
	}
	return err
}

func sameHash(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// claim creates the user's SandboxClaim. A user record or claim that
// already carries this request's token hash is our own earlier create
// (a redelivery), so it answers created, not conflict.
func (w *Worker) claim(ctx context.Context, c events.Command) (string, error) {
	if owner, name, _ := ident.SplitSandboxKey(c.User); name != "" {
		return w.claimNamed(ctx, c, owner, name)
	}
	hash := c.Claim.TokenHash
	if u, err := w.users.Get(ctx, c.User); err == nil && !sameHash(u.Value.TokenHash, hash) {
		return w.conflict(ctx, c, "account exists")
	} else if err != nil && !errors.Is(err, kv.ErrNotFound) {
		return "", err
	}
	profile, ok := w.o.Profiles.Find(c.Claim.Profile)
	if !ok {
		// The edge that sent it knows a profile this replica does not: a
		// PROFILES change rolling out. Nothing is made.
		return w.refuseProfile(ctx, c, events.AuditClaim, c.Claim.Profile)
	}
	claim, err := w.k8s.CreateClaim(ctx, c.User, hash, profile.Name, profile.WarmPool)
	if apierrors.IsAlreadyExists(err) {
		if claim, err = w.k8s.GetClaim(ctx, c.User); err != nil {
			return "", w.kubeFail(ctx, "get claim", err)
		}
		if !w.k8s.Managed(claim) || !sameHash(claim.Annotations[sandbox.TokenHashAnnotation], hash) {
			return w.conflict(ctx, c, "claim exists")
		}
	} else if err != nil {
		return "", w.kubeFail(ctx, "create claim", err)
	}
	if err := w.recordClaim(ctx, c.User, hash, claim); err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeCreated, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditClaim, User: c.User, Outcome: state.OutcomeCreated, Detail: "SandboxClaim " + claim.Name + ", profile " + profile.Name})
	return state.OutcomeCreated, nil
}

// refuseProfile answers a claim or recreate that names a profile this
// replica's PROFILES does not list: failed, with nothing made.
func (w *Worker) refuseProfile(ctx context.Context, c events.Command, kind events.AuditKind, name string) (string, error) {
	why := fmt.Sprintf("no profile %q (PROFILES lists %s)", name, w.o.Profiles.Names())
	if err := w.answer(ctx, c, state.OutcomeFailed, why); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: kind, User: c.User, Outcome: state.OutcomeFailed, Detail: why})
	return state.OutcomeFailed, nil
}

// recordClaim writes the account and a first sandbox record for a claim
// this gateway owns; the mirror refines the sandbox record from watches.
func (w *Worker) recordClaim(ctx context.Context, user, hash string, claim *extv1beta1.SandboxClaim) error {
	// The account's named sandboxes outlive a recreate of its first.
	if _, err := w.users.Mutate(ctx, user, func(cur state.User, _ bool) (state.User, bool, error) {
		return state.User{
			Name: user, TokenHash: hash, Claim: claim.Name, ClaimUID: string(claim.UID), Managed: true, Created: claim.CreationTimestamp.UTC(), Sandboxes: cur.Sandboxes,
		}, true, nil
	}); err != nil {
		return err
	}
	return w.recordSandbox(ctx, user, claim)
}

func (w *Worker) conflict(ctx context.Context, c events.Command, why string) (string, error) {
	if err := w.answer(ctx, c, state.OutcomeConflict, why); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditClaim, User: c.User, Outcome: state.OutcomeConflict, Detail: why})
	return state.OutcomeConflict, nil
}

// wake sets the sandbox Running, or, when capacity is capped, puts the
// user in the queue the lease holder admits from (admit).
func (w *Worker) wake(ctx context.Context, c events.Command) (string, error) {
	st := w.k8s.Lookup(c.User)
	if st.Sandbox == nil {
		return "skipped", nil // no claim, or still claiming: it will run on its own
	}
	if w.o.Limits.On() {
		if st.Sandbox.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeRunning {
			return "running", nil
		}
		_, err := w.queue.Create(ctx, c.User, state.Queued{User: c.User, Since: time.Now().UTC()})
		if err != nil && !errors.Is(err, kv.ErrExists) {
			return "", err
		}
		return "queued", nil
	}
	return w.start(ctx, c.User, st.Sandbox, "")
}

// start sets a sandbox Running, rolled forward first (rollForward), and
// audits the wake when it was this call that changed the mode: a wake
// that finds it running already (woken by a command before it, which the
// cache may not show yet) reports "running".
func (w *Worker) start(ctx context.Context, user string, sb *sandboxv1beta1.Sandbox, detail string) (string, error) {
	if err := w.rollForward(ctx, user, sb); err != nil {
		return "", err
	}
	woken, err := w.k8s.Resume(ctx, sb.Name)
	if err != nil {
		return "", w.kubeFail(ctx, "wake", err)
	}
	if !woken {
		return "running", nil
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditWake, User: user, Outcome: "woken", Detail: strings.TrimSpace("sandbox " + sb.Name + " " + detail)})
	return "woken", nil
}

// suspend is compare-and-suspend: unless its reason is forced (a ceiling,
// an administrator, the user: idle.Reason.Forced) it refuses when the
// user has any activity newer than the sweeper saw or a keep-awake that
// still holds, the same rule the sweeper decided by (idle). It only ever
// sees claims with the managed-by label (the claim informer selects on
// it). Why it suspended goes on the Sandbox with the suspend itself.
func (w *Worker) suspend(ctx context.Context, c events.Command) (string, error) {
	st := w.k8s.Lookup(c.User)
	if st.Claim == nil || !w.k8s.Managed(st.Claim) || st.Sandbox == nil {
		return "skipped", nil
	}
	reason := suspendReason(c.Suspend)
	if !reason.Forced() {
		seq, err := w.lastActivity(ctx, c.User)
		if err != nil {
			return "", err
		}
		if seq > c.Suspend.ActivitySeq {
			w.audit(ctx, events.AuditEvent{Kind: events.AuditSuspend, User: c.User, Outcome: "cancelled",
				Detail: fmt.Sprintf("activity %d is newer than the decision's %d", seq, c.Suspend.ActivitySeq)})
			return "cancelled", nil
		}
		k, err := w.keepAwake.Get(ctx, c.User)
		switch {
		case err == nil && k.Value.Holds(time.Now()):
			w.audit(ctx, events.AuditEvent{Kind: events.AuditSuspend, User: c.User, Outcome: "cancelled",
				Detail: "kept awake until " + k.Value.Until.UTC().Format(time.RFC3339)})
			return "cancelled", nil
		case err != nil && !errors.Is(err, kv.ErrNotFound):
			return "", err
		}
	}
	if st.Sandbox.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeSuspended {
		return "skipped", nil
	}
	// Detail is in words for the user's pages (the sweeper's
	// idle.Reason.Describe); the audit says who asked.
	detail, by := c.Suspend.Detail, ""
	switch {
	case reason == idle.ReasonAdmin:
		detail, by = reason.Describe(idle.Policy{}), ", by administrator "+c.Suspend.By
	case reason == idle.ReasonUser:
		detail = reason.Describe(idle.Policy{})
	case detail == "":
		detail = "it was idle since " + c.Suspend.IdleSince.Format(time.RFC3339)
	}
	if len(detail) > 200 {
		detail = detail[:200]
	}
	why := state.Suspension{At: time.Now().UTC(), Reason: string(reason), Detail: detail}
	if err := w.k8s.Suspend(ctx, st.Sandbox.Name, why); err != nil {
		return "", w.kubeFail(ctx, "suspend", err)
	}
	if _, err := w.handshakes.PurgePrefix(ctx, c.User); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditSuspend, User: c.User, Outcome: "suspended",
		Detail: fmt.Sprintf("sandbox %s: %s (%s%s)", st.Sandbox.Name, detail, reason, by)})
	// The command's id derives from the state it acted on: a redelivery
	// notifies under the same id.
	w.o.Notify.Send(notify.Notice{ID: "suspended." + c.ID, Kind: notify.KindSuspended, User: c.User, At: why.At, Reason: why.Reason, Detail: why.Detail})
	return "suspended", nil
}

// suspendReason is a command's reason; a command from a build before
// reasons (or with one this build does not know) is an administrator's
// when it names one, else the sweeper's idle decision: never forced by
// mistake.
func suspendReason(a *events.SuspendArgs) idle.Reason {
	switch r := idle.Reason(a.Reason); {
	case a.By != "":
		return idle.ReasonAdmin
	case r.Valid():
		return r
	}
	return idle.ReasonIdle
}

// lastActivity is the newest activity-stream sequence for user (0: none).
func (w *Worker) lastActivity(ctx context.Context, user string) (uint64, error) {
	m, err := w.activity.GetLastMsgForSubject(ctx, events.ActivitySubjectUser(user))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("last activity of %s: %w", user, err)
	}
	return m.Sequence, nil
}

// delete removes the account: the claim (its sandbox and volume follow),
// every session and handshake, and the records.
func (w *Worker) delete(ctx context.Context, c events.Command) (string, error) {
	if owner, name, _ := ident.SplitSandboxKey(c.User); name != "" {
		return w.deleteNamed(ctx, c, owner, name)
	}
	claim, err := w.k8s.GetClaim(ctx, c.User)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return "", w.kubeFail(ctx, "get claim", err)
	case !w.k8s.Managed(claim):
		_ = w.answer(ctx, c, state.OutcomeFailed, "claim is not managed by this gateway")
		return "", events.Permanent(fmt.Errorf("claim %s is not managed by this gateway", claim.Name))
	default:
		// Signed out first: the user's open streams end as "signed out",
		// not as a sandbox that vanished, and nothing authenticates as the
		// account while it goes.
		if err := w.signOut(ctx, c.User); err != nil {
			return "", err
		}
		if err := w.k8s.DeleteClaim(ctx, c.User, claim.UID, false); err != nil {
			return "", w.kubeFail(ctx, "delete claim", err)
		}
	}
	// Its named sandboxes go with it; the record that lists them goes
	// last (forget).
	if err := w.deleteNamedOf(ctx, c.User); err != nil {
		return "", err
	}
	if err := w.forget(ctx, c.User); err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeDeleted, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditDelete, User: c.User, Outcome: state.OutcomeDeleted})
	w.o.Notify.Send(notify.Notice{ID: "deleted." + c.ID, Kind: notify.KindDeleted, User: c.User, At: time.Now().UTC()})
	return state.OutcomeDeleted, nil
}

// token replaces the account's bearer token: the new hash goes on the
// claim, where the account lives, and on the record, which the edges
// check tokens against; the old token stops working as the record
// changes. Sessions are left alone (a user who lost the token is still
// signed in somewhere; an administrator revokes sessions apart). A
// redelivery finds the hash in place and answers the same.
func (w *Worker) token(ctx context.Context, c events.Command) (string, error) {
	claim, err := w.k8s.GetClaim(ctx, c.User)
	switch {
	case apierrors.IsNotFound(err):
		_ = w.answer(ctx, c, state.OutcomeFailed, "no such account")
		return "", events.Permanent(fmt.Errorf("no claim for %s", c.User))
	case err != nil:
		return "", w.kubeFail(ctx, "get claim", err)
	case !w.k8s.Managed(claim):
		_ = w.answer(ctx, c, state.OutcomeFailed, "claim is not managed by this gateway")
		return "", events.Permanent(fmt.Errorf("claim %s is not managed by this gateway", claim.Name))
	}
	hash := c.Token.TokenHash
	if claim.Annotations[sandbox.TokenHashAnnotation] != hash {
		if err := w.k8s.SetTokenHash(ctx, c.User, hash); err != nil {
			return "", w.kubeFail(ctx, "patch claim", err)
		}
	}
	_, err = w.users.Mutate(ctx, c.User, func(cur state.User, ok bool) (state.User, bool, error) {
		if !ok {
			return cur, false, errors.New("no account record yet")
		}
		if !cur.DeletingSince.IsZero() {
			return cur, false, events.Permanent(errors.New("the account is being deleted"))
		}
		cur.TokenHash = hash
		return cur, true, nil
	})
	if err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeReplaced, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditToken, User: c.User, Outcome: state.OutcomeReplaced, Detail: "by " + c.Token.By})
	return state.OutcomeReplaced, nil
}

// signOut marks the account as being deleted (its token and SSO binding
// stop working) and ends its sessions.
func (w *Worker) signOut(ctx context.Context, user string) error {
	_, err := w.users.Mutate(ctx, user, func(cur state.User, ok bool) (state.User, bool, error) {
		if !ok || !cur.DeletingSince.IsZero() {
			return cur, false, nil
		}
		cur.DeletingSince = time.Now().UTC()
		return cur, true, nil
	})
	if err != nil {
		return err
	}
	_, err = w.sessions.PurgePrefix(ctx, user)
	return err
}

// forget drops everything KV holds about a user.
func (w *Worker) forget(ctx context.Context, user string) error {
	if _, err := w.sessions.PurgePrefix(ctx, user); err != nil {
		return err
	}
	if _, err := w.handshakes.PurgePrefix(ctx, user); err != nil {
		return err
	}
	// Bound to the claim, they could authenticate nobody else; they go
	// with the account anyway.
	if _, err := w.apiTokens.PurgePrefix(ctx, user); err != nil {
		return err
	}
	if err := w.users.Purge(ctx, user); err != nil {
		return err
	}
	return w.sandboxes.Purge(ctx, user)
}

// recreate replaces the user's sandbox and volume with fresh ones under the
// same account and token, and signs every session out. The account record
// is marked first, so that the moment without a claim is not mistaken for
// a deletion and nobody else can sign up under the name.
func (w *Worker) recreate(ctx context.Context, c events.Command) (string, error) {
	var chosen string
	if c.Recreate != nil {
		chosen = c.Recreate.Profile
		if _, ok := w.o.Profiles.Find(chosen); !ok {
			return w.refuseProfile(ctx, c, events.AuditRecreate, chosen)
		}
	}
	if owner, name, _ := ident.SplitSandboxKey(c.User); name != "" {
		return w.recreateNamed(ctx, c, owner, name, chosen)
	}
	u, err := w.users.Mutate(ctx, c.User, func(cur state.User, ok bool) (state.User, bool, error) {
		if !ok {
			return cur, false, events.Permanent(fmt.Errorf("no account %q", c.User))
		}
		if cur.RecreatingSince.IsZero() {
			cur.RecreatingSince = time.Now().UTC()
			return cur, true, nil
		}
		return cur, false, nil
	})
	if err != nil {
		if events.IsPermanent(err) {
			_ = w.answer(ctx, c, state.OutcomeFailed, err.Error())
		}
		return "", err
	}
	if _, err := w.sessions.PurgePrefix(ctx, c.User); err != nil {
		return "", err
	}
	if _, err := w.handshakes.PurgePrefix(ctx, c.User); err != nil {
		return "", err
	}

	old, chosen, err := w.oldClaim(ctx, c.User, chosen)
	switch {
	case err != nil:
		return "", err
	case old == nil:
	case string(old.UID) != u.Value.ClaimUID && sameHash(old.Annotations[sandbox.TokenHashAnnotation], u.Value.TokenHash):
		// Already re-created by an earlier delivery of this command.
	default:
		if err := w.replace(ctx, c.User, old.UID); err != nil {
			return "", err
		}
	}

	// The old sandbox's profile, unless the user chose another; one that
	// PROFILES no longer lists gives way to the default.
	profile := w.o.Profiles.Kept(chosen)
	claim, err := w.k8s.CreateClaim(ctx, c.User, u.Value.TokenHash, profile.Name, profile.WarmPool)
	if apierrors.IsAlreadyExists(err) {
		claim, err = w.k8s.GetClaim(ctx, c.User)
	}
	if err != nil {
		return "", w.kubeFail(ctx, "create claim", err)
	}
	if err := w.recordClaim(ctx, c.User, u.Value.TokenHash, claim); err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeRecreated, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditRecreate, User: c.User, Outcome: state.OutcomeRecreated, Detail: "SandboxClaim " + claim.Name + ", profile " + profile.Name})
	return state.OutcomeRecreated, nil
}

// oldClaim reads the claim of key a recreate replaces: nil when there is
// none, a permanent error when it is not this gateway's, and the profile
// the new claim is of (chosen, else the old claim's).
func (w *Worker) oldClaim(ctx context.Context, key, chosen string) (*extv1beta1.SandboxClaim, string, error) {
	old, err := w.k8s.GetClaim(ctx, key)
	switch {
	case apierrors.IsNotFound(err):
		return nil, chosen, nil
	case err != nil:
		return nil, chosen, w.kubeFail(ctx, "get claim", err)
	case !w.k8s.Managed(old):
		return nil, chosen, events.Permanent(fmt.Errorf("claim %s is not managed by this gateway", old.Name))
	case chosen == "":
		chosen = old.Annotations[sandbox.ProfileAnnotation]
	}
	return old, chosen, nil
}

// replace deletes the old claim and waits, on the informer caches, until
// it and its sandbox and pod are gone.
func (w *Worker) replace(ctx context.Context, user string, uid types.UID) error {
	old := w.k8s.Lookup(user).Sandbox
	if err := w.k8s.DeleteClaim(ctx, user, uid, true); err != nil {
		return w.kubeFail(ctx, "delete claim", err)
	}
	if _, err := w.sandboxes.Put(ctx, user, state.Sandbox{User: user, Phase: state.PhaseDeleting, Managed: true, Updated: time.Now().UTC()}); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, w.o.RecreateTimeout)
	defer cancel()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for !(w.k8s.ClaimGone(user, uid) && (old == nil || w.k8s.SandboxGone(old.Name))) {
		select {
		case <-wctx.Done():
			return fmt.Errorf("old sandbox of %s not gone after %s", user, w.o.RecreateTimeout)
		case <-t.C:
		}
	}
	return nil
}

// handshake reads the launch token from the pod log, trades it for DSH's
// auth cookie with the browser's Host, and stores the cookie sealed. A
// failure is stored too, with its reason, so the waiting edge can say why.
//
// The pod is the tenant's, so the whole handshake (every log read,
// candidate token and retry) ends within HandshakeTimeout, and one asked
// for again soon after the last waits its turn (LifecycleRefreshes): a pod
// that refuses every cookie costs a handshake now and then, not one per
// request.
func (w *Worker) handshake(ctx context.Context, c events.Command, d events.Delivery) (string, error) {
	a := c.Handshake
	key := state.HandshakeKey(c.User, a.PodUID, a.Host)
	cur, err := w.handshakes.Get(ctx, key)
	switch {
	case err == nil && cur.Revision > a.StaleRevision:
		// Done again since the asker looked (another edge asked first):
		// the newer record is its answer.
		return "fresh", nil
	case err != nil && !errors.Is(err, kv.ErrNotFound):
		return "", err
	}
	if a.StaleRevision != 0 && err == nil {
		if wait := w.refreshes.Next(key, time.Now()); wait > 0 {
			return w.refreshRefused(ctx, key, cur, wait)
		}
	}
	st, ok := w.podFor(c.User, a.PodUID)
	switch {
	case !ok && !d.Last && d.Delivered < podWaits:
		// Not in this replica's cache yet: back to the queue, not a
		// worker held waiting for it.
		return "", events.Later(errPodNotSeen, podWaitDelay(d.Delivered))
	case !ok:
		return w.handshakeFailed(ctx, c, key, errPodChanged)
	}
	hctx, cancel := context.WithTimeout(ctx, w.o.HandshakeTimeout)
	defer cancel()
	cookie, failure, err := w.exchange(hctx, st, a)
	if (failure != nil || err != nil) && hctx.Err() != nil && ctx.Err() == nil {
		failure, err = fmt.Errorf("%w (HANDSHAKE_TIMEOUT %s)", errHandshakeDeadline, w.o.HandshakeTimeout), nil
	}
	switch {
	case err != nil:
		return "", err
	case failure != nil:
		return w.handshakeFailed(ctx, c, key, failure)
	}
	sealed := w.o.Sealer.Seal([]byte(cookie), []byte(key))
	if _, err := w.handshakes.Put(ctx, key, state.Handshake{User: c.User, PodUID: a.PodUID, Host: a.Host, Sealed: sealed, At: time.Now().UTC()}, kv.WithTTL(w.o.HandshakeTTL)); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditHandshake, User: c.User, Outcome: "ok", Detail: "pod " + a.PodUID + " host " + a.Host})
	return "ok", nil
}

// exchange finds the pod, reads its log and trades the newest token DSH
// accepts for its cookie. failure is the pod's answer, to be recorded; err
// is a passing fault worth a redelivery.
func (w *Worker) exchange(ctx context.Context, st sandbox.State, a *events.HandshakeArgs) (cookie string, failure, err error) {
	req := handshake.Request{Address: w.k8s.Address(st), Host: a.Host, Proto: a.Proto, Prefix: a.Prefix}
	for attempt := 0; ; attempt++ {
		log, err := w.k8s.LogTail(ctx, st.Pod, w.o.LogTailLines)
		if err != nil {
			if err = w.kubeFail(ctx, "pod log", err); events.IsPermanent(err) {
				return "", fmt.Errorf("cannot read the DSH log: %w", err), nil
			}
			return "", nil, err
		}
		w.m.logBytes.Observe(float64(len(log)))
		tokens, err := handshake.TokensFromLog(log)
		if err != nil {
			if w.o.LogLimitBytes > 0 && int64(len(log)) >= w.o.LogLimitBytes {
				// The read stopped at the limit: say so, or the operator
				// looks for a DSH that printed no token.
				err = fmt.Errorf("%w in the %d bytes read of the log's last %d lines (DSH_LOG_LIMIT_BYTES, DSH_LOG_TAIL_LINES)", err, w.o.LogLimitBytes, w.o.LogTailLines)
			}
			return "", err, nil
		}
		// The tenant writes the log too: a line printed after the real one
		// may only look like a token. Try them newest first.
		var herr *handshake.Error
		for _, req.Token = range tokens {
			if cookie, err = handshake.Exchange(ctx, w.http, req); !errors.As(err, &herr) || herr.Status != 401 {
				break
			}
		}
		// Every candidate refused right after reading the log means DSH
		// rotated its token in between: read the log once more.
		if errors.As(err, &herr) && herr.Status == 401 && attempt == 0 {
			continue
		}
		return cookie, err, nil
	}
}

// backoffNote ends the reason of a failed handshake that was asked for
// again before its turn.
const backoffNote = "; the next handshake for this pod waits "

// refreshRefused answers a handshake asked for again before its turn by
// writing the key's record again: the asker's wait ends at once instead of
// after HANDSHAKE_TIMEOUT, a cookie stays the one it was (another edge may
// be using it; the asker finds DSH still refusing it, or that it cannot
// open it), and a failure keeps its reason, saying when the next handshake
// may go. Neither the pod nor the audit stream hears of it: the pacing
// exists so that a pod refusing every cookie fills neither.
func (w *Worker) refreshRefused(ctx context.Context, key string, cur kv.Entry[state.Handshake], wait time.Duration) (string, error) {
	w.m.handshakeFailures.WithLabelValues("backoff").Inc()
	rec, ttl := cur.Value, w.o.HandshakeTTL
	if rec.Error != "" {
		why, _, _ := strings.Cut(rec.Error, backoffNote)
		rec.Error, rec.At, ttl = why+backoffNote+wait.Round(100*time.Millisecond).String(), time.Now().UTC(), failedHandshakeTTL
	}
	if _, err := w.handshakes.Put(ctx, key, rec, kv.WithTTL(ttl)); err != nil {
		return "", err
	}
	return "backoff", nil
}

// podFor is the pod the edge asked about, with its address, once this
// replica's cache shows it: the edge learnt its UID from the mirror, which
// may run on a replica whose informer is a little ahead of ours, and an
// older copy of the same pod may not have its IP yet (the fault suite
// caught a handshake dialling ":3080" after an API server restart).
func (w *Worker) podFor(user, podUID string) (sandbox.State, bool) {
	st := w.k8s.Lookup(user)
	return st, st.Pod != nil && string(st.Pod.UID) == podUID && st.Pod.DeletionTimestamp == nil && st.Pod.Status.PodIP != ""
}

// podWaits is how many deliveries of a handshake may find its pod missing
// from the cache before it is taken as gone; podWaitDelay spaces them
// (250 ms, 750 ms, 2 s: the 3 s an informer had when the handler waited).
const podWaits = 4

func podWaitDelay(delivered uint64) time.Duration {
	delays := [podWaits - 1]time.Duration{250 * time.Millisecond, 750 * time.Millisecond, 2 * time.Second}
	return delays[min(max(delivered, 1), uint64(len(delays)))-1]
}

// failedHandshakeTTL keeps a failure long enough for the waiting edge to
// read it, not so long that it shadows a later success.
const failedHandshakeTTL = time.Minute

var (
	errPodChanged        = errors.New("the sandbox's pod changed or stopped before the handshake")
	errPodNotSeen        = errors.New("the sandbox's pod is not in this replica's cache yet")
	errHandshakeDeadline = errors.New("the sandbox's DSH did not complete the handshake in time")
	errHandshakesBusy    = errors.New("too many handshakes under way; try again in a moment")
)

func (w *Worker) handshakeFailed(ctx context.Context, c events.Command, key string, cause error) (string, error) {
	w.m.handshakeFailures.WithLabelValues(failureLabel(cause)).Inc()
	if _, err := w.handshakes.Put(ctx, key, state.Handshake{User: c.User, PodUID: c.Handshake.PodUID, Host: c.Handshake.Host, Error: cause.Error(), At: time.Now().UTC()}, kv.WithTTL(failedHandshakeTTL)); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditHandshakeFailed, User: c.User, Outcome: "failed", Detail: cause.Error()})
	return "failed", nil
}

func failureLabel(err error) string {
	var herr *handshake.Error
	switch {
	case errors.Is(err, handshake.ErrNoToken):
		return "missing_token"
	case errors.Is(err, errPodChanged):
		return "pod_changed"
	case errors.Is(err, errHandshakeDeadline):
		return "deadline"
	case errors.Is(err, errHandshakesBusy):
		return "busy"
	case errors.As(err, &herr) && herr.Status == 0:
		return "unreachable"
	case errors.As(err, &herr):
		return "dsh_" + strconv.Itoa(herr.Status)
	}
	return "other"
}

// audit publishes e with the id of the request the work is for (ctx's
// trace, see handle) unless e names one.
func (w *Worker) audit(ctx context.Context, e events.AuditEvent) {
	if e.RequestID == "" {
		e.RequestID = ident.RequestIDOf(ctx)
	}
	w.pub.Audit(e)
}
