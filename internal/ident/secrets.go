package ident

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"strings"
)

// SecretLen is the encoded length of a secret: 32 random bytes, base64url.
const SecretLen = 43

// NewSecret returns 256 random bits, URL-safe: a session id, a sign-in
// code, the secret part of a token.
func NewSecret() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic("crypto/rand failed: " + err.Error())
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

// ValidSecret reports whether v has the shape NewSecret gives, so garbage
// is refused before any hashing or lookup.
func ValidSecret[T string | []byte](v T) bool {
	if len(v) != SecretLen {
		return false
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// HashHex is the hex SHA-256 of s: what the buckets store instead of a
// session id or a token.
func HashHex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// NewToken mints a bearer token for user. The user name is part of the
// token ("<user>.<secret>") so a token alone identifies its account.
func NewToken(user string) string { return user + "." + NewSecret() }

// TokenUser returns the account a token claims to belong to.
func TokenUser(token string) (string, bool) {
	user, secret, ok := strings.Cut(token, ".")
	if !ok || len(secret) != SecretLen || ValidateUser(user) != nil {
		return "", false
	}
	return user, true
}

// TokenMatches compares a token with a stored hash in constant time.
func TokenMatches(token, storedHash string) bool {
	if storedHash == "" {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(HashHex(token)), []byte(storedHash)) == 1
}

// NewAPIToken mints user's API token called name: "<user>.<name>.<secret>",
// so the token names its record, and no account token (two parts) is ever
// read as one.
func NewAPIToken(user, name string) string { return user + "." + name + "." + NewSecret() }

// ParseAPIToken returns the user and name an API token claims.
func ParseAPIToken(token string) (user, name string, ok bool) {
	parts := strings.SplitN(token, ".", 3)
	if len(parts) != 3 || len(parts[2]) != SecretLen || ValidateUser(parts[0]) != nil || ValidateTokenName(parts[1]) != nil {
		return "", "", false
	}
	return parts[0], parts[1], true
}

// NewAnswerID names one command's answer in the requests bucket: random,
// as a requester must not find another's answer.
func NewAnswerID() string { return NewSecret()[:22] }
