package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// Named sandboxes (MAX_SANDBOXES_PER_USER above 1): an account's further
// sandboxes, each with its own claim "dsh-<user>--<name>", volume, record,
// origin, idle clock and handshakes, all keyed by its sandbox key
// (ident.SandboxKey). They have no account record of their own: the
// owner's record lists their names (state.User.Sandboxes), which is where
// the cap is kept.

// errTooMany refuses a named sandbox beyond MAX_SANDBOXES_PER_USER.
var errTooMany = errors.New("too many sandboxes")

// claimNamed makes the named sandbox of c.User. The name goes on the
// owner's record first (a compare-and-set, so creates racing for the last
// place cannot both have it), then the claim, which carries the request
// id: a claim with this command's id is its own earlier create (a
// redelivery), one with another's is a sandbox of that name already.
func (w *Worker) claimNamed(ctx context.Context, c events.Command, owner, name string) (string, error) {
	profile, ok := w.o.Profiles.Find(c.Claim.Profile)
	if !ok {
		return w.refuseProfile(ctx, c, events.AuditClaim, c.Claim.Profile)
	}
	_, err := w.users.Mutate(ctx, owner, func(cur state.User, ok bool) (state.User, bool, error) {
		switch {
		case !ok || !cur.DeletingSince.IsZero():
			return cur, false, events.Permanent(fmt.Errorf("no account %q", owner))
		case slices.Contains(cur.Sandboxes, name):
			return cur, false, nil
		case 1+len(cur.Sandboxes) >= w.o.MaxSandboxes:
			return cur, false, errTooMany
		}
		cur.Sandboxes = append(slices.Clip(cur.Sandboxes), name)
		return cur, true, nil
	})
	switch {
	case errors.Is(err, errTooMany):
		return w.conflict(ctx, c, "this account has "+strconv.Itoa(w.o.MaxSandboxes)+" sandboxes, the most MAX_SANDBOXES_PER_USER allows")
	case events.IsPermanent(err):
		_ = w.answer(ctx, c, state.OutcomeFailed, err.Error())
		return "", err
	case err != nil:
		return "", err
	}
	claim, err := w.k8s.CreateNamedClaim(ctx, c.User, owner, c.RequestID, profile.Name, profile.WarmPool)
	if apierrors.IsAlreadyExists(err) {
		if claim, err = w.k8s.GetClaim(ctx, c.User); err != nil {
			return "", w.kubeFail(ctx, "get claim", err)
		}
		if !w.k8s.Managed(claim) || claim.Annotations[sandbox.RequestAnnotation] != c.RequestID {
			return w.conflict(ctx, c, "a sandbox of that name exists")
		}
	} else if err != nil {
		return "", w.kubeFail(ctx, "create claim", err)
	}
	if err := w.recordSandbox(ctx, c.User, claim); err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeCreated, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditClaim, User: owner, Outcome: state.OutcomeCreated, Detail: "sandbox " + name + ": SandboxClaim " + claim.Name + ", profile " + profile.Name})
	return state.OutcomeCreated, nil
}

// recordSandbox writes a first record for a claim this gateway owns
// (unless one is there that is not being deleted); the mirror refines it
// from watches.
func (w *Worker) recordSandbox(ctx context.Context, key string, claim *extv1beta1.SandboxClaim) error {
	_, err := w.sandboxes.Mutate(ctx, key, func(cur state.Sandbox, ok bool) (state.Sandbox, bool, error) {
		fresh := state.Sandbox{User: key, Phase: state.PhaseClaiming, Managed: true, Claim: claim.Name, Profile: claim.Annotations[sandbox.ProfileAnnotation], Updated: time.Now().UTC()}
		return fresh, !ok || cur.Phase == state.PhaseDeleting, nil
	})
	return err
}

// deleteNamed removes one named sandbox: its claim (the sandbox and
// volume follow), its records and handshakes, and its name from the
// owner's record. The account and its other sandboxes stay.
func (w *Worker) deleteNamed(ctx context.Context, c events.Command, owner, name string) (string, error) {
	claim, err := w.k8s.GetClaim(ctx, c.User)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return "", w.kubeFail(ctx, "get claim", err)
	case !w.k8s.Managed(claim):
		_ = w.answer(ctx, c, state.OutcomeFailed, "claim is not managed by this gateway")
		return "", events.Permanent(fmt.Errorf("claim %s is not managed by this gateway", claim.Name))
	default:
		if err := w.k8s.DeleteClaim(ctx, c.User, claim.UID, false); err != nil {
			return "", w.kubeFail(ctx, "delete claim", err)
		}
	}
	if err := w.forgetNamed(ctx, c.User); err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeDeleted, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditDelete, User: owner, Outcome: state.OutcomeDeleted, Detail: "sandbox " + name})
	return state.OutcomeDeleted, nil
}

// forgetNamed drops what KV holds of a named sandbox, and its name from
// its owner's record last, so that a failure on the way is retried with
// the place still taken.
func (w *Worker) forgetNamed(ctx context.Context, key string) error {
	owner, name, _ := ident.SplitSandboxKey(key)
	if _, err := w.handshakes.PurgePrefix(ctx, key); err != nil {
		return err
	}
	if err := w.sandboxes.Purge(ctx, key); err != nil {
		return err
	}
	_, err := w.users.Mutate(ctx, owner, func(cur state.User, ok bool) (state.User, bool, error) {
		i := slices.Index(cur.Sandboxes, name)
		if !ok || i < 0 {
			return cur, false, nil
		}
		cur.Sandboxes = slices.Delete(slices.Clone(cur.Sandboxes), i, i+1)
		return cur, true, nil
	})
	return err
}

// deleteNamedOf deletes the claims of every named sandbox of an account
// being deleted, and forgets them.
func (w *Worker) deleteNamedOf(ctx context.Context, user string) error {
	u, err := w.users.Get(ctx, user)
	switch {
	case errors.Is(err, kv.ErrNotFound):
		return nil // no record: no named sandboxes listed
	case err != nil:
		return err // retried: the list is not to be guessed
	}
	for _, name := range u.Value.Sandboxes {
		key := ident.SandboxKey(user, name)
		claim, err := w.k8s.GetClaim(ctx, key)
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return w.kubeFail(ctx, "get claim", err)
		case w.k8s.Managed(claim):
			if err := w.k8s.DeleteClaim(ctx, key, claim.UID, false); err != nil {
				return w.kubeFail(ctx, "delete claim", err)
			}
		}
		if _, err := w.handshakes.PurgePrefix(ctx, key); err != nil {
			return err
		}
		if err := w.sandboxes.Purge(ctx, key); err != nil {
			return err
		}
	}
	return nil
}

// named reports whether key is a named sandbox's (not an account's first).
func named(key string) bool {
	_, name, ok := ident.SplitSandboxKey(key)
	return ok && name != ""
}

// recreateNamed replaces a named sandbox's claim and volume with fresh
// ones of its profile, or chosen. A claim made by this command is its own
// earlier delivery's work.
func (w *Worker) recreateNamed(ctx context.Context, c events.Command, owner, name, chosen string) (string, error) {
	u, err := w.users.Get(ctx, owner)
	if err != nil && !errors.Is(err, kv.ErrNotFound) {
		return "", err
	}
	if err != nil || !slices.Contains(u.Value.Sandboxes, name) {
		_ = w.answer(ctx, c, state.OutcomeFailed, "no such sandbox")
		return "", events.Permanent(fmt.Errorf("no sandbox %q of %q", name, owner))
	}
	old, chosen, err := w.oldClaim(ctx, c.User, chosen)
	switch {
	case err != nil:
		return "", err
	case old == nil:
	case old.Annotations[sandbox.RequestAnnotation] == c.RequestID:
		// Already re-created by an earlier delivery of this command.
	default:
		if _, err := w.handshakes.PurgePrefix(ctx, c.User); err != nil {
			return "", err
		}
		if err := w.replace(ctx, c.User, old.UID); err != nil {
			return "", err
		}
	}
	profile := w.o.Profiles.Kept(chosen)
	claim, err := w.k8s.CreateNamedClaim(ctx, c.User, owner, c.RequestID, profile.Name, profile.WarmPool)
	if apierrors.IsAlreadyExists(err) {
		claim, err = w.k8s.GetClaim(ctx, c.User)
	}
	if err != nil {
		return "", w.kubeFail(ctx, "create claim", err)
	}
	if err := w.recordSandbox(ctx, c.User, claim); err != nil {
		return "", err
	}
	if err := w.answer(ctx, c, state.OutcomeRecreated, ""); err != nil {
		return "", err
	}
	w.audit(ctx, events.AuditEvent{Kind: events.AuditRecreate, User: owner, Outcome: state.OutcomeRecreated, Detail: "sandbox " + name + ": SandboxClaim " + claim.Name + ", profile " + profile.Name})
	return state.OutcomeRecreated, nil
}
