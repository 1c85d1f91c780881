// Package models_test is the model broker end to end: a chat typed in a
// user's DSH (dshsim) in Chromium streams through the edge, dshsim, the
// broker and the provider stand-in, and is attributed, metered, budgeted
// and paid for as issue 23 says. The real providers cannot be reached
// from here: internal/dev/providersim stands in for them, at the far end
// only.
package models_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/dev/providersim"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

const (
	gatewayName = "aaas.example.com"
	sandboxZone = "sbx.example.com"
	orgKey      = "org-key-0000000000000001"
	annKey      = "ann-own-key-000000009876"
	model       = "deepseek-chat"
	// budget is BROKER_BUDGET_DEFAULT: 10 micro-USD, less than one chat
	// (3 input tokens at 0.27 and 12 output at 1.10 per million: 14), so
	// a user's first chat is admitted and their second is not.
	budget = "0.00001"
)

// world is one edge in subdomain mode, two brokers behind one address (as
// behind their Service), and the stand-in.
type world struct {
	*testenv.Stack
	t          *testing.T
	port       string
	edge       *testenv.Edge
	brokers    map[string]*testenv.Broker
	brokerAddr string
	sim        *providersim.Server
	usage      *kv.Bucket[state.Usage]
}

func newWorld(t *testing.T) *world { return newWorldWith(t, time.Second, nil) }

// newWorldWith is newWorld with the stand-in's -slow models holding
// their first byte for slow, and env set for every process.
func newWorldWith(t *testing.T, slow time.Duration, env map[string]string) *world {
	t.Helper()
	sim := providersim.New(providersim.Options{Keys: []string{orgKey, annKey}, Slow: slow, TokenInterval: 50 * time.Millisecond})
	simSrv := httptest.NewServer(sim)
	t.Cleanup(simSrv.Close)
	w := &world{t: t, sim: sim, brokerAddr: testenv.FreeAddr(t)}
	// Every base URL the template sets points at the broker, as the
	// manifests do at its Service.
	w.Stack = pkg.NewStack(t, testenv.StackOptions{Lifecycle: "lc-a", Sandbox: testenv.SandboxesCallBroker(w.brokerAddr)})
	pair, err := credentials.Generate()
	if err != nil {
		t.Fatal(err)
	}
	keys := t.TempDir()
	if err := os.WriteFile(filepath.Join(keys, "deepseek"), []byte(orgKey), 0o600); err != nil {
		t.Fatal(err)
	}
	providers, _ := json.Marshal([]config.Provider{{Name: "deepseek", API: config.APIOpenAI, BaseURL: simSrv.URL, Models: []string{model, model + "-long", model + "-slow"}}})
	prices, _ := json.Marshal(map[string]config.Price{model: {Input: 0.27, Output: 1.10}, model + "-long": {Input: 0.27, Output: 1.10}, model + "-slow": {Input: 0.27, Output: 1.10}})
	addr := testenv.FreeAddr(t)
	_, w.port, _ = net.SplitHostPort(addr)
	for k, v := range env {
		w.Env[k] = v
	}
	w.Env["SANDBOX_DOMAIN"] = sandboxZone + ":" + w.port
	w.Env["BROKER_BUDGET_DEFAULT"] = budget
	w.Env["BROKER_BYOK"] = "true"
	w.Env["BROKER_PROVIDERS"] = string(providers)
	w.edge = w.Edge("edge-a", map[string]string{
		"LISTEN_ADDR": addr, "PUBLIC_HOSTS": gatewayName + ":" + w.port,
		"CREDENTIALS_PUBLIC_KEY": base64.StdEncoding.EncodeToString(pair.Public[:]),
	})
	brokerEnv := map[string]string{
		"BROKER_KEYS_DIR": keys, "BROKER_PRICES": string(prices),
		"CREDENTIALS_KEYS": base64.StdEncoding.EncodeToString(pair.Private[:]),
	}
	w.brokers = map[string]*testenv.Broker{}
	var backends []string
	for _, id := range []string{"broker-a", "broker-b"} {
		w.brokers[id] = w.Broker(id, brokerEnv)
		backends = append(backends, strings.TrimPrefix(w.brokers[id].URL, "http://"))
	}
	testenv.NewBalancer(t, w.brokerAddr, backends...)
	w.usage, err = kv.Open[state.Usage](testenv.Context(t, time.Minute), w.JS, state.BucketUsage)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func (w *world) gateway() string { return "http://" + gatewayName + ":" + w.port }

// client is a client of the gateway's name, sent to the edge as DNS would.
func (w *world) client() *testenv.Client {
	c := testenv.NewClient(w.t, w.gateway())
	c.HTTP.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", "127.0.0.1:"+w.port)
	}}
	return c
}
func (w *world) sandbox(u string) string { return "http://" + u + "." + sandboxZone + ":" + w.port }

// month is user's usage this month (zero when none).
func (w *world) month(user string) state.Usage {
	w.t.Helper()
	e, err := w.usage.Get(testenv.Context(w.t, time.Minute), state.UsageKey(user, state.Month(time.Now())))
	if err != nil {
		return state.Usage{}
	}
	return e.Value
}

// callsWith counts the calls the stand-in answered with a key ending in hint.
func (w *world) callsWith(hint string, status int) int {
	n := 0
	for _, c := range w.sim.Calls() {
		if c.KeyHint == hint && c.Status == status {
			n++
		}
	}
	return n
}

// browserFor is Chromium signed in as user on the gateway, then on
// user's sandbox origin.
func (w *world) browserFor(user, token string) context.Context {
	w.t.Helper()
	ctx := testenv.Browser(w.t,
		chromedp.Flag("host-resolver-rules", "MAP *.example.com 127.0.0.1"),
		chromedp.Flag("disable-features", "Translate,BlinkGenPropertyTrees,HttpsUpgrades"),
	)
	testenv.Do(w.t, ctx, "sign in on the gateway as "+user,
		chromedp.Navigate(w.gateway()+"/"),
		chromedp.SendKeys(chromedp.ID("login-token"), token),
		chromedp.Click(chromedp.ID("login-submit")),
	)
	// Signed in, the gateway sends the browser on to the sandbox's
	// origin, which signs it in there.
	// (Evaluated again after each navigation: a poll does not survive
	// the page it runs in.)
	testutil.Eventually(w.t, 3*time.Minute, func() error {
		at, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById("chat-input") ? location.origin : ""`))
		if err != nil || at != w.sandbox(user) {
			return fmt.Errorf("%s's DSH not open yet: at %q, %v", user, at, err)
		}
		return nil
	})
	return ctx
}

// chat sends message (with modelName, "" for DSH's default) from the open
// DSH page and waits for the reply to end; it returns the reply's text or
// the error the page shows.
func (w *world) chat(ctx context.Context, message, modelName string) (reply, shown string) {
	w.t.Helper()
	// Replies this page streamed end "done"; those it loaded from the
	// history do not.
	n := testenv.Get(w.t, ctx, "replies so far", chromedp.Evaluate[int](`document.querySelectorAll("#chat-log .assistant.done").length`))
	errs := testenv.Get(w.t, ctx, "errors so far", chromedp.Evaluate[int](`document.querySelectorAll("#chat-log .error").length`))
	testenv.Do(w.t, ctx, "send "+message,
		// The page's script takes the form once the page has loaded.
		testenv.Until(`document.readyState === "complete"`, time.Minute),
		chromedp.Evaluate[chromedp.Void](fmt.Sprintf(`document.getElementById("chat-model").value = %q`, modelName)),
		chromedp.SendKeys(chromedp.ID("chat-input"), message+"\n"),
		testenv.Until(fmt.Sprintf(`document.querySelectorAll("#chat-log .assistant.done").length > %d`, n), 2*time.Minute),
	)
	reply = testenv.Get(w.t, ctx, "the reply", chromedp.Evaluate[string](`[...document.querySelectorAll("#chat-log .assistant")].pop().textContent`))
	shown = testenv.Get(w.t, ctx, "the error shown", chromedp.Evaluate[string](fmt.Sprintf(`[...document.querySelectorAll("#chat-log .error")].slice(%d).map(e => e.textContent).join("\n")`, errs)))
	return reply, shown
}

// A chat typed in ann's DSH in Chromium is a streamed model call, made
// with the organisation's key by the broker (the sandbox holds only the
// placeholder), metered to ann and not to bob. Her second chat would
// start over the budget: she sees the broker's 429 message in her chat,
// and nothing reaches the provider. With her own key stored on her page
// (BYOK) her chat goes through again, with her key, metered apart and
// not charged.
func TestChatIsAMeteredModelCallInTheBrowser(t *testing.T) {
	w := newWorld(t)
	annToken := w.client().Signup("ann", "")
	w.client().Signup("bob", "")
	ctx := w.browserFor("ann", annToken)

	reply, shown := w.chat(ctx, "hello there friend", "")
	if !strings.HasPrefix(reply, "echo: hello there friend") || shown != "" {
		t.Fatalf("ann's chat: reply %q, shown %q", reply, shown)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if u := w.month("ann"); u.Calls != 1 || u.InputTokens != 3 || u.OutputTokens != 12 || u.CostMicros != 14 {
			return fmt.Errorf("ann's month: %+v", u)
		}
		return nil
	})
	if u := w.month("bob"); u.Calls != 0 {
		t.Fatalf("bob was charged for ann's call: %+v", u)
	}
	if n := w.callsWith(orgKey[len(orgKey)-4:], 200); n != 1 {
		t.Fatalf("the stand-in answered %d calls with the organisation's key, want 1: %+v", n, w.sim.Calls())
	}

	// Over budget: the broker answers, the provider hears nothing.
	reply, shown = w.chat(ctx, "once more please", "")
	if !strings.Contains(shown, "budget") || !strings.Contains(shown, "$0.00") {
		t.Fatalf("ann over budget: reply %q, shown %q; want the broker's budget message", reply, shown)
	}
	if n := len(w.sim.Calls()); n != 1 {
		t.Fatalf("the stand-in saw %d calls after the refused one, want 1", n)
	}
	if u := w.month("ann"); u.Calls != 1 {
		t.Fatalf("the refused call was metered: %+v", u)
	}

	// Her own key, stored on her page on the gateway: used, not charged.
	testenv.Do(t, ctx, "store ann's own key",
		chromedp.Navigate(w.gateway()+"/"),
		chromedp.SendKeys(chromedp.ID("key-input-deepseek"), annKey),
		chromedp.Click(chromedp.ID("store-key-deepseek")),
	)
	var page string
	testutil.Eventually(t, time.Minute, func() error {
		page, _ = chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
		if !strings.Contains(page, annKey[len(annKey)-4:]) {
			return fmt.Errorf("ann's page after storing her key: %q", page)
		}
		return nil
	})
	if strings.Contains(page, annKey) {
		t.Fatalf("ann's page shows her key: %q", page)
	}
	testenv.Do(t, ctx, "back to ann's DSH", chromedp.Navigate(w.sandbox("ann")+"/"), chromedp.WaitVisible(chromedp.ID("chat-input")))
	reply, shown = w.chat(ctx, "with my own key", "")
	if !strings.HasPrefix(reply, "echo: with my own key") || shown != "" {
		t.Fatalf("ann's chat with her own key: reply %q, shown %q", reply, shown)
	}
	if n := w.callsWith(annKey[len(annKey)-4:], 200); n != 1 {
		t.Fatalf("the stand-in answered %d calls with ann's own key, want 1: %+v", n, w.sim.Calls())
	}
	testutil.Eventually(t, time.Minute, func() error {
		if u := w.month("ann"); u.BYOKCalls != 1 || u.BYOKCostMicros == 0 || u.CostMicros != 14 || u.Calls != 2 {
			return fmt.Errorf("ann's month after her own key's call: %+v (want it counted apart, not charged)", u)
		}
		return nil
	})
}

// A broker killed mid-stream, one of two behind one address: the reply it
// was relaying breaks off and the page says so; the call it completed
// before is counted; the next chat goes to the other replica and is
// metered.
func TestABrokerKilledMidStream(t *testing.T) {
	w := newWorld(t)
	token := w.client().Signup("cy", "")
	// Over the world's default budget by the second chat: cy has none.
	budgets, err := kv.Open[state.Budget](testenv.Context(t, time.Minute), w.JS, state.BucketBudgets)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := budgets.Put(testenv.Context(t, time.Minute), state.BudgetKey(state.BudgetUser, "cy"),
		state.Budget{Scope: state.BudgetUser, Name: "cy", Unlimited: true, SetBy: "test", At: time.Now()}); err != nil {
		t.Fatal(err)
	}
	ctx := w.browserFor("cy", token)
	if reply, shown := w.chat(ctx, "first", model); !strings.HasPrefix(reply, "echo: first") || shown != "" {
		t.Fatalf("the first chat: reply %q, shown %q", reply, shown)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if u := w.month("cy"); u.Calls != 1 {
			return fmt.Errorf("cy's month: %+v (want the first call)", u)
		}
		return nil
	})
	started := w.firstBytes()
	n := testenv.Get(t, ctx, "replies so far", chromedp.Evaluate[int](`document.querySelectorAll("#chat-log .assistant").length`))
	testenv.Do(t, ctx, "start a long reply",
		chromedp.Evaluate[chromedp.Void](fmt.Sprintf(`document.getElementById("chat-model").value = %q`, model+"-long")),
		chromedp.SendKeys(chromedp.ID("chat-input"), "keep talking\n"),
		testenv.Until(fmt.Sprintf(`[...document.querySelectorAll("#chat-log .assistant")].length > %d && [...document.querySelectorAll("#chat-log .assistant")].pop().textContent.length > 20`, n), 2*time.Minute),
	)
	// The broker relaying it is the one that relayed one more first byte.
	var victim, survivor string
	for id, count := range w.firstBytes() {
		if count > started[id] {
			victim = id
		} else {
			survivor = id
		}
	}
	if victim == "" || survivor == "" {
		t.Fatalf("first bytes before %v, during the long reply %v: no one broker relays it", started, w.firstBytes())
	}
	served, err := w.brokers[survivor].MetricSum("aaas_broker_calls_total", "code", "2xx")
	if err != nil {
		t.Fatal(err)
	}
	w.brokers[victim].Kill()
	testenv.Do(t, ctx, "the reply ends",
		testenv.Until(fmt.Sprintf(`document.querySelectorAll("#chat-log .assistant.done").length > %d`, n), 2*time.Minute),
	)
	shown := testenv.Get(t, ctx, "the error shown", chromedp.Evaluate[string](`[...document.querySelectorAll("#chat-log .error")].map(e => e.textContent).join("\n")`))
	if shown == "" {
		t.Fatalf("the page shows nothing after %s died mid-reply", victim)
	}
	t.Logf("%s killed; the page says: %s", victim, shown)
	reply, shown := w.chat(ctx, "are you back", model)
	if !strings.HasPrefix(reply, "echo: are you back") || shown != "" {
		t.Fatalf("the chat after %s died: reply %q, shown %q", victim, reply, shown)
	}
	if now, err := w.brokers[survivor].MetricSum("aaas_broker_calls_total", "code", "2xx"); err != nil || now != served+1 {
		t.Fatalf("%s served %v calls after the kill, want %v: %v", survivor, now, served+1, err)
	}
	// The first call and the retry; the broken one never ended on a
	// broker that lived to record it.
	testutil.Eventually(t, time.Minute, func() error {
		if u := w.month("cy"); u.Calls != 2 || u.OutputTokens != 24 || u.CostMicros == 0 {
			return fmt.Errorf("cy's month: %+v (want the two completed calls)", u)
		}
		return nil
	})
}

// An agent is not a page: a chat the user starts and then closes the
// browser on keeps its model call running for over three IDLE_TIMEOUTs,
// and the broker's beacons keep the sandbox awake the whole time; it is
// suspended IDLE_TIMEOUT after the call ends, by the activity stream's
// clock.
func TestAgentWorkKeepsTheSandboxAwakeWithoutABrowser(t *testing.T) {
	idle := 4 * time.Second
	w := newWorldWith(t, 3*idle+2*time.Second, map[string]string{
		"IDLE_TIMEOUT": idle.String(), "SWEEP_INTERVAL": "200ms", "BEACON_INTERVAL": "1s", "BEACON_TTL": "3s",
	})
	sweeps := map[string]*testenv.Sweeps{"sw-a": testenv.FollowSweeps(t, w.Sweeper("sw-a", nil))}
	token := w.client().Signup("dee", "")
	ctx := w.browserFor("dee", token)
	testenv.Do(t, ctx, "ask the agent for something slow",
		testenv.Until(`document.readyState === "complete"`, time.Minute),
		chromedp.Evaluate[chromedp.Void](fmt.Sprintf(`document.getElementById("chat-model").value = %q`, model+"-slow")),
		chromedp.SendKeys(chromedp.ID("chat-input"), "take your time\n"),
	)
	// The call is under way once a broker has said so on the activity
	// stream.
	testutil.Eventually(t, time.Minute, func() error {
		for edge := range w.Idleness("dee").Stamped {
			if strings.HasPrefix(edge, "broker-") {
				return nil
			}
		}
		return fmt.Errorf("no broker beacon for dee yet")
	})
	chromedp.Cancel(ctx) // the laptop closes
	closed := time.Now()
	// The sandbox stays Ready while the call runs.
	wctx, cancel := context.WithCancel(testenv.Context(t, 5*time.Minute))
	defer cancel()
	left := make(chan state.Phase, 1)
	go func() {
		if e, _, err := w.Sandboxes().Wait(wctx, "dee", func(e kv.Entry[state.Sandbox], _ bool) bool { return e.Value.Phase != state.PhaseReady }); err == nil {
			left <- e.Value.Phase
		}
	}()
	var ended time.Time
	testutil.Eventually(t, 3*time.Minute, func() error {
		select {
		case p := <-left:
			t.Fatalf("dee's sandbox became %s while the agent's call ran, %s after the browser closed", p, time.Since(closed))
		default:
		}
		for _, c := range w.sim.Calls() {
			if c.Model == model+"-slow" && c.Status == http.StatusOK {
				ended = time.Now()
				return nil
			}
		}
		return fmt.Errorf("the agent's call is still running")
	})
	if ran := ended.Sub(closed); ran < 3*idle {
		t.Fatalf("the call ended %s after the browser closed: not the three IDLE_TIMEOUTs (%s) this test is about", ran, 3*idle)
	}
	testutil.Eventually(t, 2*time.Minute, func() error {
		select {
		case p := <-left:
			if p == state.PhaseSuspending || p == state.PhaseSuspended {
				return nil
			}
			t.Fatalf("dee's sandbox became %s", p)
		default:
		}
		return fmt.Errorf("dee's sandbox not suspended yet")
	})
	w.DecidedOnTime("dee", idle, sweeps)
	if d, ok := w.Decision("dee"); !ok || d.At.Sub(ended) < idle-2*time.Second {
		t.Fatalf("decided %s after the call ended; IDLE_TIMEOUT is %s", d.At.Sub(ended), idle)
	}
}

// firstBytes is each live broker's count of answers whose first byte it
// relayed.
func (w *world) firstBytes() map[string]float64 {
	w.t.Helper()
	out := map[string]float64{}
	for id, b := range w.brokers {
		n, err := b.MetricSum("aaas_broker_first_byte_seconds_count")
		if err != nil {
			w.t.Fatalf("%s: %v", id, err)
		}
		out[id] = n
	}
	return out
}

// NATS loses everything between two of a user's chats. No process is
// restarted: the brokers' caches notice the recreated buckets and reload
// (their reload count proves the loss reached them), lifecycle writes the
// account and sandbox back from the claim, and the user, signed in again
// with her token (her sessions were in NATS), chats through the same
// brokers: the call is attributed to her from the reloaded sandboxes and
// metered in the new usage bucket, which holds only it. The spend before
// the loss is gone with NATS, as README's "Losing NATS entirely" says, so
// this chat, which the default budget would have refused, is admitted.
func TestModelCallsAfterNATSLosesEverything(t *testing.T) {
	w := newWorld(t)
	token := w.client().Signup("eve", "")
	if reply, shown := w.chat(w.browserFor("eve", token), "before", model); !strings.HasPrefix(reply, "echo: before") || shown != "" {
		t.Fatalf("the chat before the loss: reply %q, shown %q", reply, shown)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if u := w.month("eve"); u.Calls != 1 {
			return fmt.Errorf("eve's month: %+v (want the first call)", u)
		}
		return nil
	})
	reloads := map[string]float64{}
	for id, b := range w.brokers {
		n, err := b.MetricSum("aaas_kv_cache_reloads_total")
		if err != nil {
			t.Fatal(err)
		}
		reloads[id] = n
	}

	w.LoseNATS()
	testutil.Eventually(t, 90*time.Second, func() error {
		for id, b := range w.brokers {
			if n, err := b.MetricSum("aaas_kv_cache_reloads_total"); err != nil || n <= reloads[id] {
				return fmt.Errorf("%s's caches reloaded %v times (%v before the loss): %v", id, n, reloads[id], err)
			}
		}
		if r := w.client().Do("GET", "/_/status", nil, "Accept", "application/json", "Authorization", "Bearer "+token); r.StatusCode != http.StatusOK {
			return fmt.Errorf("eve's token after the loss: %d", r.StatusCode)
		}
		return nil
	})
	if reply, shown := w.chat(w.browserFor("eve", token), "after", model); !strings.HasPrefix(reply, "echo: after") || shown != "" {
		t.Fatalf("the chat after the loss: reply %q, shown %q", reply, shown)
	}
	testutil.Eventually(t, time.Minute, func() error {
		if u := w.month("eve"); u.Calls != 1 || u.CostMicros == 0 {
			return fmt.Errorf("eve's month in the new bucket: %+v (want the one call since the loss)", u)
		}
		return nil
	})
}
