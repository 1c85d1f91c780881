// Package notify sends the gateway's notices to the operator's webhook
// (NOTIFY_WEBHOOK_URL): a JSON POST per event (a suspend warning, a
// suspend with its reason, an account found dormant or deleted), signed
// with the shared secret, retried a bounded number of times. Delivery is
// at least once: every notice carries an id derived from the event, the
// same on every retry and every replica that sends it, for the receiver
// to drop repeats. A notice never carries a token, cookie or key: only
// the user's name, the event and words about it.
package notify

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Kinds of notice.
const (
	KindWarning   = "suspend_warning"
	KindSuspended = "suspended"
	KindDormant   = "dormant"
	KindDeleted   = "deleted"
)

// Notice is one event as the webhook receives it.
type Notice struct {
	// ID is the delivery id (also the X-Aaas-Delivery header), derived
	// from the event.
	ID   string    `json:"id"`
	Kind string    `json:"kind"`
	User string    `json:"user"`
	At   time.Time `json:"at"`
	// Reason is an idle.Reason for suspends and warnings.
	Reason string `json:"reason,omitempty"`
	// When is the moment the notice is about: the suspend to come, the
	// deletion to come.
	When   time.Time `json:"when,omitzero"`
	Detail string    `json:"detail,omitempty"`
}

// SignatureHeader carries "sha256=" and the hex HMAC-SHA256 of the body
// under the shared secret.
const SignatureHeader = "X-Aaas-Signature"

// Sign is the signature header's value for body.
func Sign(secret, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// Options configures a Notifier.
type Options struct {
	URL    string
	Secret []byte
	// Attempts bounds the tries per notice (first one included); Backoff
	// is the wait after the first failure, doubled after each.
	Attempts int
	Backoff  time.Duration
	// Queue bounds the notices waiting; beyond it the newest is dropped
	// (and counted).
	Queue   int
	Log     *slog.Logger
	Metrics prometheus.Registerer
}

// Notifier sends notices in its own goroutine (Run); Send never blocks.
type Notifier struct {
	o      Options
	client *http.Client
	queue  chan Notice
	sent   *prometheus.CounterVec
}

// New returns a Notifier, or nil when no URL is set (a nil Notifier's
// Send does nothing).
func New(o Options) *Notifier {
	if o.URL == "" {
		return nil
	}
	n := &Notifier{o: o, client: &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		queue: make(chan Notice, max(o.Queue, 1)),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aaas_notices_total", Help: "Webhook notices, by kind and outcome (sent, failed after every attempt, dropped with the queue full).",
		}, []string{"kind", "outcome"}),
	}
	o.Metrics.MustRegister(n.sent)
	return n
}

// Send queues a notice.
func (n *Notifier) Send(x Notice) {
	if n == nil {
		return
	}
	select {
	case n.queue <- x:
	default:
		n.sent.WithLabelValues(x.Kind, "dropped").Inc()
		n.o.Log.Warn("notice dropped: the queue is full", "kind", x.Kind, "user", x.User)
	}
}

// Run delivers until ctx ends.
func (n *Notifier) Run(ctx context.Context) {
	if n == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case x := <-n.queue:
			outcome := "sent"
			if err := n.deliver(ctx, x); err != nil {
				outcome = "failed"
				n.o.Log.Warn("notice not delivered", "kind", x.Kind, "user", x.User, "id", x.ID, "err", err)
			}
			n.sent.WithLabelValues(x.Kind, outcome).Inc()
		}
	}
}

// deliver POSTs x until the receiver answers 2xx or the attempts run out.
func (n *Notifier) deliver(ctx context.Context, x Notice) error {
	body, err := json.Marshal(x)
	if err != nil {
		return err
	}
	wait := n.o.Backoff
	for attempt := 1; ; attempt++ {
		err = n.post(ctx, x.ID, body)
		if err == nil || attempt >= n.o.Attempts {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait *= 2
	}
}

func (n *Notifier) post(ctx context.Context, id string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.o.URL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Aaas-Delivery", id)
	req.Header.Set(SignatureHeader, Sign(n.o.Secret, body))
	resp, err := n.client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("the webhook answered %s", resp.Status)
	}
	return nil
}
