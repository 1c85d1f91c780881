package state

import (
	"strings"
	"time"
)

// BucketAPITokens holds users' named API tokens, by APITokenKey.
const BucketAPITokens = "api_tokens"

// APIToken is one of a user's named tokens for API clients (JupyterHub's
// /hub/token): a bearer token of its own, apart from the account's, that
// the user makes and deletes, optionally expiring. Only its hash is kept.
type APIToken struct {
	User string `json:"user"`
	Name string `json:"name"`
	// Hash is the hex SHA-256 of the token.
	Hash string `json:"hash"`
	// ClaimUID binds the token to the account as it was made: a recreate
	// (a fresh sandbox, every session signed out) or a new account under
	// the same name has another claim, and the token no longer holds.
	ClaimUID string    `json:"claim_uid"`
	Created  time.Time `json:"created"`
	// Expires is when it stops holding (zero: never); the record goes
	// then too (a per-key TTL).
	Expires time.Time `json:"expires,omitzero"`
}

// APITokenKey is user's token name's key.
func APITokenKey(user, name string) string { return user + "." + name }

// APITokenUser is the user of an APITokenKey (user names hold no dot).
func APITokenUser(key string) string {
	user, _, _ := strings.Cut(key, ".")
	return user
}

// SchemaVersion is APIToken's record version.
func (APIToken) SchemaVersion() int { return 1 }

// Holds reports whether t still authenticates for u at now.
func (t APIToken) Holds(u User, now time.Time) bool {
	return t.ClaimUID != "" && t.ClaimUID == u.ClaimUID && u.DeletingSince.IsZero() && (t.Expires.IsZero() || now.Before(t.Expires))
}
