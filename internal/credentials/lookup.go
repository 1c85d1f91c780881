package credentials

import (
	"context"
	"errors"
	"fmt"

	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Lookup is the brokers' way to a user's own key for a provider: the
// record under <user>.<provider>, opened with the ring. ok is false when
// the user brought none. A record that is not user's and provider's (put
// under another key by whoever may write the bucket) or does not open is
// an error: the call is refused rather than made with the organisation's
// key or another user's.
func Lookup(b *kv.Bucket[state.Credential], r *Ring) func(ctx context.Context, user, provider string) (string, bool, error) {
	return func(ctx context.Context, user, provider string) (string, bool, error) {
		e, err := b.Get(ctx, state.CredentialKey(user, provider))
		if errors.Is(err, kv.ErrNotFound) {
			return "", false, nil
		}
		if err != nil {
			return "", false, err
		}
		if e.Value.User != user || e.Value.Provider != provider {
			return "", false, fmt.Errorf("the key stored for %s at %s is %s's for %s: %w", user, provider, e.Value.User, e.Value.Provider, ErrMismatch)
		}
		key, err := r.Open(e.Value)
		if err != nil {
			return "", false, err
		}
		return key, true, nil
	}
}
