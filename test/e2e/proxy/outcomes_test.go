package proxy_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
)

// Outcomes are read from the audit stream, metrics and state, never from
// log lines.

// metric is the sum of p's samples of a metric whose labels include the
// ones given (`aaas_edge_requests_total{class="2xx"}`: over every
// source); 0 when not exposed yet.
func metric(t *testing.T, p *testenv.Proc, series string) float64 {
	t.Helper()
	name, set, _ := strings.Cut(series, "{")
	var labels []string
	if set = strings.TrimSuffix(set, "}"); set != "" {
		for _, kv := range strings.Split(set, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				t.Fatalf("series %q: label %q", series, kv)
			}
			labels = append(labels, k, strings.Trim(v, `"`))
		}
	}
	n, err := p.MetricSum(name, labels...)
	if err != nil {
		return 0
	}
	return n
}

// audited counts the audit events of kind about user.
func audited(t *testing.T, w *testenv.Stack, kind events.AuditKind, user string) int {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	st, err := w.JS.Stream(ctx, events.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	subject := events.AuditSubject(kind, user)
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatal(err)
	}
	return int(info.State.Subjects[subject])
}

// commandsSettled waits until lifecycle has no command waiting or under
// way: every handshake asked for so far is done and audited (lifecycle
// audits before it acknowledges).
func commandsSettled(t *testing.T, w *testenv.Stack) {
	t.Helper()
	testutil.Eventually(t, time.Minute, func() error {
		ctx := testenv.Context(t, 10*time.Second)
		c, err := w.JS.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
		if err != nil {
			return err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending != 0 || info.NumAckPending != 0 {
			return fmt.Errorf("commands pending %d, under way %d", info.NumPending, info.NumAckPending)
		}
		return nil
	})
}

// handshakesOf counts the handshakes lifecycle carried out for user, once
// every command asked for has settled.
func handshakesOf(t *testing.T, w *testenv.Stack, user string) int {
	t.Helper()
	commandsSettled(t, w)
	return audited(t, w, events.AuditHandshake, user)
}
