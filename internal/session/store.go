package session

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/kv"
)

// Store keeps sessions in the shared bucket under <user>.<sha256(sid)>;
// the sid itself never leaves the browser's cookie. Every edge holds a
// watch cache indexed by the raw hash, so authenticating a request is a
// hash and a map read, and a revocation anywhere reaches every edge.
type Store struct {
	bucket *kv.Bucket[kv.Session]
	cache  *kv.Cache[kv.Session]
	ttl    time.Duration
}

// NewStore opens the sessions bucket and starts its cache.
func NewStore(ctx context.Context, js jetstream.JetStream, ttl time.Duration, log *slog.Logger) (*Store, error) {
	b, err := kv.Open[kv.Session](ctx, js, kv.BucketSessions)
	if err != nil {
		return nil, err
	}
	c, err := kv.NewCache(ctx, b, ">", log, kv.IndexBy[kv.Session](rawHash))
	if err != nil {
		return nil, err
	}
	return &Store{bucket: b, cache: c, ttl: ttl}, nil
}

// rawHash turns "<user>.<hex hash>" into the 32 raw hash bytes.
func rawHash(key string) string {
	_, h, _ := strings.Cut(key, ".")
	raw, err := hex.DecodeString(h)
	if err != nil {
		return key
	}
	return string(raw)
}

// Synced reports whether the cache holds every session.
func (s *Store) Synced() bool { return s.cache.IsSynced() }

// Create starts a session for user and returns its id once this edge's
// cache holds it, so the browser's next request (often the redirect that
// follows) is already authenticated here.
func (s *Store) Create(ctx context.Context, user, via string) (string, error) {
	sid := NewSessionID()
	now := time.Now().UTC()
	key := kv.SessionKey(user, HashHex(sid))
	rev, err := s.bucket.Create(ctx, key, kv.Session{User: user, Created: now, Expires: now.Add(s.ttl), Via: via}, kv.WithTTL(s.ttl))
	if err != nil {
		return "", fmt.Errorf("create session: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, _, err := s.cache.Wait(wctx, rawHash(key), func(e kv.Entry[kv.Session], ok bool) bool { return ok && e.Revision >= rev }); err != nil {
		return "", fmt.Errorf("create session: not visible in the cache: %w", err)
	}
	return sid, nil
}

// Lookup resolves a session id from the local cache. It allocates nothing
// for ids of the right shape and refuses expired sessions even before
// their key expires on the server.
func (s *Store) Lookup(sid []byte) (kv.Session, bool) {
	if !validSID(sid) {
		return kv.Session{}, false
	}
	sum := sha256.Sum256(sid)
	e, ok := s.cache.GetBytes(sum[:])
	if !ok || !time.Now().Before(e.Value.Expires) {
		return kv.Session{}, false
	}
	return e.Value, true
}

// Revoke ends one session.
func (s *Store) Revoke(ctx context.Context, user, sid string) error {
	return s.bucket.Purge(ctx, kv.SessionKey(user, HashHex(sid)))
}

// RevokeAll ends every session of user.
func (s *Store) RevokeAll(ctx context.Context, user string) error {
	_, err := s.bucket.PurgePrefix(ctx, user)
	return err
}

// Len is the number of cached sessions.
func (s *Store) Len() int { return s.cache.Len() }

// Limiter is the auth rate limit shared by every edge: a sliding log of
// attempt times per client in the ratelimit bucket, so a client gets
// AUTH_RATE_LIMIT attempts in any AUTH_RATE_WINDOW, however many edges it
// spreads them over and wherever the window starts. (Fixed windows would let
// a client spend two budgets back to back across a boundary.)
type Limiter struct {
	bucket *kv.Bucket[kv.Attempts]
	limit  int
	window time.Duration
}

// NewLimiter opens the ratelimit bucket.
func NewLimiter(ctx context.Context, js jetstream.JetStream, limit int, window time.Duration) (*Limiter, error) {
	b, err := kv.Open[kv.Attempts](ctx, js, kv.BucketRateLimit)
	if err != nil {
		return nil, err
	}
	return &Limiter{bucket: b, limit: limit, window: window}, nil
}

// Allow records an attempt by client if it is within the limit. A refused
// attempt is not recorded, and the duration says when the attempt that
// blocks it leaves the window, so a client that waits that long gets in.
func (l *Limiter) Allow(ctx context.Context, client string) (bool, time.Duration, error) {
	now := time.Now()
	since := now.Add(-l.window).UnixMilli()
	var (
		ok    bool
		retry time.Duration
	)
	_, err := l.bucket.Mutate(ctx, HashHex(client)[:32], func(a kv.Attempts, _ bool) (kv.Attempts, bool, error) {
		recent := slices.DeleteFunc(a.At, func(at int64) bool { return at <= since })
		// Edges' clocks differ a little, so the log is not assumed sorted.
		slices.Sort(recent)
		if ok = len(recent) < l.limit; !ok {
			retry = time.UnixMilli(recent[len(recent)-l.limit]).Add(l.window).Sub(now)
			return kv.Attempts{}, false, nil
		}
		return kv.Attempts{At: append(recent, now.UnixMilli())}, true, nil
	}, kv.WithTTL(l.window))
	if err != nil {
		return false, 0, fmt.Errorf("rate limit: %w", err)
	}
	return ok, retry, nil
}
