package auth

import (
	"errors"
	"regexp"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/state"
)

// MaxTokenNameLen bounds an API token's name.
const MaxTokenNameLen = 32

var tokenNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]*$`)

// ErrBadTokenName says what an API token's name may be.
var ErrBadTokenName = errors.New("a token name is 1 to 32 lowercase letters, digits and hyphens, starting with a letter or digit")

// ValidateTokenName checks an API token's name.
func ValidateTokenName(name string) error {
	if len(name) < 1 || len(name) > MaxTokenNameLen || !tokenNameRE.MatchString(name) {
		return ErrBadTokenName
	}
	return nil
}

// NewAPIToken mints user's API token called name: "<user>.<name>.<secret>"
// (the secret 256 random bits), so the token names its record, and no
// account token (two parts) is ever read as one.
func NewAPIToken(user, name string) string { return user + "." + name + "." + random32() }

// ParseAPIToken returns the user and name an API token claims.
func ParseAPIToken(token string) (user, name string, ok bool) {
	parts := strings.SplitN(token, ".", 3)
	if len(parts) != 3 || len(parts[2]) != sidLen || ValidateUser(parts[0]) != nil || ValidateTokenName(parts[1]) != nil {
		return "", "", false
	}
	return parts[0], parts[1], true
}

// checkAPIToken returns the account an API token authenticates, and the
// token's record; false unless the record exists, its hash is the token's
// and it holds for the account now (state.APIToken.Holds).
func (a *Authenticator) checkAPIToken(token string) (state.User, state.APIToken, bool) {
	user, name, ok := ParseAPIToken(token)
	if !ok || a.o.APITokens == nil {
		return state.User{}, state.APIToken{}, false
	}
	t, ok := a.o.APITokens.Get(state.APITokenKey(user, name))
	if !ok || !TokenMatches(token, t.Value.Hash) {
		return state.User{}, state.APIToken{}, false
	}
	u, ok := a.o.Users.Get(user)
	if !ok || !t.Value.Holds(u.Value, time.Now()) {
		return state.User{}, state.APIToken{}, false
	}
	return u.Value, t.Value, true
}
