// Package ratelimit holds the rate limits every edge shares through the
// ratelimit bucket: attempts per client in a sliding window, and a count
// of refusal audits per window that all edges spend together.
package ratelimit

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// Limiter is a rate limit shared by every edge: a sliding log of
// attempt times per client in the ratelimit bucket, so a client gets
// AUTH_RATE_LIMIT attempts in any AUTH_RATE_WINDOW, however many edges it
// spreads them over and wherever the window starts. (Fixed windows would let
// a client spend two budgets back to back across a boundary.)
type Limiter struct {
	bucket *kv.Bucket[state.Attempts]
	// audits is the same bucket's count of refusal audits per window
	// (refusals.go).
	audits *kv.Bucket[auditWindow]
	limit  int
	window time.Duration
}

// New opens the ratelimit bucket: limit attempts per client in any
// window.
func New(ctx context.Context, js jetstream.JetStream, limit int, window time.Duration) (*Limiter, error) {
	b, err := kv.Open[state.Attempts](ctx, js, state.BucketRateLimit)
	if err != nil {
		return nil, err
	}
	audits, err := kv.Open[auditWindow](ctx, js, state.BucketRateLimit)
	if err != nil {
		return nil, err
	}
	return &Limiter{bucket: b, audits: audits, limit: limit, window: window}, nil
}

// Verdict is the Limiter's answer.
type Verdict struct {
	// Allowed is false when the client is over its limit.
	Allowed bool
	// RetryAfter says when the attempt that blocks it leaves the window.
	RetryAfter time.Duration
	// Audit is true for the first refusal of the client in a window: the
	// one refusal that is written to the audit trail (a flood of refused
	// requests must not become a flood of audit events).
	Audit bool
}

// Allow records an attempt by client if it is within the limit. A refused
// attempt is not recorded, so a client that waits RetryAfter gets in.
func (l *Limiter) Allow(ctx context.Context, client string) (Verdict, error) {
	now := time.Now()
	since := now.Add(-l.window).UnixMilli()
	var v Verdict
	_, err := l.bucket.Mutate(ctx, ident.HashHex(client)[:32], func(a state.Attempts, _ bool) (state.Attempts, bool, error) {
		recent := slices.DeleteFunc(a.At, func(at int64) bool { return at <= since })
		// Edges' clocks differ a little, so the log is not assumed sorted.
		slices.Sort(recent)
		if v.Allowed = len(recent) < l.limit; !v.Allowed {
			v.RetryAfter = time.UnixMilli(recent[len(recent)-l.limit]).Add(l.window).Sub(now)
			if v.Audit = a.Refused <= since; !v.Audit {
				return state.Attempts{}, false, nil
			}
			return state.Attempts{At: recent, Refused: now.UnixMilli()}, true, nil
		}
		return state.Attempts{At: append(recent, now.UnixMilli()), Refused: a.Refused}, true, nil
	}, kv.WithTTL(l.window))
	if err != nil {
		return Verdict{}, fmt.Errorf("rate limit: %w", err)
	}
	return v, nil
}

// Refused notes that client's attempt failed (a wrong token, a wrong
// invite) and reports whether it is the first refusal of the client in
// the window, the one to audit.
func (l *Limiter) Refused(ctx context.Context, client string) (bool, error) {
	now := time.Now()
	since := now.Add(-l.window).UnixMilli()
	first := false
	_, err := l.bucket.Mutate(ctx, ident.HashHex(client)[:32], func(a state.Attempts, _ bool) (state.Attempts, bool, error) {
		if first = a.Refused <= since; !first {
			return state.Attempts{}, false, nil
		}
		a.Refused = now.UnixMilli()
		return a, true, nil
	}, kv.WithTTL(l.window))
	if err != nil {
		return false, fmt.Errorf("rate limit: %w", err)
	}
	return first, nil
}

// Window is the limit's window.
func (l *Limiter) Window() time.Duration { return l.window }

// auditWindow is the shared count of refusal audits in one window, under
// auditKeyPrefix and the window's number. (Client keys are 32 hex digits,
// which this prefix is not.)
type auditWindow struct {
	Audited int `json:"audited"`
}

// SchemaVersion is the count's record version (kv.Versioned).
func (auditWindow) SchemaVersion() int { return 1 }

const auditKeyPrefix = "audits."

// SpendAudit takes one of the limit audits all edges share in window w;
// false once they are spent.
func (l *Limiter) SpendAudit(ctx context.Context, w int64, limit int) (bool, error) {
	spent := false
	_, err := l.audits.Mutate(ctx, auditKeyPrefix+strconv.FormatInt(w, 10), func(a auditWindow, _ bool) (auditWindow, bool, error) {
		if spent = a.Audited < limit; !spent {
			return a, false, nil
		}
		a.Audited++
		return a, true, nil
	}, kv.WithTTL(l.window))
	if err != nil {
		return false, fmt.Errorf("refusal audit budget: %w", err)
	}
	return spent, nil
}
