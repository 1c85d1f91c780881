package ident

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"sync/atomic"
)

// HeaderRequestID carries a request's id: from a trusted ingress, and
// back to the browser on every answer.
const HeaderRequestID = "X-Request-Id"

// MaxRequestID bounds an ingress's id (ingress-nginx sends 32 hex
// digits, Envoy a 36-character UUID), and so every request id.
const MaxRequestID = 64

// Request ids are a random per-process prefix and a counter: unique across
// replicas without a random draw per request.
var (
	requestPrefix = func() string {
		b := make([]byte, 4)
		_, _ = rand.Read(b)
		return hex.EncodeToString(b) + "-"
	}()
	requestCounter atomic.Uint64
)

// NewRequestID is a fresh id for a request no trusted ingress named.
func NewRequestID() string { return string(AppendRequestID(nil, nil)) }

// AppendRequestID appends a request's id to b without allocating: a
// trusted ingress's id if it is a valid one (ValidRequestID), else a
// fresh one.
func AppendRequestID(b, ingress []byte) []byte {
	if ValidRequestID(ingress) {
		return append(b, ingress...)
	}
	b = append(b, requestPrefix...)
	return strconv.AppendUint(b, requestCounter.Add(1), 10)
}

// ValidRequestID accepts what ingresses send (hex, UUIDs, base64url) and
// nothing a log line or a header could be bent by: it may be a client's
// own value that the ingress passed on.
func ValidRequestID[T string | []byte](s T) bool {
	if len(s) == 0 || len(s) > MaxRequestID {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch b := s[i]; {
		case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9', b == '-', b == '_', b == '.':
		default:
			return false
		}
	}
	return true
}

// AdoptRequestID is a trusted ingress's request id if it is a valid one,
// else a fresh one.
func AdoptRequestID(id string) string {
	if ValidRequestID(id) {
		return id
	}
	return NewRequestID()
}

type requestIDKey struct{}

// WithRequestID is ctx carrying a request's id: commands published under
// it quote the id, so lifecycle's and the broker's lines name it too.
func WithRequestID(ctx context.Context, id string) context.Context {
	if id == "" {
		return ctx
	}
	return context.WithValue(ctx, requestIDKey{}, id)
}

// IsRequestIDKey reports whether key is the one RequestIDOf asks a
// context for: a context of its own making (the edge's request scope)
// answers it with its id.
func IsRequestIDKey(key any) bool {
	_, ok := key.(requestIDKey)
	return ok
}

// RequestIDOf is the request id ctx carries ("" for none).
func RequestIDOf(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}
