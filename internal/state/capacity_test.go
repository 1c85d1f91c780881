package state_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

// TestRecordBytes stores the largest record of each kind whose bucket's
// cap grows with accounts, with the longest names the grammar allows, in
// a real JetStream bucket, and checks what the store counts against the
// cap is within the record's budget: the sizing table in README is only
// as true as these budgets.
func TestRecordBytes(t *testing.T) {
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 30*time.Second)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	user := "u" + strings.Repeat("x", ident.MaxUserLen-2) + "1"
	if err := ident.ValidateUser(user); err != nil {
		t.Fatal(err)
	}
	hex64, uid := strings.Repeat("f", 64), "0123abcd-4567-89ab-cdef-0123456789ab"
	at := time.Date(2026, 12, 31, 23, 59, 59, 999999999, time.UTC)
	// A sandbox host under a long SANDBOX_DOMAIN, on a preview port.
	host := "p65535--" + user + ".sandboxes." + strings.Repeat("d", 40) + ".example.com"
	long := strings.Repeat("é", state.MaxReasonLen) // clipped to MaxReasonLen bytes
	recent := make([]string, state.UsageRecentCalls)
	for i := range recent {
		recent[i] = strings.Repeat("C", 26) // the broker's rand.Text() ids
	}
	groups := make([]string, 12)
	for i := range groups {
		groups[i] = fmt.Sprintf("%s-%02d", strings.Repeat("g", 60), i)
	}
	records := []record{
		rec(t, state.BucketSessions, state.SessionKey(user, hex64), state.Session{User: user, Created: at, Expires: at, Via: "sandbox", Host: host, Parent: hex64, Bound: hex64}, ""),
		rec(t, state.BucketUsers, user, state.User{Name: user, TokenHash: hex64, Claim: "dsh-" + user, ClaimUID: uid, Managed: true, Created: at, RecreatingSince: at, DeletingSince: at}, ""),
		rec(t, state.BucketSandboxes, user, state.Sandbox{User: user, Phase: state.PhaseSuspending, Managed: true, Claim: "dsh-" + user,
			Sandbox: "dsh-" + user + "-abcde", PodName: "dsh-" + user + "-abcde-0123456789", PodUID: uid,
			Address: "dsh-" + user + ".aaas-sandboxes-" + strings.Repeat("n", 30) + ".svc.cluster.local:65535", PodIP: "fd00:1234:5678:9abc:def0:1234:5678:9abc",
			Reason: long, ReadySince: at, LastSuspend: &state.Suspension{At: at, Reason: "inactive-and-quiet", Detail: long}, Updated: at}.Clipped(), ""),
		// The longest cookie a handshake keeps, sealed (nonce and tag).
		rec(t, state.BucketHandshakes, state.HandshakeKey(user, uid, host), state.Handshake{User: user, PodUID: uid, Host: host, Sealed: make([]byte, 12+handshake.MaxCookieLen+16), At: at}, ""),
		rec(t, state.BucketUsage, state.UsageKey(user, "2026-12"), state.Usage{User: user, Month: "2026-12", Calls: 1 << 40, Estimated: 1 << 40, InputTokens: 1 << 50,
			OutputTokens: 1 << 50, CachedTokens: 1 << 50, CacheWriteTokens: 1 << 50, CostMicros: 1 << 50, BYOKCalls: 1 << 40, BYOKCostMicros: 1 << 50, Updated: at, Recent: recent}, ""),
		// The longest key a provider takes, sealed (JSON of user, provider
		// and key, and the anonymous box's 48 bytes).
		rec(t, state.BucketCredentials, state.CredentialKey(user, "openrouter"), state.Credential{User: user, Provider: "openrouter", Sealed: make([]byte, 1024+len(user)+80+48), KeyID: hex64[:16], Hint: "abcd", Set: at}, ""),
		rec(t, state.BucketUserGroups, user, state.UserGroups{User: user, Groups: groups, Seen: at}, ""),
		rec(t, state.BucketKeepAwake, user, state.KeepAwake{Until: at, At: at}, ""),
		rec(t, state.BucketAPITokens, state.APITokenKey(user, strings.Repeat("t", ident.MaxTokenNameLen)), state.APIToken{User: user, Name: strings.Repeat("t", ident.MaxTokenNameLen), Hash: hex64, ClaimUID: uid, Created: at, Expires: at}, "8760h"),
		rec(t, state.BucketQueue, user, state.Queued{User: user, Since: at}, ""),
	}
	for _, r := range records {
		t.Run(r.bucket, func(t *testing.T) {
			before := streamBytes(t, ctx, js, r.bucket)
			m := nats.NewMsg("$KV." + r.bucket + "." + r.key)
			m.Data = r.data
			if r.ttl != "" {
				m.Header.Set("Nats-TTL", r.ttl)
			}
			if _, err := js.PublishMsg(ctx, m); err != nil {
				t.Fatal(err)
			}
			got := streamBytes(t, ctx, js, r.bucket) - before
			if budget := state.RecordBytes(r.bucket); got > budget || got == 0 {
				t.Fatalf("the largest %s record takes %d bytes in the store; its budget is %d", r.bucket, got, budget)
			}
			t.Logf("%s: %d of %d bytes", r.bucket, got, state.RecordBytes(r.bucket))
		})
	}
}

type record struct {
	bucket, key string
	data        []byte
	ttl         string
}

// rec is v as kv stores it under key.
func rec[T any](t *testing.T, bucket, key string, v T, ttl string) record {
	t.Helper()
	data, err := kv.Encode(v)
	if err != nil {
		t.Fatal(err)
	}
	return record{bucket, key, data, ttl}
}

func streamBytes(t *testing.T, ctx context.Context, js jetstream.JetStream, bucket string) int64 {
	t.Helper()
	st, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return int64(info.State.Bytes)
}

// TestClippedBoundsWhatAPodSays: a container's termination message (the
// tenant's, up to 4 KiB) and a suspension's detail are cut to
// MaxReasonLen bytes of valid UTF-8 in what lifecycle stores, and a short
// reason is kept as it is.
func TestClippedBoundsWhatAPodSays(t *testing.T) {
	hostile := strings.Repeat("ü", 2048) // 4 KiB, a rune boundary at every other byte
	ls := &state.Suspension{Reason: "inactive", Detail: "x" + hostile}
	s := state.Sandbox{User: "bob", Reason: "CrashLoopBackOff: " + hostile, LastSuspend: ls}.Clipped()
	for what, got := range map[string]string{"reason": s.Reason, "detail": s.LastSuspend.Detail} {
		if len(got) > state.MaxReasonLen || !utf8.ValidString(got) || !strings.HasSuffix(got, "…") {
			t.Errorf("%s clipped to %d bytes (valid UTF-8 %v): %q", what, len(got), utf8.ValidString(got), got[max(0, len(got)-12):])
		}
	}
	if len(ls.Detail) != 1+len(hostile) {
		t.Error("Clipped changed the suspension it was given, not its own copy")
	}
	if short := (state.Sandbox{Reason: "pod Failed: OOMKilled"}).Clipped(); short.Reason != "pod Failed: OOMKilled" {
		t.Errorf("a short reason became %q", short.Reason)
	}
}
