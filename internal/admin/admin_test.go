package admin

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
)

var quiet = slog.New(slog.DiscardHandler)

// service is a Service over a real NATS server holding n accounts
// (u00000…), every tenth one's sandbox Suspended and the rest Ready, plus
// one sandbox without an account (a claim applied by hand).
func service(t testing.TB, n int) *Service {
	t.Helper()
	s, _ := fixture(t, n, Options{})
	return s
}

// fixture is service with where's placement (Hosts, SandboxDomain,
// PublicHosts), u00001 an administrator by ADMIN_USERS, and u00001's
// bearer token.
func fixture(t testing.TB, n int, where Options) (*Service, string) {
	t.Helper()
	s, token, _ := fixtureJS(t, n, where)
	return s, token
}

// fixtureJS is fixture with its JetStream, the spend book (usage,
// budgets, groups; a default budget of $20) and the audit stream.
func fixtureJS(t testing.TB, n int, where Options) (*Service, string, jetstream.JetStream) {
	t.Helper()
	token := ident.NewToken("u00001")
	s := natstest.Start(t)
	_, js := natstest.Connect(t, s.URL())
	ctx := natstest.Context(t, 5*time.Minute)
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		t.Fatal(err)
	}
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		t.Fatal(err)
	}
	users := testutil.Open[state.User](t, js, state.BucketUsers)
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	for i := range n {
		name := fmt.Sprintf("u%05d", i)
		phase := state.PhaseReady
		if i%10 == 0 {
			phase = state.PhaseSuspended
		}
		u := state.User{Name: name, Managed: true, Created: time.Now()}
		if name == "u00001" {
			u.TokenHash = ident.HashHex(token)
		}
		if _, err := users.Put(ctx, name, u); err != nil {
			t.Fatal(err)
		}
		// A seventh of the sandboxes are of the gpu profile; the rest
		// name none, so are of the default.
		profile := ""
		if i%7 == 3 {
			profile = "gpu"
		}
		// A fifth are on a rollout's new revision, and one was rolled
		// back from a third.
		b := state.Sandbox{User: name, Phase: phase, Managed: true, PodName: "dsh-" + name, Profile: profile, Revision: "aaaaaaaa"}
		if i%5 == 1 {
			b.Revision = "bbbbbbbb"
		}
		if i == 21 {
			b.Halted = "cccccccc"
		}
		if _, err := boxes.Put(ctx, name, b); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := boxes.Put(ctx, "zed", state.Sandbox{User: "zed", Phase: state.PhaseReady}); err != nil {
		t.Fatal(err)
	}
	uc := cache(t, users)
	bc := cache(t, boxes)
	store, err := auth.NewStore(context.Background(), js, auth.StoreOptions{TTL: time.Hour, MaxPerUser: 10, Limit: 1000, Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if uc.Len() != n || bc.Len() != n+1 {
			return fmt.Errorf("caches hold %d users, %d sandboxes", uc.Len(), bc.Len())
		}
		return nil
	})
	a := auth.New(auth.Options{Store: store, Users: uc, Admins: []ident.Admin{{Name: "u00001", Identity: ident.HashHex(token)}}, Metrics: prometheus.NewRegistry()})
	budgets := testutil.Open[state.Budget](t, js, state.BucketBudgets)
	// Usage as an edge holds it: the users served, and months by the month.
	usage := testutil.Open[state.Usage](t, js, state.BucketUsage)
	served, err := kv.NewCache(context.Background(), usage, ">", quiet, kv.Bounded[state.Usage](100))
	if err != nil {
		t.Fatal(err)
	}
	book := &spend.Book{Usage: served, Months: &spend.Months{Bucket: usage, Log: quiet, Life: context.Background()}, Budgets: cache(t, budgets),
		Groups: cache(t, testutil.Open[state.UserGroups](t, js, state.BucketUserGroups)), DefaultMicros: 20_000_000}
	return New(Options{Auth: a, Users: uc, Sandboxes: bc, Names: kv.NewNames(context.Background(), quiet, users.KeySource(), boxes.KeySource()), Activity: &idle.Views{NC: js.Conn()}, Log: quiet, Publisher: events.NewPublisher(js, "edge-test", quiet),
		Hosts: where.Hosts, SandboxDomain: where.SandboxDomain, PublicHosts: where.PublicHosts, Spend: book, Budgets: budgets, JS: js,
		Profiles: config.Profiles{{Name: "small", WarmPool: "dsh-pool"}, {Name: "gpu", WarmPool: "dsh-gpu"}},
		Rollouts: cache(t, testutil.Open[state.Rollout](t, js, state.BucketRollouts))}), token, js
}

func cache[T any](t testing.TB, b *kv.Bucket[T]) *kv.Cache[T] {
	c, err := kv.NewCache(context.Background(), b, ">", quiet)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Walking the pages visits every user once, in order, whatever the
// filters; a sandbox without an account is listed too.
func TestPagesCoverEveryUserOnce(t *testing.T) {
	s := service(t, 1234)
	for _, tc := range []struct {
		name  string
		q     Query
		want  int
		first string
	}{
		{"everyone", Query{Limit: 100}, 1235, "u00000"},
		{"a page of the most", Query{Limit: MaxLimit}, 1235, "u00000"},
		{"by phase", Query{Limit: 7, Phase: string(state.PhaseSuspended)}, 124, "u00000"},
		{"by prefix", Query{Limit: 3, Prefix: "u012"}, 34, "u01200"},
		{"by profile", Query{Limit: 9, Profile: "gpu"}, 176, "u00003"},
		{"by the default profile, which a record without one is", Query{Limit: 40, Profile: "small"}, 1235 - 176, "u00000"},
		{"by revision", Query{Limit: 11, Revision: "bbbbbbbb"}, 247, "u00001"},
		{"by a revision rolled back from", Query{Limit: 100, Revision: "cccccccc"}, 1, "u00021"},
		{"after a name", Query{Limit: 50, After: "u01199"}, 35, "u01200"},
		{"after the last", Query{Limit: 50, After: "zed"}, 0, ""},
		{"prefix that matches nothing", Query{Limit: 50, Prefix: "nobody"}, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q, seen, prev := tc.q, 0, ""
			for page := 0; ; page++ {
				p := mustPage(t, s, q)
				if p.Total != 1235 {
					t.Fatalf("total %d", p.Total)
				}
				if len(p.Users) > q.Limit {
					t.Fatalf("page of %d over the limit %d", len(p.Users), q.Limit)
				}
				for _, r := range p.Users {
					if seen == 0 && r.User != tc.first {
						t.Fatalf("first user %s, want %s", r.User, tc.first)
					}
					if r.User <= prev {
						t.Fatalf("%s after %s: out of order or twice", r.User, prev)
					}
					if tc.q.Phase != "" && r.Phase != tc.q.Phase {
						t.Fatalf("%s is %s", r.User, r.Phase)
					}
					if tc.q.Profile != "" && r.Profile != tc.q.Profile {
						t.Fatalf("%s is of profile %s", r.User, r.Profile)
					}
					if tc.q.Revision != "" && r.Revision != tc.q.Revision && r.Halted != tc.q.Revision {
						t.Fatalf("%s is of revision %s (halted %q)", r.User, r.Revision, r.Halted)
					}
					prev = r.User
					seen++
				}
				if p.Next == "" {
					break
				}
				if p.Next != prev {
					t.Fatalf("next %q, last listed %q", p.Next, prev)
				}
				q.After = p.Next
			}
			if seen != tc.want {
				t.Fatalf("listed %d users, want %d", seen, tc.want)
			}
		})
	}
	zed := mustPage(t, s, Query{Limit: 1, Prefix: "zed"}).Users[0]
	if zed.Managed || !zed.Created.IsZero() || zed.Phase != string(state.PhaseReady) {
		t.Fatalf("a sandbox without an account: %+v", zed)
	}
}

func TestSince(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		ago  time.Duration
		want string
	}{
		{-time.Minute, "0s"}, {0, "0s"}, {59 * time.Second, "59s"}, {90 * time.Second, "1m"},
		{3 * time.Hour, "3h"}, {47 * time.Hour, "47h"}, {72 * time.Hour, "3d"},
	} {
		if got := since(now.Add(-tc.ago), now); got != tc.want {
			t.Errorf("since(%s ago) = %q, want %q", tc.ago, got, tc.want)
		}
	}
	if got := since(time.Time{}, now); got != "—" {
		t.Errorf("zero time: %q", got)
	}
}

// BenchmarkPage10k is one page of the list at 10k users, as an admin's
// browser asks for it (kv's BenchmarkNamesRange measures the name list
// right after a change).
func BenchmarkPage10k(b *testing.B) {
	s := service(b, 10_000)
	q := Query{Limit: DefaultLimit, After: "u05000"}
	b.Run("page", func(b *testing.B) {
		for b.Loop() {
			mustPage(b, s, q)
		}
	})
	// By spend, every page sorts the names by this month's spend.
	b.Run("page-by-spend", func(b *testing.B) {
		q := Query{Limit: DefaultLimit, Sort: "spend"}
		for b.Loop() {
			mustPage(b, s, q)
		}
	})
}

// mustPage is s.Page(q) now, which must not fail.
func mustPage(t testing.TB, s *Service, q Query) Page {
	t.Helper()
	p, err := s.Page(context.Background(), q, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// A named sandbox is a row of its own right after its owner's (its key
// sorts there), saying whose it is, with no spend of its own (the
// owner's row has the account's); a search by the owner's name finds both.
func TestANamedSandboxIsListedUnderItsOwner(t *testing.T) {
	s, _, js := fixtureJS(t, 3, Options{})
	boxes := testutil.Open[state.Sandbox](t, js, state.BucketSandboxes)
	if _, err := boxes.Put(natstest.Context(t, time.Minute), "u00001--work", state.Sandbox{User: "u00001--work", Phase: state.PhaseReady, Managed: true, Profile: "gpu"}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() error {
		var got []string
		for _, r := range mustPage(t, s, Query{Limit: 10}).Users {
			got = append(got, r.User)
		}
		if strings.Join(got, " ") != "u00000 u00001 u00001--work u00002 zed" {
			return fmt.Errorf("rows %v", got)
		}
		return nil
	})
	p := mustPage(t, s, Query{Limit: 10, Prefix: "u00001"})
	if len(p.Users) != 2 {
		t.Fatalf("a search for u00001: %+v", p.Users)
	}
	owner, named := p.Users[0], p.Users[1]
	if owner.Owner != "" || owner.Sandbox != "" || owner.Budget == nil {
		t.Fatalf("the owner's row: %+v", owner)
	}
	if named.Owner != "u00001" || named.Sandbox != "work" || named.Profile != "gpu" || named.Budget != nil || named.Phase != string(state.PhaseReady) {
		t.Fatalf("the named sandbox's row: %+v", named)
	}
}
