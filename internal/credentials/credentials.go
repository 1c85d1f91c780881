// Package credentials seals the provider keys users bring (BYOK) so that
// only a broker can open them. An edge seals a key to the brokers' public
// key (CREDENTIALS_PUBLIC_KEY) with an anonymous NaCl box; the brokers
// open it with their ring of private keys (CREDENTIALS_KEYS, newest
// first, so a key can be rotated in). The sealed plaintext names the user
// and the provider as well as the key, and Open checks them against the
// record: a sealed value copied into another user's record, or another
// provider's, opens to an error, never to a key someone else brought.
package credentials

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"golang.org/x/crypto/curve25519"
	"golang.org/x/crypto/nacl/box"

	"github.com/aaas-project/aaas/internal/state"
)

// Bounds of a key a user brings. Providers' keys are some tens to a few
// hundred printable characters; the floor keeps the hint (its last four)
// a small part of it.
const (
	MinKeyLen = 8
	MaxKeyLen = 1024
)

// Errors of Seal and Open.
var (
	// ErrBadKey is a provider key outside the bounds or with a character
	// that is not printable ASCII (it goes into an HTTP header).
	ErrBadKey = fmt.Errorf("a provider key is %d to %d printable characters without spaces", MinKeyLen, MaxKeyLen)
	// ErrUnknownKey: the record was sealed to a key not in the ring.
	ErrUnknownKey = errors.New("credential sealed to a key this ring does not hold")
	// ErrUnseal: the sealed bytes do not open (altered, truncated, or
	// sealed to another key under the same id).
	ErrUnseal = errors.New("credential does not open")
	// ErrMismatch: the sealed key belongs to another user or provider
	// than the record names.
	ErrMismatch = errors.New("credential was sealed for another user or provider")
)

// plaintext is what is sealed: the key and whose it is.
type plaintext struct {
	User     string `json:"user"`
	Provider string `json:"provider"`
	Key      string `json:"key"`
}

// KeyPair is an X25519 key pair of the ring.
type KeyPair struct {
	Public, Private [32]byte
}

// Generate makes a key pair from crypto/rand.
func Generate() (KeyPair, error) {
	pub, priv, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return KeyPair{}, err
	}
	return KeyPair{Public: *pub, Private: *priv}, nil
}

// Env is the pair as the settings an operator installs: the private key
// for the brokers' ring, the public key for the edges.
func (k KeyPair) Env() string {
	return "CREDENTIALS_KEYS=" + base64.StdEncoding.EncodeToString(k.Private[:]) + "\n" +
		"CREDENTIALS_PUBLIC_KEY=" + base64.StdEncoding.EncodeToString(k.Public[:]) + "\n"
}

// WriteKeygen writes a new key pair's settings to w (cmd/setup
// credentials-keygen).
func WriteKeygen(w io.Writer) error {
	k, err := Generate()
	if err != nil {
		return err
	}
	_, err = io.WriteString(w, k.Env())
	return err
}

// KeyID names a public key in records: the first 8 bytes of its SHA-256,
// in hex.
func KeyID(pub []byte) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// ValidKey reports whether key may be stored (ErrBadKey otherwise).
func ValidKey(key string) error {
	if len(key) < MinKeyLen || len(key) > MaxKeyLen {
		return ErrBadKey
	}
	for i := 0; i < len(key); i++ {
		if key[i] <= ' ' || key[i] > '~' {
			return ErrBadKey
		}
	}
	return nil
}

// Seal seals user's key for provider to the public key pub (32 bytes), as
// the record the credentials bucket holds under
// state.CredentialKey(user, provider). Its Set is now.
func Seal(pub []byte, user, provider, key string) (state.Credential, error) {
	if len(pub) != 32 {
		return state.Credential{}, fmt.Errorf("a public key is 32 bytes, not %d", len(pub))
	}
	if err := ValidKey(key); err != nil {
		return state.Credential{}, err
	}
	msg, err := json.Marshal(plaintext{User: user, Provider: provider, Key: key})
	if err != nil {
		return state.Credential{}, err
	}
	var p [32]byte
	copy(p[:], pub)
	sealed, err := box.SealAnonymous(nil, msg, &p, rand.Reader)
	if err != nil {
		return state.Credential{}, err
	}
	return state.Credential{
		User: user, Provider: provider, Sealed: sealed, KeyID: KeyID(pub),
		Hint: key[len(key)-4:], Set: time.Now().UTC(),
	}, nil
}

// Ring opens credentials with the brokers' private keys.
type Ring struct {
	keys []ringKey
}

type ringKey struct {
	id        string
	pub, priv [32]byte
}

// NewRing is the ring of private keys (32 bytes each, newest first, as
// config.Broker.CredentialKeys holds them).
func NewRing(privs ...[]byte) (*Ring, error) {
	if len(privs) == 0 {
		return nil, errors.New("a credentials ring needs at least one key")
	}
	r := &Ring{}
	for i, k := range privs {
		if len(k) != 32 {
			return nil, fmt.Errorf("credentials key %d is %d bytes, not 32", i+1, len(k))
		}
		pub, err := curve25519.X25519(k, curve25519.Basepoint)
		if err != nil {
			return nil, fmt.Errorf("credentials key %d: %w", i+1, err)
		}
		var rk ringKey
		copy(rk.priv[:], k)
		copy(rk.pub[:], pub)
		rk.id = KeyID(pub)
		r.keys = append(r.keys, rk)
	}
	return r, nil
}

// PublicKey is the public key of the ring's newest key: the edges'
// CREDENTIALS_PUBLIC_KEY.
func (r *Ring) PublicKey() []byte { return bytes.Clone(r.keys[0].pub[:]) }

// Open returns the key sealed in c, after checking that it was sealed for
// c's user and provider.
func (r *Ring) Open(c state.Credential) (string, error) {
	for i := range r.keys {
		k := &r.keys[i]
		if k.id != c.KeyID {
			continue
		}
		msg, ok := box.OpenAnonymous(nil, c.Sealed, &k.pub, &k.priv)
		if !ok {
			return "", ErrUnseal
		}
		var p plaintext
		if err := json.Unmarshal(msg, &p); err != nil {
			return "", ErrUnseal
		}
		if p.User != c.User || p.Provider != c.Provider {
			return "", ErrMismatch
		}
		if ValidKey(p.Key) != nil {
			return "", ErrUnseal
		}
		return p.Key, nil
	}
	return "", ErrUnknownKey
}
