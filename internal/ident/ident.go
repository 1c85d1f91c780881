// Package ident holds the formats every process agrees on: account,
// API token and profile names, ADMIN_USERS entries, the shape of secrets
// (session ids, bearer tokens, sign-in codes) and their hashes, request
// ids, and the host names and proxy addresses of the edge's
// configuration. It is a leaf: it imports nothing of ours and no HTTP
// framework, so lifecycle, the broker, the sweeper and config check names
// without linking the edge's server.
package ident

import (
	"errors"
	"regexp"
	"strings"
)

var (
	nameRE   = regexp.MustCompile(`^[a-z][a-z0-9-]*[a-z0-9]$`)
	reserved = map[string]bool{
		"admin": true, "root": true, "system": true, "api": true, "static": true, "login": true, "logout": true,
		"users": true, "recreate": true, "healthz": true, "readyz": true, "metrics": true, "pool": true,
	}
)

// MaxUserLen keeps "dsh-<user>" within Kubernetes' 63-character names with
// room for the controller's suffixes.
const MaxUserLen = 32

// ErrBadName explains what account names may look like.
var ErrBadName = errors.New("user names are 2-32 characters: lowercase letters, digits and single hyphens, starting with a letter and ending with a letter or digit; not reserved and not starting with \"dsh\"")

// ValidateUser checks an account name. Names become Kubernetes object
// names (dsh-<user>), NATS subject tokens and KV keys, so only a narrow
// ASCII alphabet is allowed (which also rules out look-alike characters).
func ValidateUser(name string) error {
	switch {
	case len(name) < 2 || len(name) > MaxUserLen,
		!nameRE.MatchString(name),
		strings.Contains(name, "--"),
		strings.HasPrefix(name, "dsh"),
		reserved[name]:
		return ErrBadName
	}
	return nil
}

// ValidUser is ValidateUser as a predicate.
func ValidUser(name string) bool { return ValidateUser(name) == nil }

// SSOName maps a sign-in provider's login to an account name. Logins are
// case-insensitive at the providers we front (GitHub, OIDC usernames), so
// the name is the lowercased login when that fits the account grammar.
// Anything else (dots, underscores, a reserved word, a "dsh" prefix, too
// long) is mapped deterministically, not refused: the letters and digits
// that survive, hyphenated, plus six hex digits of the login's hash, so two
// logins that differ only in what was dropped get different accounts.
func SSOName(login string) string {
	l := strings.ToLower(strings.TrimSpace(login))
	if ValidateUser(l) == nil {
		return l
	}
	var b strings.Builder
	dash := false
	for _, r := range l {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
			dash = false
		} else if !dash && b.Len() > 0 {
			b.WriteByte('-')
			dash = true
		}
	}
	base := strings.Trim(b.String(), "-")
	// Room for "-" and six hex digits; a name starts with a letter and
	// never with "dsh".
	switch {
	case base == "":
		base = "u"
	case base[0] < 'a' || base[0] > 'z' || strings.HasPrefix(base, "dsh"):
		base = "u-" + base
	}
	if max := MaxUserLen - 7; len(base) > max {
		base = strings.TrimRight(base[:max], "-")
	}
	return base + "-" + HashHex(l)[:6]
}

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

// MaxProfileLen bounds a profile's name: it is written on claims (an
// annotation) and shown on pages.
const MaxProfileLen = 32

// ErrBadProfile says what a profile's name may be.
var ErrBadProfile = errors.New("a profile name is 2 to 32 lowercase letters, digits and single hyphens, starting with a letter and ending with a letter or digit")

// ValidateProfile checks a profile's name (PROFILES, and the one a user
// or a command names). The account grammar's alphabet, and no "--",
// which named sandboxes' hosts will use as a separator.
func ValidateProfile(name string) error {
	if len(name) < 2 || len(name) > MaxProfileLen || !nameRE.MatchString(name) || strings.Contains(name, "--") {
		return ErrBadProfile
	}
	return nil
}

// A sandbox key is the name a sandbox goes by in every bucket, subject,
// claim and origin. An account's first sandbox, the one every account
// made before named sandboxes has, goes by the account's name, so none
// of its records, claim or URL moves. A named sandbox goes by
// "<user>--<name>": no account name holds "--" (ValidateUser) and no
// sandbox name does, so a key splits one way only and is never an
// account's name, and a key starts with a letter, so it is never a
// preview's "<port>-<key>". The key is one DNS label: "dsh-<key>" is
// its claim's name and "<key>.<SANDBOX_DOMAIN>" its origin.
const sandboxSep = "--"

// MaxSandboxNameLen bounds a named sandbox's name, so that its claim,
// "dsh-<user>--<name>", stays within a DNS label's 63 characters (58 at
// most), and its preview origins, "<port>-<user>--<name>", too.
const MaxSandboxNameLen = 20

// ErrBadSandboxName says what a sandbox's name may be.
var ErrBadSandboxName = errors.New("a sandbox name is 1 to 20 lowercase letters, digits and single hyphens, starting with a letter and ending with a letter or digit")

var sandboxNameRE = regexp.MustCompile(`^[a-z]([a-z0-9-]*[a-z0-9])?$`)

// ValidateSandboxName checks the name a user gives a sandbox of theirs.
func ValidateSandboxName(name string) error {
	if len(name) > MaxSandboxNameLen || !sandboxNameRE.MatchString(name) || strings.Contains(name, sandboxSep) {
		return ErrBadSandboxName
	}
	return nil
}

// SandboxKey is the key of user's sandbox name; "" names the account's
// first sandbox, whose key is the account's name.
func SandboxKey(user, name string) string {
	if name == "" {
		return user
	}
	return user + sandboxSep + name
}

// SplitSandboxKey reads a sandbox key as its owner's account name and the
// sandbox's name ("" for the account's first sandbox); ok is false for
// anything no account's sandbox can be called.
func SplitSandboxKey(key string) (user, name string, ok bool) {
	user, name, _ = strings.Cut(key, sandboxSep)
	if ValidateUser(user) != nil || name != "" && ValidateSandboxName(name) != nil || name == "" && len(user) != len(key) {
		return "", "", false
	}
	return user, name, true
}

// ValidSandboxKey reports whether key is some account's sandbox key.
func ValidSandboxKey(key string) bool {
	_, _, ok := SplitSandboxKey(key)
	return ok
}

// OwnerOf is the account a sandbox key belongs to; "" for a string that
// is no sandbox key, which owns nothing and matches no account.
func OwnerOf(key string) string {
	user, _, _ := SplitSandboxKey(key)
	return user
}

// Admin is an ADMIN_USERS entry: an account name and the identity its
// administrator's rights are bound to, the account's token hash (the hex
// SHA-256 of its bearer token, or of an SSO account's binding). A name
// alone confers nothing: whoever signs up under it later, or takes it
// before its administrator does, holds another identity.
type Admin struct {
	Name, Identity string
}

// ErrBadAdmin explains what an ADMIN_USERS entry looks like.
var ErrBadAdmin = errors.New(`an entry is <account>:<its identity>, the 64 hex digits of the SHA-256 of the account's token (or of its SSO binding): admin rights bind to the account, not to a name anyone could sign up under`)

// ParseAdmin reads an ADMIN_USERS entry, "<account>:<identity>".
func ParseAdmin(entry string) (Admin, error) {
	name, identity, ok := strings.Cut(strings.TrimSpace(entry), ":")
	identity = strings.ToLower(identity)
	if !ok || !hexHashRE.MatchString(identity) {
		return Admin{}, ErrBadAdmin
	}
	if err := ValidateUser(name); err != nil {
		return Admin{}, err
	}
	return Admin{Name: name, Identity: identity}, nil
}

var hexHashRE = regexp.MustCompile(`^[0-9a-f]{64}$`)
