package credentials

import (
	"crypto/rand"
	"testing"

	"golang.org/x/crypto/nacl/box"

	"github.com/aaas-project/aaas/internal/state"
)

// randReader is crypto/rand for box calls that take a reader.
type randReader struct{}

func (randReader) Read(p []byte) (int, error) { return rand.Read(p) }

// FuzzOpen: whatever bytes a record holds (the bucket is written by
// edges; a broker opens what it finds), and whatever plaintext is sealed
// to the right key, Open never panics, and a key it returns is one a
// header can carry, sealed for the record's own user and provider.
func FuzzOpen(f *testing.F) {
	k, err := Generate()
	if err != nil {
		f.Fatal(err)
	}
	r, err := NewRing(k.Private[:])
	if err != nil {
		f.Fatal(err)
	}
	good, err := Seal(k.Public[:], "ann", "openai", annKey)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good.Sealed, []byte(`{"user":"ann","provider":"openai","key":"sk-0123456789"}`))
	f.Add([]byte{}, []byte(`{"user":"bob","provider":"openai","key":"sk-0123456789"}`))
	f.Add(good.Sealed[:box.AnonymousOverhead], []byte(`{"key":"sk\u000d\u000a0123456789"}`))
	f.Fuzz(func(t *testing.T, sealed, plain []byte) {
		check := func(c state.Credential) {
			key, err := r.Open(c)
			if err != nil {
				return
			}
			if ValidKey(key) != nil {
				t.Fatalf("opened a key a header cannot carry: %q", key)
			}
		}
		check(state.Credential{User: "ann", Provider: "openai", Sealed: sealed, KeyID: good.KeyID})
		s, err := box.SealAnonymous(nil, plain, &k.Public, randReader{})
		if err != nil {
			t.Fatal(err)
		}
		c := state.Credential{User: "ann", Provider: "openai", Sealed: s, KeyID: good.KeyID}
		check(c)
		if _, err := r.Open(state.Credential{User: "bob", Provider: "openai", Sealed: s, KeyID: good.KeyID}); err == nil {
			if _, err2 := r.Open(c); err2 == nil {
				t.Fatal("one sealed value opened for two users")
			}
		}
	})
}
