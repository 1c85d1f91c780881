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
}

// NewLease describes lease key held as id with the given TTL.
func NewLease(b *Bucket[Holder], key, id string, ttl time.Duration, log *slog.Logger) *Lease {
	return &Lease{b: b, key: key, id: id, ttl: ttl, log: log.With("lease", key)}
}

// ID is this candidate's identity.
func (l *Lease) ID() string { return l.id }

// Held reports whether this candidate believes it holds the lease.
func (l *Lease) Held() bool { return l.rev.Load() != 0 }

// TryAcquire takes the lease if it is free, or adopts it if it was handed
// over to this candidate. It reports whether the lease is now held.
func (l *Lease) TryAcquire(ctx context.Context) (bool, error) {
	rev, err := l.b.Create(ctx, l.key, Holder{ID: l.id, Since: time.Now().UTC()}, WithTTL(l.ttl))
	if err == nil {
		l.rev.Store(rev)
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
	rev, err := l.b.Update(ctx, l.key, Holder{ID: l.id, Since: time.Now().UTC()}, l.rev.Load(), WithTTL(l.ttl))
	if err != nil {
		if errors.Is(err, ErrConflict) {
			l.rev.Store(0)
			return ErrLeaseLost
		}
		return fmt.Errorf("renew lease %s: %w", l.key, err)
	}
	l.rev.Store(rev)
	return nil
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
// runs lead with a context that is cancelled when the lease is lost, and
// renews at a third of the TTL. On return it releases the lease so a
// standby does not wait for the TTL.
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
	renewed := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			rctx, rcancel := context.WithTimeout(ctx, l.ttl/3)
			err := l.Renew(rctx)
			rcancel()
			switch {
			case err == nil:
				renewed = time.Now()
			case errors.Is(err, ErrLeaseLost):
				l.log.Warn("lease lost", "holder", l.id)
				return
			case time.Since(renewed) >= l.ttl:
				// Unconfirmed for a whole TTL: someone else may hold it now.
				l.log.Warn("lease not renewed within its TTL; stepping down", "err", err)
				l.rev.Store(0)
				return
			default:
				// NATS may be briefly away; the lease survives until its TTL.
				l.log.Warn("lease renewal failed", "err", err)
			}
		}
	}
}

// Holder is the value of a lease key.
type Holder struct {
	ID    string    `json:"id"`
	Since time.Time `json:"since"`
}
