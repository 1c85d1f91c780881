package accounts_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
	"github.com/nats-io/nats.go/jetstream"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// A user who lost their token (or fears it leaked) gets a new one, shown
// once: by replacing it themselves while signed in, or from an
// administrator's reset. The old token stops working at once on every
// edge, sessions are kept, the new hash is on the claim (where the
// account survives a NATS loss), each change is audited without the
// token, and an unconfirmed reset changes nothing.
func TestTokensAreReplacedByTheUserOrReset(t *testing.T) {
	w, a, b, boss, bossToken := adminStack(t)
	ann := testenv.NewClient(t, a.URL)
	first := ann.Signup("ann", invite)
	works := func(token string, want int) {
		t.Helper()
		for _, e := range []*testenv.Edge{a, b} {
			testutil.Eventually(t, 30*time.Second, func() error {
				r := testenv.NewClient(t, e.URL).Do(http.MethodGet, "/_/status", nil, "Authorization", "Bearer "+token, "Accept", "application/json")
				if r.StatusCode != want {
					return &statusError{r.StatusCode, want}
				}
				return nil
			})
		}
	}
	works(first, http.StatusOK)

	// The user replaces their own, signed in with the session cookie.
	r := ann.Do(http.MethodPost, "/_/token", nil, "Accept", "application/json")
	expect(t, r, http.StatusOK, "replace own token")
	second, _ := r.JSON()["token"].(string)
	if u, ok := ident.TokenUser(second); !ok || u != "ann" || second == first {
		t.Fatalf("new token %q", second)
	}
	if cc := r.Header.Get("Cache-Control"); cc != "no-store" {
		t.Errorf("a token was answered with Cache-Control %q", cc)
	}
	works(first, http.StatusUnauthorized)
	works(second, http.StatusOK)
	expect(t, ann.Do(http.MethodGet, "/_/status", nil, "Accept", "application/json"), http.StatusOK, "ann's session after the change")

	// Cross-origin, it is refused and nothing changes.
	expect(t, ann.Do(http.MethodPost, "/_/token", nil, "Accept", "application/json", "Origin", "https://evil.example"), http.StatusForbidden, "cross-origin replace")
	works(second, http.StatusOK)

	// The administrator's reset: unconfirmed, nothing; confirmed, a new
	// token for the administrator to hand over.
	adm := boss.At(a.URL)
	expect(t, adm.Do(http.MethodPost, "/_/admin/users/ann/token", strings.NewReader(`{}`), "Authorization", "Bearer "+bossToken, "Content-Type", "application/json", "Accept", "application/json"),
		http.StatusBadRequest, "unconfirmed reset")
	works(second, http.StatusOK)
	r = adm.Do(http.MethodPost, "/_/admin/users/ann/token", strings.NewReader(`{"confirm":"ann"}`), "Authorization", "Bearer "+bossToken, "Content-Type", "application/json", "Accept", "application/json")
	expect(t, r, http.StatusOK, "reset")
	third, _ := r.JSON()["token"].(string)
	if u, ok := ident.TokenUser(third); !ok || u != "ann" || third == second {
		t.Fatalf("reset token %q", third)
	}
	works(second, http.StatusUnauthorized)
	works(third, http.StatusOK)

	// The claim holds the new token's hash.
	_, ext, _ := pkg.Cluster.SandboxClients()
	claim, err := ext.ExtensionsV1beta1().SandboxClaims(w.NS.Name).Get(context.Background(), sandbox.ClaimName("ann"), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := claim.Annotations[sandbox.TokenHashAnnotation]; got != ident.HashHex(third) {
		t.Errorf("the claim's token hash %q, want the reset token's", got)
	}

	// Audited by lifecycle, each saying who asked; the admin's action too.
	evs := auditEvents(t, w)
	if n := count(evs, func(e events.AuditEvent) bool {
		return e.Kind == events.AuditToken && e.User == "ann" && e.Outcome == "replaced" && (e.Detail == "by user" || e.Detail == "by admin:boss")
	}); n != 2 {
		t.Errorf("%d token replacements of ann audited, want 2", n)
	}
	if n := count(evs, func(e events.AuditEvent) bool {
		return e.Kind == events.AuditAdmin && e.User == "ann" && strings.HasPrefix(e.Outcome, "token: token replaced")
	}); n != 1 {
		t.Errorf("%d admin token resets of ann audited, want 1", n)
	}
	// No token, new or old, in the audit trail or any process's log.
	for _, tok := range []string{first, second, third} {
		_, secret, _ := strings.Cut(tok, ".")
		if strings.Contains(w.AuditLog(), secret) {
			t.Error("a token reached the audit trail")
		}
		for _, p := range w.Procs {
			if strings.Contains(p.Logs(), secret) {
				t.Errorf("a token reached %s's log", p.Name)
			}
		}
	}
}

type statusError struct{ got, want int }

func (e *statusError) Error() string {
	return http.StatusText(e.got) + ", want " + http.StatusText(e.want)
}

// A user's pod carries their name (sandbox.PodUserLabel), so operators
// find it with kubectl from the user (docs/RUNBOOK.md), also when the
// claim adopted a warm-pool spare; nobody else's pod does.
func TestPodsAreLabelledWithTheirUser(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", nil)
	for _, u := range []string{"pia", "pete"} {
		testenv.NewClient(t, edge.URL).Signup(u, invite)
		w.WaitPhase(t, u, state.PhaseReady, 2*time.Minute)
	}
	pods := pkg.Cluster.Client.CoreV1().Pods(w.NS.Name)
	for _, u := range []string{"pia", "pete"} {
		testutil.Eventually(t, time.Minute, func() error {
			l, err := pods.List(context.Background(), metav1.ListOptions{LabelSelector: sandbox.PodUserLabel + "=" + u})
			if err != nil {
				return err
			}
			if len(l.Items) != 1 || l.Items[0].Name != w.Box(u).PodName {
				names := []string{}
				for _, p := range l.Items {
					names = append(names, p.Name)
				}
				return fmt.Errorf("pods labelled %s: %v, want its pod %s", u, names, w.Box(u).PodName)
			}
			return nil
		})
	}
}

// Named API tokens: a user makes several, each a bearer token on every
// edge (to the sandbox too), listed by name (never the token), refused
// when malformed, a duplicate or beyond MAX_API_TOKENS_PER_USER; an API
// token manages no tokens; deleting one, its expiry, a recreate (the
// claim it was bound to is gone) and the account's deletion each end it.
func TestNamedAPITokens(t *testing.T) {
	w := pkg.NewStack(t, testenv.StackOptions{Env: map[string]string{"SIGNUP_INVITE_CODE": invite, "MAX_API_TOKENS_PER_USER": "3"}, Lifecycle: "lc-a"})
	a, b := w.Edge("edge-a", nil), w.Edge("edge-b", nil)
	ann := testenv.NewClient(t, a.URL)
	account := ann.Signup("ann", invite)
	w.WaitPhase(t, "ann", state.PhaseReady, 2*time.Minute)
	bearer := func(token, path string, want int) {
		t.Helper()
		for _, e := range []*testenv.Edge{a, b} {
			testutil.Eventually(t, 30*time.Second, func() error {
				r := testenv.NewClient(t, e.URL).Do(http.MethodGet, path, nil, "Authorization", "Bearer "+token, "Accept", "application/json")
				if r.StatusCode != want {
					return &statusError{r.StatusCode, want}
				}
				return nil
			})
		}
	}
	create := func(c *testenv.Client, name, days string, headers ...string) *testenv.Response {
		return c.Do(http.MethodPost, "/_/tokens", strings.NewReader(`{"name":"`+name+`","expires_days":"`+days+`"}`),
			append([]string{"Content-Type", "application/json", "Accept", "application/json"}, headers...)...)
	}
	r := create(ann, "ci", "")
	expect(t, r, http.StatusCreated, "make ci")
	ci, _ := r.JSON()["token"].(string)
	if u, name, ok := ident.ParseAPIToken(ci); !ok || u != "ann" || name != "ci" {
		t.Fatalf("API token %q", ci)
	}
	bearer(ci, "/_/status", http.StatusOK)
	bearer(ci, "/u/ann/api/files", http.StatusOK)

	// Refusals change nothing.
	for _, tc := range []struct{ name, days string }{
		{"", ""}, {"UP", ""}, {"-x", ""}, {"a.b", ""}, {strings.Repeat("x", 33), ""}, {"ok", "0"}, {"ok", "3651"}, {"ok", "soon"},
	} {
		if r := create(ann, tc.name, tc.days); r.StatusCode != http.StatusBadRequest {
			t.Errorf("name %q, expires_days %q: %d %s, want 400", tc.name, tc.days, r.StatusCode, r.Body)
		}
	}
	expect(t, create(ann, "ci", ""), http.StatusConflict, "a second ci")
	expect(t, create(testenv.NewClient(t, a.URL), "x", "", "Authorization", "Bearer "+ci), http.StatusForbidden, "a token made with an API token")
	expect(t, testenv.NewClient(t, a.URL).Do(http.MethodPost, "/_/token", nil, "Authorization", "Bearer "+ci, "Accept", "application/json"), http.StatusForbidden, "the account token replaced with an API token")
	r = create(ann, "nightly", "30")
	expect(t, r, http.StatusCreated, "make nightly")
	nightly, _ := r.JSON()["token"].(string)
	expect(t, create(ann, "third", "365"), http.StatusCreated, "make third")
	expect(t, create(ann, "fourth", ""), http.StatusConflict, "a fourth beyond MAX_API_TOKENS_PER_USER")

	// Listed by name only.
	r = ann.Do(http.MethodGet, "/_/tokens", nil, "Accept", "application/json")
	expect(t, r, http.StatusOK, "list")
	for _, name := range []string{`"ci"`, `"nightly"`, `"third"`} {
		if !strings.Contains(string(r.Body), name) {
			t.Errorf("list lacks %s: %s", name, r.Body)
		}
	}
	for _, tok := range []string{ci, nightly} {
		secret := tok[strings.LastIndex(tok, ".")+1:]
		if strings.Contains(string(r.Body), secret) || strings.Contains(string(r.Body), ident.HashHex(tok)) {
			t.Errorf("the list shows a token or its hash: %s", r.Body)
		}
	}

	// Deleted: it stops on every edge, its open WebSocket is ended
	// (4401), and the others hold.
	ws, _, err := websocket.DefaultDialer.Dial(strings.Replace(b.URL, "http", "ws", 1)+"/u/ann/api/ws", http.Header{"Authorization": {"Bearer " + ci}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	expect(t, ann.Do(http.MethodDelete, "/_/tokens/ci", nil), http.StatusNoContent, "delete ci")
	_ = ws.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, _, err := ws.ReadMessage(); !websocket.IsCloseError(err, 4401) {
		t.Errorf("the WebSocket of a deleted token: %v, want closed with 4401", err)
	}
	bearer(ci, "/_/status", http.StatusUnauthorized)
	bearer(nightly, "/_/status", http.StatusOK)

	// Expired: a record whose time has passed (as a lapsed one's would be
	// until its TTL removes it) authenticates nobody.
	ctx := testenv.Context(t, time.Minute)
	tokens, err := kv.Open[state.APIToken](ctx, w.JS, state.BucketAPITokens)
	if err != nil {
		t.Fatal(err)
	}
	e, err := tokens.Get(ctx, state.APITokenKey("ann", "third"))
	if err != nil {
		t.Fatal(err)
	}
	lapsed := ident.NewAPIToken("ann", "third")
	e.Value.Hash, e.Value.Expires = ident.HashHex(lapsed), time.Now().Add(-time.Minute)
	if _, err := tokens.Put(ctx, state.APITokenKey("ann", "third"), e.Value); err != nil {
		t.Fatal(err)
	}
	bearer(lapsed, "/_/status", http.StatusUnauthorized)
	bearer(nightly, "/_/status", http.StatusOK)

	// A recreate ends them, as it ends sessions; the account token holds.
	r = testenv.NewClient(t, a.URL).Do(http.MethodPost, "/recreate", nil, "Authorization", "Bearer "+account, "Accept", "application/json")
	expect(t, r, http.StatusAccepted, "recreate")
	bearer(nightly, "/_/status", http.StatusUnauthorized)
	bearer(account, "/_/status", http.StatusOK)

	// The account's deletion takes its tokens' records with it.
	expect(t, testenv.NewClient(t, a.URL).Do(http.MethodDelete, "/users/ann", nil, "Authorization", "Bearer "+account, "Accept", "application/json"), http.StatusNoContent, "delete ann")
	testutil.Eventually(t, time.Minute, func() error {
		keys, err := tokens.Keys(ctx, "ann.>")
		if err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) {
			return err
		}
		if len(keys) != 0 {
			return fmt.Errorf("tokens of the deleted account left: %v", keys)
		}
		return nil
	})

	evs := auditEvents(t, w)
	for outcome, want := range map[string]int{"created": 3, "deleted": 1} {
		if n := count(evs, func(e events.AuditEvent) bool {
			return e.Kind == events.AuditToken && e.User == "ann" && e.Outcome == outcome
		}); n != want {
			t.Errorf("%d %s API tokens audited, want %d", n, outcome, want)
		}
	}
}
