package accounts_test

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/state"
)

// A full sessions bucket refuses every sign-in with a 503 that says so
// (not "try again shortly": asking again changes nothing until an
// operator grows it) and stores nothing, while what needs no new session
// goes on: a signed-in user's token still answers. The alert's inputs
// say the bucket is past 80 % of its cap. Once there is room, sign-ins
// work again. The cap is lowered to what the bucket holds, as EXPECTED_*
// settings too small for the deployment would leave it.
func TestAFullSessionsBucketRefusesSignInsClearly(t *testing.T) {
	w := newStack(t)
	edge := w.Edge("edge-a", nil)
	ann := testenv.NewClient(t, edge.URL)
	token := ann.Signup("ann", invite)
	ctx := testenv.Context(t, time.Minute)
	kvs, err := w.JS.KeyValue(ctx, state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := w.JS.Stream(ctx, "KV_"+state.BucketSessions)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	setCap := func(maxBytes int64) {
		t.Helper()
		cfg := info.Config
		cfg.MaxBytes = maxBytes
		if _, err := w.JS.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
	}
	held := info.State.Bytes
	setCap(int64(held))
	keys := func() int {
		t.Helper()
		ks, err := kvs.ListKeys(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for range ks.Keys() {
			n++
		}
		return n
	}
	before := keys()

	login := func(token string) *testenv.Response {
		return testenv.NewClient(t, edge.URL).Do(http.MethodPost, "/login", nil, "Authorization", "Bearer "+token, "Accept", "application/json")
	}
	full := func(r *testenv.Response, what string) {
		t.Helper()
		if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "store for this is full") {
			t.Fatalf("%s into a full sessions bucket: %d %s, want 503 saying the store is full", what, r.StatusCode, r.Body)
		}
	}
	full(login(token), "a sign-in")
	// A signup makes the account (its claim is not a session) and hands
	// out its token, shown never again, with the reason it is not signed
	// in: the user signs in with it once there is room.
	r := testenv.NewClient(t, edge.URL).Form("/users", "user", "bea", "invite", invite)
	full(r, "a signup")
	bea, _ := r.JSON()["token"].(string)
	cookies := strings.Join(r.Header.Values("Set-Cookie"), "; ")
	if r.JSON()["signed_in"] != false || bea == "" || strings.Contains(cookies, "dsh_gw_session=") {
		t.Fatalf("a signup not signed in: %s (Set-Cookie %q), want its token and no session", r.Body, cookies)
	}
	// The form's page shows the token too, saying why it is not signed in.
	r = testenv.NewClient(t, edge.URL).Do(http.MethodPost, "/users", strings.NewReader(url.Values{"user": {"cy"}, "invite": {invite}}.Encode()),
		"Content-Type", "application/x-www-form-urlencoded", "Accept", "text/html")
	if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "you are not signed in") || !strings.Contains(string(r.Body), `id="token">cy.`) {
		t.Fatalf("a signup from the form into a full sessions bucket: %d %s, want the token page saying it is not signed in", r.StatusCode, r.Body)
	}
	if n := keys(); n != before {
		t.Fatalf("refused sign-ins stored sessions: %d keys, had %d", n, before)
	}
	// The positive control, in the same window: reading needs no room.
	expect(t, testenv.NewClient(t, edge.URL).Do(http.MethodGet, "/_/status", nil, "Authorization", "Bearer "+token, "Accept", "application/json"), http.StatusOK, "ann's token while the sessions bucket is full")
	// AaasNATSStreamNearlyFull: bytes over cap past 0.8, as the edge
	// exports them.
	testutil.Eventually(t, 30*time.Second, func() error {
		used, err := edge.MetricSum("aaas_nats_stream_bytes", "stream", "KV_"+state.BucketSessions)
		if err != nil {
			return err
		}
		capped, err := edge.MetricSum("aaas_nats_stream_max_bytes", "stream", "KV_"+state.BucketSessions)
		if err != nil {
			return err
		}
		if capped == 0 || used/capped <= 0.8 {
			return fmt.Errorf("the edge exports %v of %v bytes: the alert would not fire", used, capped)
		}
		return nil
	})

	setCap(info.Config.MaxBytes)
	expect(t, login(token), http.StatusOK, "a sign-in once the bucket has room")
	expect(t, login(bea), http.StatusOK, "bea's sign-in with the token her signup handed out")
	if n := keys(); n != before+2 {
		t.Fatalf("%d session keys after two sign-ins, want %d", n, before+2)
	}
}
