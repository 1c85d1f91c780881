package credentials

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"
	"testing"

	"golang.org/x/crypto/nacl/box"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/state"
)

func pair(t testing.TB) KeyPair {
	t.Helper()
	k, err := Generate()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func ring(t testing.TB, keys ...KeyPair) *Ring {
	t.Helper()
	var privs [][]byte
	for _, k := range keys {
		privs = append(privs, bytes.Clone(k.Private[:]))
	}
	r, err := NewRing(privs...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

const annKey = "sk-ann-0123456789abcdef"

func TestSealOpen(t *testing.T) {
	newest, older, stranger := pair(t), pair(t), pair(t)
	r := ring(t, newest, older)
	if !bytes.Equal(r.PublicKey(), newest.Public[:]) {
		t.Fatal("the ring's public key is not its newest key's")
	}
	ann, err := Seal(newest.Public[:], "ann", "openai", annKey)
	if err != nil {
		t.Fatal(err)
	}
	if ann.Hint != "cdef" || ann.KeyID != KeyID(newest.Public[:]) || ann.User != "ann" || ann.Provider != "openai" || ann.Set.IsZero() {
		t.Fatalf("record %+v", ann)
	}
	if bytes.Contains(ann.Sealed, []byte(annKey)) || bytes.Contains(ann.Sealed, []byte("0123456789")) {
		t.Fatal("the key is readable in the sealed bytes")
	}
	byOlder, err := Seal(older.Public[:], "ann", "openai", annKey)
	if err != nil {
		t.Fatal(err)
	}
	bob, err := Seal(newest.Public[:], "bob", "openai", "sk-bob-0123456789abcdef")
	if err != nil {
		t.Fatal(err)
	}
	moved := func(c state.Credential, user, provider string) state.Credential {
		c.User, c.Provider = user, provider
		return c
	}
	swapped := bob
	swapped.Sealed = ann.Sealed // ann's sealed key in bob's record
	truncated := ann
	truncated.Sealed = ann.Sealed[:len(ann.Sealed)-1]
	flipped := ann
	flipped.Sealed = bytes.Clone(ann.Sealed)
	flipped.Sealed[len(flipped.Sealed)/2] ^= 1
	mislabelled := ann
	mislabelled.KeyID = KeyID(older.Public[:])

	for _, tc := range []struct {
		name string
		r    *Ring
		c    state.Credential
		want string
		err  error
	}{
		{"newest key", r, ann, annKey, nil},
		{"older key still in the ring", r, byOlder, annKey, nil},
		{"another user's record", r, bob, "sk-bob-0123456789abcdef", nil},
		{"record moved to another user", r, moved(ann, "bob", "openai"), "", ErrMismatch},
		{"record moved to another provider", r, moved(ann, "ann", "anthropic"), "", ErrMismatch},
		{"sealed bytes swapped between records", r, swapped, "", ErrMismatch},
		{"wrong ring", ring(t, stranger), ann, "", ErrUnknownKey},
		{"ring without the older key", ring(t, newest), byOlder, "", ErrUnknownKey},
		{"truncated", r, truncated, "", ErrUnseal},
		{"empty", r, moved(state.Credential{KeyID: ann.KeyID}, "ann", "openai"), "", ErrUnseal},
		{"a bit flipped", r, flipped, "", ErrUnseal},
		{"labelled with another key of the ring", r, mislabelled, "", ErrUnseal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.r.Open(tc.c)
			if !errors.Is(err, tc.err) || got != tc.want {
				t.Fatalf("Open = %q, %v; want %q, %v", got, err, tc.want, tc.err)
			}
		})
	}
}

// What the edge refuses to seal: keys a header could not carry, or too
// short for the hint to be a small part, or too long; public keys of
// another length.
func TestSealRefuses(t *testing.T) {
	k := pair(t)
	for _, key := range []string{"", "short", "sk-with space-0123", "sk-0123456789\r\nX-Evil: 1", "sk-0123456789\x00", "sk-ключ-0123456789", strings.Repeat("k", MaxKeyLen+1)} {
		if _, err := Seal(k.Public[:], "ann", "openai", key); !errors.Is(err, ErrBadKey) {
			t.Errorf("key %.40q: %v, want ErrBadKey", key, err)
		}
	}
	if _, err := Seal(k.Public[:], "ann", "openai", strings.Repeat("k", MaxKeyLen)); err != nil {
		t.Errorf("longest key refused: %v", err)
	}
	if _, err := Seal(k.Public[:31], "ann", "openai", annKey); err == nil {
		t.Error("a 31-byte public key accepted")
	}
	if _, err := NewRing(); err == nil {
		t.Error("an empty ring accepted")
	}
	if _, err := NewRing(make([]byte, 31)); err == nil {
		t.Error("a 31-byte private key accepted")
	}
}

// A sealed plaintext that is not what an edge writes (not JSON, a key a
// header cannot carry) does not open, even under the right key.
func TestOpenRefusesForeignPlaintext(t *testing.T) {
	k := pair(t)
	r := ring(t, k)
	for _, msg := range []string{"sk-ann-0123456789abcdef", `{"user":"ann","provider":"openai"}`, `{"user":"ann","provider":"openai","key":"sk-0123456789\r\nX: y"}`} {
		sealed, err := box.SealAnonymous(nil, []byte(msg), &k.Public, randReader{})
		if err != nil {
			t.Fatal(err)
		}
		c := state.Credential{User: "ann", Provider: "openai", Sealed: sealed, KeyID: KeyID(k.Public[:])}
		if got, err := r.Open(c); !errors.Is(err, ErrUnseal) {
			t.Errorf("plaintext %q: %q, %v", msg, got, err)
		}
	}
}

// The generated settings are what config reads: the private key as the
// brokers' ring, the public key as the edges' CREDENTIALS_PUBLIC_KEY.
func TestKeygenSettingsLoad(t *testing.T) {
	var out bytes.Buffer
	if err := WriteKeygen(&out); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		k, v, _ := strings.Cut(line, "=")
		env[k] = v
	}
	pub, err := base64.StdEncoding.DecodeString(env["CREDENTIALS_PUBLIC_KEY"])
	if err != nil || len(pub) != 32 {
		t.Fatalf("public key %q: %v", env["CREDENTIALS_PUBLIC_KEY"], err)
	}
	b, err := config.LoadBroker(config.FromMap(map[string]string{
		"BROKER_PROVIDERS": `[{"name":"openai","api":"openai","base_url":"https://api.openai.com/v1","models":["gpt-4o"]}]`,
		"BROKER_BYOK":      "true", "CREDENTIALS_KEYS": env["CREDENTIALS_KEYS"], "NATS_ALLOW_ANONYMOUS": "true",
	}))
	if err != nil {
		t.Fatal(err)
	}
	r, err := NewRing(b.CredentialKeys...)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(r.PublicKey(), pub) {
		t.Fatal("the printed public key is not the private key's")
	}
	c, err := Seal(pub, "ann", "openai", annKey)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := r.Open(c); err != nil || got != annKey {
		t.Fatalf("Open = %q, %v", got, err)
	}
}
