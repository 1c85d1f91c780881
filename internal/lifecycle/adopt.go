package lifecycle

// `lifecycle adopt` migrates the seed gateway's users. The seed kept each
// user as a SandboxClaim dsh-<user> with the token's hash in an annotation
// and marked its claims with an annotation; this gateway only ever sees
// claims that carry its label (the informers select on it), so a seed
// claim is invisible until adopted. Adopting adds the label, the user label
// and the token-hash annotation the mirror reads, in one patch: the claim,
// its sandbox and volume stay as they are, the mirror writes the account,
// and the user signs in with the old token.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"text/tabwriter"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/validate/content"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	claimsv1beta1 "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned/typed/api/v1beta1"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/sandbox"
)

// SeedOwner is the marker the seed gateway put on the claims it created
// (as an annotation: this gateway's equivalent is a label).
const SeedOwner = "aaas.example.com/managed-by=dsh-gateway"

// AdoptOptions say which claims `lifecycle adopt` takes over.
type AdoptOptions struct {
	// Namespace is where the claims are, for the report.
	Namespace string
	// ManagedKey=ManagedValue is this gateway's label (MANAGED_BY_LABEL):
	// what adoption adds, and what marks a claim as adopted already.
	ManagedKey, ManagedValue string
	// Owner is the seed's key=value marker (--owner-annotation), matched
	// as an annotation or a label.
	Owner string
	// TokenAnnotation is where the seed kept the token hash
	// (--token-annotation).
	TokenAnnotation string
	// Users are adopted without the owner marker (--user): claims applied
	// by hand, which the seed served but never marked.
	Users []string
	// Apply patches the claims (--apply); without it nothing changes.
	Apply bool
}

// Validate reports every problem with o, in terms of the flags.
func (o AdoptOptions) Validate() error {
	var errs []error
	if o.ManagedKey == "" || o.ManagedValue == "" {
		errs = append(errs, errors.New("no managed label: MANAGED_BY_LABEL must be key=value"))
	}
	if k, v, ok := strings.Cut(o.Owner, "="); !ok || v == "" || len(content.IsLabelKey(k)) > 0 {
		errs = append(errs, fmt.Errorf("--owner-annotation %q: want key=value, an annotation or label key and its value (default %s)", o.Owner, SeedOwner))
	}
	if msgs := content.IsLabelKey(o.TokenAnnotation); len(msgs) > 0 {
		errs = append(errs, fmt.Errorf("--token-annotation %q is not an annotation key: %s", o.TokenAnnotation, strings.Join(msgs, "; ")))
	}
	for _, u := range o.Users {
		if err := ident.ValidateUser(u); err != nil {
			if name, ok := sandbox.UserOf(u); ok && ident.ValidateUser(name) == nil {
				errs = append(errs, fmt.Errorf("--user %q is a claim name: give the user, %q", u, name))
				continue
			}
			errs = append(errs, fmt.Errorf("--user %q: %v", u, err))
		}
	}
	return errors.Join(errs...)
}

// AdoptAction is what adopt does, or did, with one claim.
type AdoptAction string

// The actions, as printed.
const (
	ActionAdopt   AdoptAction = "adopt" // in a dry run
	ActionAdopted AdoptAction = "adopted"
	ActionManaged AdoptAction = "already managed"
	ActionSkipped AdoptAction = "skipped"
	ActionFailed  AdoptAction = "failed"
)

// AdoptDecision is one claim's line of the report.
type AdoptDecision struct {
	Claim string
	// User is empty for a claim that is not a user's.
	User   string
	Action AdoptAction
	// Reason says why a claim is skipped or failed.
	Reason string

	// What the patch needs: the validated hash and the version decided
	// on (the patch is refused if the claim changed since).
	tokenHash       string
	resourceVersion string
}

// sha256Hex is how the token hash is stored: our edge compares it with the
// lowercase hex digest of the presented token, so anything else could
// never match.
var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

// PlanAdoption decides, without side effects, what adopt does with each
// claim (in the order given), followed by a line for each --user without
// a claim. Only a claim named dsh-<valid user>, without our label, marked
// by the seed or named with --user, and holding a well-formed token hash
// is adopted: anything else would either take over a claim that is not
// the seed's or create an account nobody can sign in to.
func PlanAdoption(claims []extv1beta1.SandboxClaim, o AdoptOptions) []AdoptDecision {
	ownerKey, ownerValue, _ := strings.Cut(o.Owner, "=")
	out := make([]AdoptDecision, 0, len(claims))
	seen := map[string]bool{}
	for i := range claims {
		d := decide(&claims[i], o, ownerKey, ownerValue)
		seen[d.User] = true
		out = append(out, d)
	}
	for _, u := range o.Users {
		if !seen[u] {
			seen[u] = true
			out = append(out, AdoptDecision{Claim: sandbox.ClaimName(u), User: u, Action: ActionSkipped, Reason: "no such claim (named with --user)"})
		}
	}
	return out
}

func decide(c *extv1beta1.SandboxClaim, o AdoptOptions, ownerKey, ownerValue string) AdoptDecision {
	d := AdoptDecision{Claim: c.Name, Action: ActionSkipped}
	user, ok := sandbox.UserOf(c.Name)
	if !ok || ident.ValidateUser(user) != nil {
		d.Reason = "not a user's claim (not named dsh-<user>)"
		return d
	}
	d.User = user
	labels, annotations := c.Labels, c.Annotations
	seed := annotations[ownerKey] == ownerValue || labels[ownerKey] == ownerValue
	switch v, has := labels[o.ManagedKey]; {
	case has && v == o.ManagedValue:
		d.Action = ActionManaged
		return d
	case has && !(o.ManagedKey == ownerKey && v == ownerValue):
		// Our key with another value: another gateway's (or another
		// configuration's) claim, which relabelling would steal.
		d.Reason = fmt.Sprintf("labelled %s=%s, not %s: another gateway's claim", o.ManagedKey, v, o.ManagedValue)
		return d
	}
	if c.DeletionTimestamp != nil {
		d.Reason = "being deleted"
		return d
	}
	if !seed && !slices.Contains(o.Users, user) {
		d.Reason = fmt.Sprintf("no %s marker (annotation or label): not the seed's; name the user with --user to adopt a hand-applied claim", o.Owner)
		return d
	}
	hash, has := annotations[o.TokenAnnotation]
	switch {
	case !has || hash == "":
		d.Reason = fmt.Sprintf("no token hash in annotation %s: the user could never sign in", o.TokenAnnotation)
		return d
	case !sha256Hex.MatchString(hash):
		d.Reason = fmt.Sprintf("annotation %s is not a SHA-256 in lowercase hex: the user could never sign in", o.TokenAnnotation)
		return d
	}
	if ours, has := annotations[sandbox.TokenHashAnnotation]; has && ours != hash {
		d.Reason = fmt.Sprintf("annotations %s and %s hold different token hashes", o.TokenAnnotation, sandbox.TokenHashAnnotation)
		return d
	}
	if v, has := labels[sandbox.UserLabel]; has && v != user {
		d.Reason = fmt.Sprintf("label %s=%s names another user", sandbox.UserLabel, v)
		return d
	}
	d.Action, d.tokenHash, d.resourceVersion = ActionAdopt, hash, c.ResourceVersion
	return d
}

// adoptPatch is the one change adoption makes: our label, the user label
// and our token-hash annotation (the seed's may sit under another key),
// as a merge patch that also carries the resourceVersion decided on, so
// the API server refuses it if the claim changed in between.
func adoptPatch(d AdoptDecision, o AdoptOptions) ([]byte, error) {
	return json.Marshal(map[string]any{"metadata": map[string]any{
		"resourceVersion": d.resourceVersion,
		"labels":          map[string]string{o.ManagedKey: o.ManagedValue, sandbox.UserLabel: d.User},
		"annotations":     map[string]string{sandbox.TokenHashAnnotation: d.tokenHash},
	}})
}

// AdoptSummary counts a run's outcomes.
type AdoptSummary map[AdoptAction]int

// Adopt lists every claim, decides (PlanAdoption), and with o.Apply
// patches the candidates; it writes one line per claim and a summary to
// out. It fails if the claims cannot be listed or any patch failed; the
// other claims are still patched and reported.
func Adopt(ctx context.Context, claims claimsv1beta1.SandboxClaimInterface, o AdoptOptions, out io.Writer) (AdoptSummary, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	var all []extv1beta1.SandboxClaim
	opts := metav1.ListOptions{Limit: 500}
	for {
		l, err := claims.List(ctx, opts)
		if err != nil {
			if apierrors.IsForbidden(err) {
				return nil, fmt.Errorf("list claims: %w (the lifecycle Role needs list on sandboxclaims)", err)
			}
			return nil, fmt.Errorf("list claims: %w", err)
		}
		all = append(all, l.Items...)
		if opts.Continue = l.Continue; opts.Continue == "" {
			break
		}
	}
	plan := PlanAdoption(all, o)

	mode := "dry run: nothing is changed"
	if o.Apply {
		mode = "applying"
	}
	fmt.Fprintf(out, "adopting the seed gateway's claims in namespace %s (%s): marker %s, token hash in %s, label %s=%s\n",
		o.Namespace, mode, o.Owner, o.TokenAnnotation, o.ManagedKey, o.ManagedValue)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CLAIM\tUSER\tACTION")
	sum := AdoptSummary{}
	failed := 0
	for _, d := range plan {
		if d.Action == ActionAdopt && o.Apply {
			if err := patchClaim(ctx, claims, d, o); err != nil {
				d.Action, d.Reason = ActionFailed, err.Error()
				failed++
			} else {
				d.Action = ActionAdopted
			}
		}
		sum[d.Action]++
		user, action := d.User, string(d.Action)
		if user == "" {
			user = "-"
		}
		if d.Reason != "" {
			action += ": " + d.Reason
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", d.Claim, user, action)
	}
	if err := tw.Flush(); err != nil {
		return sum, err
	}
	if o.Apply {
		fmt.Fprintf(out, "%d adopted, %d already managed, %d skipped, %d failed\n",
			sum[ActionAdopted], sum[ActionManaged], sum[ActionSkipped], sum[ActionFailed])
	} else {
		fmt.Fprintf(out, "%d to adopt, %d already managed, %d skipped; nothing changed: run again with --apply to adopt\n",
			sum[ActionAdopt], sum[ActionManaged], sum[ActionSkipped])
	}
	if failed > 0 {
		return sum, fmt.Errorf("%d of %d claims could not be adopted (see above)", failed, failed+sum[ActionAdopted])
	}
	return sum, nil
}

func patchClaim(ctx context.Context, claims claimsv1beta1.SandboxClaimInterface, d AdoptDecision, o AdoptOptions) error {
	patch, err := adoptPatch(d, o)
	if err != nil {
		return err
	}
	_, err = claims.Patch(ctx, d.Claim, types.MergePatchType, patch, metav1.PatchOptions{})
	switch {
	case err == nil:
		return nil
	case apierrors.IsConflict(err):
		return errors.New("the claim changed while adopt ran; run adopt again")
	case apierrors.IsNotFound(err):
		return errors.New("the claim was deleted while adopt ran")
	case apierrors.IsForbidden(err):
		return fmt.Errorf("forbidden: the lifecycle Role needs patch on sandboxclaims (apply manifests/base again): %v", err)
	}
	return err
}
