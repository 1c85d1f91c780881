package kv

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"
)

// ErrLeaseLost means the lease expired or passed to someone else.
var ErrLeaseLost = errors.New("lease lost")

// Lease is a lock with a TTL in the locks bucket, for roles that exactly one
// replica may play at a time (the active sweeper, the Kubernetes mirror).
// The holder renews it well inside the TTL; if the holder dies, the key
// expires on the server and another candidate takes it.
type Lease struct {
	b   *Bucket[Holder]
	key string
	id  string
	ttl time.Duration
	log *slog.Logger

	rev atomic.Uint64 // revision of our holder record; 0 when not held
	// sent is when the last holder record the server acknowledged was
	// sent (Unix nanoseconds): the server stored it later, so the key
	// expires no sooner than a TTL after it.
	sent atomic.Int64
}

// NewLease describes lease key held as id with the given TTL.
func NewLease(b *Bucket[Holder], key, id string, ttl time.Duration, log *slog.Logger) *Lease {
	return &Lease{b: b, key: key, id: id, ttl: ttl, log: log.With("lease", key)}
}

// ID is this candidate's identity.
func (l *Lease) ID() string { return l.id }

// TryAcquire takes the lease if it is free, or adopts it if it was handed
// over to this candidate. It reports whether the lease is now held.
func (l *Lease) TryAcquire(ctx context.Context) (bool, error) {
	sent := time.Now()
	rev, err := l.b.Create(ctx, l.key, Holder{ID: l.id, Since: sent.UTC()}, WithTTL(l.ttl))
	if err == nil {
		l.rev.Store(rev)
		l.sent.Store(sent.UnixNano())
		return true, nil
	}
	if !errors.Is(err, ErrExists) {
		return false, fmt.Errorf("acquire lease %s: %w", l.key, err)
	}
	cur, err := l.b.Get(ctx, l.key)
	if errors.Is(err, ErrNotFound) {
		return false, nil // expired between our create and get; next try wins
	}
	if err != nil {
		return false, fmt.Errorf("acquire lease %s: %w", l.key, err)
	}
	if cur.Value.ID != l.id {
		return false, nil
	}
	// Ours (handed over to us): renew at once so the TTL is ours too.
	l.rev.Store(cur.Revision)
	if err := l.Renew(ctx); err != nil {
		return false, nil
	}
	return true, nil
}

// Renew extends the lease by its TTL; ErrLeaseLost if it is no longer ours.
func (l *Lease) Renew(ctx context.Context) error {
	if l.rev.Load() == 0 {
		return ErrLeaseLost
	}
	sent := time.Now()
	rev, err := l.b.Update(ctx, l.key, Holder{ID: l.id, Since: sent.UTC()}, l.rev.Load(), WithTTL(l.ttl))
	if err != nil {
		if errors.Is(err, ErrConflict) {
			l.rev.Store(0)
			return ErrLeaseLost
		}
		return fmt.Errorf("renew lease %s: %w", l.key, err)
	}
	l.rev.Store(rev)
	l.sent.Store(sent.UnixNano())
	return nil
}

// stepDownMargin is how long before its key could expire an unconfirmed
// holder stops leading: time for the lead function to notice and stop.
func (l *Lease) stepDownMargin() time.Duration { return l.ttl / 10 }

// confirmedUntil is the latest moment this holder may still lead: the
// server expires the key a TTL after storing the last acknowledged
// renewal, which it did after that renewal was sent.
func (l *Lease) confirmedUntil() time.Time {
	return time.Unix(0, l.sent.Load()).Add(l.ttl - l.stepDownMargin())
}

// Release gives the lease up so a standby takes it at once.
func (l *Lease) Release(ctx context.Context) error {
	if l.rev.Load() == 0 {
		return nil
	}
	err := l.b.Delete(ctx, l.key, l.rev.Load())
	l.rev.Store(0)
	if err != nil && !errors.Is(err, ErrConflict) {
		return fmt.Errorf("release lease %s: %w", l.key, err)
	}
	return nil
}

// Handover passes the lease directly to candidate to, who adopts it on its
// next TryAcquire.
func (l *Lease) Handover(ctx context.Context, to string) error {
	if l.rev.Load() == 0 {
		return ErrLeaseLost
	}
	_, err := l.b.Update(ctx, l.key, Holder{ID: to, Since: time.Now().UTC()}, l.rev.Load(), WithTTL(l.ttl))
	l.rev.Store(0)
	if err != nil {
		if errors.Is(err, ErrConflict) {
			return ErrLeaseLost
		}
		return fmt.Errorf("hand over lease %s: %w", l.key, err)
	}
	return nil
}

// Holder returns the current holder's id, or "" when the lease is free.
func (l *Lease) Holder(ctx context.Context) (string, error) {
	cur, err := l.b.Get(ctx, l.key)
	if errors.Is(err, ErrNotFound) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return cur.Value.ID, nil
}

// Run campaigns for the lease until ctx ends. While it holds the lease it
// runs lead with a context that is cancelled when the lease is lost or
// could have expired unnoticed (no renewal acknowledged within a TTL of
// sending it, less a margin: a standby may take the key the moment it
// expires, so two replicas never lead at once), and renews at a third of
// the TTL. On return it releases the lease so a standby does not wait for
// the TTL.
func (l *Lease) Run(ctx context.Context, lead func(ctx context.Context)) {
	retry := l.ttl / 4
	for ctx.Err() == nil {
		held, err := l.TryAcquire(ctx)
		if err != nil {
			l.log.Warn("lease campaign failed", "err", err)
		}
		if !held {
			_ = sleepCtx(ctx, retry)
			continue
		}
		l.log.Info("lease acquired", "holder", l.id)
		l.lead(ctx, lead)
	}
	rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = l.Release(rctx)
}

func (l *Lease) lead(ctx context.Context, lead func(ctx context.Context)) {
	lctx, cancel := context.WithCancel(ctx)
	finished := make(chan struct{})
	go func() { defer close(finished); lead(lctx) }()
	defer func() { cancel(); <-finished }()

	t := time.NewTicker(l.ttl / 3)
	defer t.Stop()
	expiry := time.NewTimer(time.Until(l.confirmedUntil()))
	defer expiry.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-expiry.C:
			// Unconfirmed for a whole TTL: the key may expire any moment
			// and a standby take it. (If it is still ours after all, the
			// next TryAcquire adopts it again.)
			l.log.Warn("lease not renewed within its TTL; stepping down")
			l.rev.Store(0)
			return
		case <-t.C:
			// A third of the TTL per try, so a request lost with a NATS
			// node is tried again on the next, but never past the point
			// of stepping down.
			rctx, rcancel := context.WithDeadline(ctx, earliest(time.Now().Add(l.ttl/3), l.confirmedUntil()))
			err := l.Renew(rctx)
			rcancel()
			switch {
			case err == nil:
				expiry.Reset(time.Until(l.confirmedUntil()))
			case errors.Is(err, ErrLeaseLost):
				l.log.Warn("lease lost", "holder", l.id)
				return
			default:
				// NATS may be briefly away; the lease survives until its TTL.
				l.log.Warn("lease renewal failed", "err", err)
			}
		}
	}
}

func earliest(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// Holder is the value of a lease key.
type Holder struct {
	ID    string    `json:"id"`
	Since time.Time `json:"since"`
}

// SchemaVersion is a lease's record version (Versioned).
func (Holder) SchemaVersion() int { return 1 }
