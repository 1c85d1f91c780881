package handshake

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
)

// KeySize is the AES-256 key length.
const KeySize = 32

// ParseKey decodes a 32-byte key given as base64 (standard or URL-safe,
// padded or not) or hex.
func ParseKey(s string) ([]byte, error) {
	for _, dec := range []func(string) ([]byte, error){
		base64.StdEncoding.DecodeString, base64.RawStdEncoding.DecodeString,
		base64.URLEncoding.DecodeString, base64.RawURLEncoding.DecodeString, hex.DecodeString,
	} {
		if k, err := dec(s); err == nil && len(k) == KeySize {
			return k, nil
		}
	}
	return nil, fmt.Errorf("want %d bytes as base64 or hex", KeySize)
}

// Sealer encrypts DSH auth cookies with AES-GCM under a key ring. The
// additional data (the bucket key the value is stored under) binds each
// ciphertext to its key, so a value copied under another user's key does
// not open. The first key seals; any key of the ring opens, so keys rotate
// without a moment in which one replica cannot read what another wrote.
type Sealer struct{ aeads []cipher.AEAD }

// NewSealer returns a Sealer for a ring of 32-byte keys, newest first.
func NewSealer(keys ...[]byte) (*Sealer, error) {
	if len(keys) == 0 {
		return nil, errors.New("handshake key: none given")
	}
	s := &Sealer{}
	for i, key := range keys {
		if len(key) != KeySize {
			return nil, fmt.Errorf("handshake key %d: want %d bytes, got %d", i+1, KeySize, len(key))
		}
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("handshake key %d: %w", i+1, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("handshake key %d: %w", i+1, err)
		}
		s.aeads = append(s.aeads, aead)
	}
	return s, nil
}

// Seal encrypts plaintext bound to ad with the newest key; the nonce is
// prepended.
func (s *Sealer) Seal(plaintext, ad []byte) []byte {
	aead := s.aeads[0]
	nonce := make([]byte, aead.NonceSize(), aead.NonceSize()+len(plaintext)+aead.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		panic("crypto/rand failed: " + err.Error())
	}
	return aead.Seal(nonce, nonce, plaintext, ad)
}

// ErrUnseal means the value was not sealed with any key of the ring for
// this ad.
var ErrUnseal = errors.New("sealed value does not open with any handshake key")

// Open decrypts a value produced by Seal, with any key of the ring, for
// the same ad.
func (s *Sealer) Open(sealed, ad []byte) ([]byte, error) {
	for _, aead := range s.aeads {
		n := aead.NonceSize()
		if len(sealed) < n+aead.Overhead() {
			return nil, ErrUnseal
		}
		if out, err := aead.Open(nil, sealed[:n], sealed[n:], ad); err == nil {
			return out, nil
		}
	}
	return nil, ErrUnseal
}
