package auth

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/singleflight"
	"golang.org/x/time/rate"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Store keeps sessions in the shared bucket under <user>.<sha256(sid)>;
// the sid itself never leaves the browser's cookie. Each edge holds the
// sessions it has seen used, in a bounded cache indexed by the raw hash
// (kv.Bounded): authenticating a request it has served before is a hash
// and a map read, a revocation anywhere reaches every edge that holds the
// session, and what an edge holds grows with the users it serves, not
// with every session ever made. A session it does not hold is read from
// the bucket once (Fetch): a cookie beside the session's names its user
// (UserCookie), so the read is of one key.
type Store struct {
	bucket   *kv.Bucket[state.Session]
	cache    *kv.Cache[state.Session]
	ttl      time.Duration
	max      int
	log      *slog.Logger
	onRevoke func(user string)

	// now is the clock of Fetch's budgets and miss memory (StoreOptions).
	now func() time.Time
	// fetches bounds Fetch's bucket reads; flights joins the reads of one
	// key made at once; misses remembers keys they did not find, so a
	// stale or random cookie costs at most one read per missTTL.
	fetches *fetchBudget
	flights singleflight.Group
	missMu  sync.Mutex
	misses  map[string]time.Time // by key
	swept   time.Time            // when misses was last rid of faded entries
}

// Fetch's bounds: bucket reads per second and burst, for the edge and for
// each client; how many clients are told apart before the rest share one
// budget; how long a miss is remembered and how many are; and how long
// one read may take before the request is told to retry. A client's rate
// is a twentieth of the edge's, so no one client can spend what a session
// just created elsewhere needs; the misses that can be live at once
// (fetchRate*missTTL+fetchBurst) fit maxMisses many times over.
const (
	fetchRate       = 200
	fetchBurst      = 50
	clientRate      = 10
	clientBurst     = 20
	maxFetchClients = 4096
	missTTL         = 2 * time.Second
	maxMisses       = 4096
	fetchTimeout    = 5 * time.Second
)

// StoreOptions configure a Store.
type StoreOptions struct {
	// TTL is a session's lifetime; MaxPerUser how many one user may hold
	// (a new one ends the oldest).
	TTL        time.Duration
	MaxPerUser int
	// Limit is how many sessions the cache holds at most.
	Limit int
	// OnRevoke, if set, runs (in the watch goroutine) with the user
	// whenever a session this edge holds ends, here or on another edge.
	OnRevoke func(user string)
	Log      *slog.Logger
	// Now, if set, is the clock of Fetch's budgets and miss memory (tests
	// move it by hand); time.Now otherwise.
	Now func() time.Time
}

// NewStore opens the sessions bucket and starts its cache.
func NewStore(ctx context.Context, js jetstream.JetStream, o StoreOptions) (*Store, error) {
	b, err := kv.Open[state.Session](ctx, js, state.BucketSessions)
	if err != nil {
		return nil, err
	}
	now := o.Now
	if now == nil {
		now = time.Now
	}
	s := &Store{bucket: b, ttl: o.TTL, max: o.MaxPerUser, log: o.Log, onRevoke: o.OnRevoke,
		now: now, fetches: newFetchBudget(), misses: map[string]time.Time{}}
	c, err := kv.NewCache(ctx, b, ">", o.Log, kv.Bounded[state.Session](o.Limit), kv.IndexBy[state.Session](rawHash), kv.OnChange(s.changed))
	if err != nil {
		return nil, err
	}
	s.cache = c
	return s, nil
}

// changed tells OnRevoke of every held session that ends.
func (s *Store) changed(key string, _ kv.Entry[state.Session], deleted bool) {
	if deleted && s.onRevoke != nil {
		user, _, _ := strings.Cut(key, ".")
		s.onRevoke(user)
	}
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

// UserCookie is the name of the cookie that names a gateway session's
// user beside the session cookie name (which carries the id alone, as it
// always has, so a release before this one still reads it): an edge that
// does not hold the session reads the one key it names. It is no secret;
// under the __Host- prefix no other origin can set it, and a wrong one
// only fails the lookup.
func UserCookie(name string) string { return name + "_user" }

// Create starts a session for user and returns its id once this edge's
// cache holds it, so the browser's next request (often the redirect that
// follows) is already authenticated here. Sessions of user beyond the cap are ended,
// oldest first.
func (s *Store) Create(ctx context.Context, user, via string) (string, error) {
	sid := ident.NewSecret()
	now := time.Now().UTC()
	key := state.SessionKey(user, ident.HashHex(sid))
	sess := state.Session{User: user, Created: now, Expires: now.Add(s.ttl), Via: via}
	// The next request on this edge must find the session, even while the
	// watch lags (after a NATS node loss it may take the cache's watchdog
	// a few seconds to move it again).
	done := s.cache.Writing(key)
	rev, err := s.bucket.Create(ctx, key, sess, kv.WithTTL(s.ttl))
	done(sess, rev)
	if err != nil {
		return "", fmt.Errorf("create session: %w", err)
	}
	s.trim(ctx, user, key)
	return sid, nil
}

// CreateSandbox starts a sandbox origin's session for user on host, made
// from a gateway session (parent, the hex SHA-256 of its id) or an SSO
// binding (bound), ending when its parent does at the latest (expires).
// Like Create, it returns once this edge's cache holds it.
func (s *Store) CreateSandbox(ctx context.Context, user, host, parent, bound string, expires time.Time) (string, error) {
	sid := ident.NewSecret()
	now := time.Now().UTC()
	ttl := min(expires.Sub(now), s.ttl)
	if ttl <= 0 {
		return "", errors.New("create sandbox session: its parent has expired")
	}
	key := state.SessionKey(user, ident.HashHex(sid))
	sess := state.Session{User: user, Created: now, Expires: now.Add(ttl), Via: "sandbox", Host: host, Parent: parent, Bound: bound}
	done := s.cache.Writing(key)
	rev, err := s.bucket.Create(ctx, key, sess, kv.WithTTL(ttl))
	done(sess, rev)
	if err != nil {
		return "", fmt.Errorf("create sandbox session: %w", err)
	}
	return sid, nil
}

// trim ends user's oldest gateway sessions beyond the cap, never keep,
// as the bucket lists them (a sandbox origin's session lives and dies
// with its gateway session, so it neither counts nor is trimmed). Edges
// that trim at once purge the same keys, which is harmless.
func (s *Store) trim(ctx context.Context, user, keep string) {
	all, err := s.gatewaySessions(ctx, user)
	if err != nil {
		s.log.Warn("could not list a user's sessions to apply the per-user cap", "user", user, "err", err)
		return
	}
	all = slices.DeleteFunc(all, func(e kv.Entry[state.Session]) bool { return e.Key == keep })
	if extra := len(all) + 1 - s.max; extra > 0 {
		slices.SortFunc(all, func(a, b kv.Entry[state.Session]) int { return a.Value.Created.Compare(b.Value.Created) })
		for _, e := range all[:extra] {
			if err := s.bucket.Purge(ctx, e.Key); err != nil {
				s.log.Warn("could not end a session over the per-user cap", "user", user, "err", err)
			}
		}
	}
}

// gatewaySessions lists user's gateway sessions from the bucket.
func (s *Store) gatewaySessions(ctx context.Context, user string) ([]kv.Entry[state.Session], error) {
	all, err := s.bucket.List(ctx, state.SessionKey(user, "*"))
	return slices.DeleteFunc(all, func(e kv.Entry[state.Session]) bool { return e.Value.Host != "" }), err
}

// Count is how many gateway sessions each of users holds, as the bucket
// says, read at once.
func (s *Store) Count(ctx context.Context, users ...string) (map[string]int, error) {
	n := make(map[string]int, len(users))
	if len(users) == 0 {
		return n, nil
	}
	filters := make([]string, len(users))
	for i, u := range users {
		filters[i] = state.SessionKey(u, "*")
	}
	// One batched read, as costly as the sessions it finds (a watch with
	// a filter per user made the server look through every session: 2.5 s
	// for an admin page at a million accounts); a page whose users hold
	// more than one read returns takes the watch.
	all, err := s.bucket.LastOf(ctx, filters...)
	if errors.Is(err, kv.ErrTooMany) {
		all, err = s.bucket.List(ctx, filters...)
	}
	for _, e := range all {
		if e.Value.Host == "" {
			n[e.Value.User]++
		}
	}
	return n, err
}

// Lookup resolves a session id from the local cache. It allocates nothing
// for ids of the right shape and refuses expired sessions even before
// their key expires on the server.
func (s *Store) Lookup(sid []byte) (state.Session, bool) {
	if !ident.ValidSecret(sid) {
		return state.Session{}, false
	}
	return s.LookupSum(sha256.Sum256(sid))
}

// LookupSum is Lookup by the id's SHA-256: what a long-lived connection
// keeps to re-check its session without holding the id.
func (s *Store) LookupSum(sum [32]byte) (state.Session, bool) {
	e, ok := s.cache.GetBytes(sum[:])
	if !ok || !time.Now().Before(e.Value.Expires) {
		return state.Session{}, false
	}
	return e.Value, true
}

// Fetch is LookupSum, after it missed, for a session this edge's cache
// does not hold: read from the bucket under the user the request or the
// UserCookie names (keys are <user>.<hash>), and held from then on. A
// session created on another edge a moment ago, or one this edge has
// never served, works here at the price of one read. What is found is
// noted in the cache, which keeps it only while the watch is behind it,
// so a revocation the watch has already applied is never undone.
// A session cookie without its UserCookie (set by a release before this
// one), on a request that names no user (the gateway's own pages), cannot
// name the key: for it (user "") the session is looked for under any user
// (kv.Bucket.GetMatching), a dearer read the same budgets bound.
// Reads that find nothing are budgeted per client (httpguard.Key) and per
// edge, reads of one key at once are joined, and misses remembered for
// missTTL: random cookies cost the bus little, and only the client
// sending them loses its budget; a read that finds a session costs no
// budget. An error means the bucket could not be
// read (or the read budget is spent), not that there is no such session.
func (s *Store) Fetch(ctx context.Context, client, user string, sum [32]byte) (state.Session, bool, error) {
	key := state.SessionKey(user, hex.EncodeToString(sum[:]))
	switch {
	case user == "":
		key = state.SessionKey("*", hex.EncodeToString(sum[:]))
	case ident.ValidateUser(user) != nil:
		return state.Session{}, false, nil
	}
	if s.missed(key) {
		return state.Session{}, false, nil
	}
	// Detached from the first requester: the others wait for the same.
	_, err, _ := s.flights.Do(key, func() (any, error) {
		found, ok := s.fetches.allow(client, s.now())
		if !ok {
			return nil, errFetchBudget
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), fetchTimeout)
		defer cancel()
		read := s.bucket.Get
		if user == "" {
			read = s.bucket.GetMatching
		}
		_, ok, err := s.cache.LoadBy(ctx, string(sum[:]), func(ctx context.Context) (kv.Entry[state.Session], error) { return read(ctx, key) })
		switch {
		case ok:
			found()
		case err == nil:
			s.miss(key)
		}
		return nil, err
	})
	if err != nil {
		return state.Session{}, false, err
	}
	sess, ok := s.LookupSum(sum)
	return sess, ok, nil
}

var errFetchBudget = errors.New("too many unknown session cookies at once")

// fetchBudget is Fetch's read budget: a token bucket per client and one
// for the edge. Clients beyond maxFetchClients share one bucket until
// idle ones (whose bucket is full again) are forgotten. A read that found
// a session earns its client and the edge a credit, spent before tokens:
// only misses (random or stale cookies) and failures drain the budgets,
// so an edge that starts empty serves its users' first requests (one read
// each, then held) at the bus's pace, from behind one address or many.
type fetchBudget struct {
	mu      sync.Mutex
	edge    *rate.Limiter
	credit  int // the edge's
	clients map[string]*clientBudget
	swept   time.Time
}

type clientBudget struct {
	*rate.Limiter
	credit int
}

func newFetchBudget() *fetchBudget {
	return &fetchBudget{edge: rate.NewLimiter(fetchRate, fetchBurst), clients: map[string]*clientBudget{}}
}

// overflowClient is the budget clients share while maxFetchClients others
// are busy.
const overflowClient = "\x00overflow"

// allow takes one read from client's budget and the edge's, or neither:
// credits first, then tokens. found, called when the read found a
// session, credits both.
func (b *fetchBudget) allow(client string, now time.Time) (found func(), ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	l := b.clients[client]
	if l == nil {
		// Forgetting idle clients walks them all: at most once a second,
		// so a crowd of new clients cannot make every read pay for it.
		if len(b.clients) >= maxFetchClients && now.Sub(b.swept) >= time.Second {
			b.swept = now
			for k, l := range b.clients {
				if l.TokensAt(now) >= clientBurst {
					delete(b.clients, k)
				}
			}
		}
		if len(b.clients) >= maxFetchClients {
			client = overflowClient
		}
		if l = b.clients[client]; l == nil {
			l = &clientBudget{Limiter: rate.NewLimiter(clientRate, clientBurst)}
			b.clients[client] = l
		}
	}
	found = func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		l.credit, b.credit = min(l.credit+1, clientBurst), min(b.credit+1, fetchBurst)
	}
	switch {
	case l.credit > 0 && b.credit > 0:
		l.credit--
		b.credit--
		return found, true
	case l.TokensAt(now) < 1 || !b.edge.AllowN(now, 1):
		return nil, false
	}
	return found, l.AllowN(now, 1)
}

// missed reports whether key was looked for in the bucket within missTTL.
func (s *Store) missed(key string) bool {
	s.missMu.Lock()
	defer s.missMu.Unlock()
	at, ok := s.misses[key]
	return ok && s.now().Sub(at) < missTTL
}

// miss remembers that key is not in the bucket. A full memory first
// forgets the misses that have faded (at most once per missTTL); the read
// budget keeps the live ones far fewer than maxMisses, so no client's
// cookies can push out what others' reads found missing. Should it still
// be full, key is not remembered (it costs one more read).
func (s *Store) miss(key string) {
	s.missMu.Lock()
	defer s.missMu.Unlock()
	now := s.now()
	if len(s.misses) >= maxMisses && now.Sub(s.swept) >= missTTL {
		s.swept = now
		for k, at := range s.misses {
			if now.Sub(at) >= missTTL {
				delete(s.misses, k)
			}
		}
	}
	if len(s.misses) < maxMisses {
		s.misses[key] = now
	}
}

// Revoke ends one session, named by its id's SHA-256.
func (s *Store) Revoke(ctx context.Context, user string, sum [32]byte) error {
	return s.bucket.Purge(ctx, state.SessionKey(user, hex.EncodeToString(sum[:])))
}

// RevokeID ends the session of a session id, if it is one.
func (s *Store) RevokeID(ctx context.Context, sid []byte) error {
	sess, ok := s.Lookup(sid)
	if !ok {
		return nil
	}
	return s.Revoke(ctx, sess.User, sha256.Sum256(sid))
}

// RevokeAll ends every session of user, and says how many.
func (s *Store) RevokeAll(ctx context.Context, user string) (int, error) {
	return s.bucket.PurgePrefix(ctx, user)
}

// Len is the number of sessions this edge holds.
func (s *Store) Len() int { return s.cache.Len() }
