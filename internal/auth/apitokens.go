package auth

import (
	"context"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
)

// checkAPIToken returns the account an API token authenticates, and the
// token's record; false unless the record exists, its hash is the token's
// and it holds for the account now (state.APIToken.Holds).
func (a *Authenticator) checkAPIToken(ctx context.Context, token string) (state.User, state.APIToken, bool) {
	user, name, ok := ident.ParseAPIToken(token)
	if !ok || a.o.APITokens == nil {
		return state.User{}, state.APIToken{}, false
	}
	t, ok := a.o.APITokens.Load(ctx, state.APITokenKey(user, name))
	if !ok || !ident.TokenMatches(token, t.Value.Hash) {
		return state.User{}, state.APIToken{}, false
	}
	u, ok := a.o.Users.Load(ctx, user)
	if !ok || !t.Value.Holds(u.Value, time.Now()) {
		return state.User{}, state.APIToken{}, false
	}
	return u.Value, t.Value, true
}
