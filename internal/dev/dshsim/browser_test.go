package dshsim

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// The page shows a model's reply while it streams, and a provider's
// refusal as its message, in headless Chromium. The provider stand-in and a
// refusing server (as the broker refuses an exhausted budget) are the far
// ends.
func TestPageShowsTheStreamingReplyAndTheProvidersMessage(t *testing.T) {
	_, hs := newProvider(t)
	f, _ := modelFixture(t, "openai", hs.URL, providerKey)
	const budget = "your model budget of $5.00 for 2026-12 is spent ($5.02 used); it renews on 2027-01-01"
	broker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = io.WriteString(w, `{"error":{"message":"`+budget+`","type":"insufficient_quota","code":"budget_exceeded"}}`)
	}))
	t.Cleanup(broker.Close)
	f2, _ := modelFixture(t, "deepseek", broker.URL, providerKey)
	// Last, so that its cleanup, which closes the browser, runs before the
	// servers' (they wait for the page's streams to end).
	ctx := testenv.Browser(t)
	testenv.Do(t, ctx, "a reply still streaming is on the page",
		chromedp.Navigate(f.ts.URL+"/?token="+f.srv.Token()),
		chromedp.WaitVisible(chromedp.ID("chat-input")),
		chromedp.SendKeys(chromedp.ID("chat-model"), "sim-long"),
		chromedp.SendKeys(chromedp.ID("chat-input"), "go on\n"),
		// -long never ends by itself: text before "done" is text streamed.
		testenv.Until(`(() => {
			const p = document.querySelector("#chat-log .assistant");
			return !!p && p.textContent.startsWith("echo: go on go on") && !p.classList.contains("done");
		})()`, 30*time.Second),
	)
	testenv.Do(t, ctx, "a provider failure is shown as its message",
		chromedp.SetValue(chromedp.ID("chat-model"), "sim-fail"),
		chromedp.SendKeys(chromedp.ID("chat-input"), "hi\n"),
		testenv.Until(`[...document.querySelectorAll("#chat-log .error")].some(p =>
			p.textContent === "providersim: simulated provider failure (model ends in -fail)")`, 30*time.Second),
	)

	testenv.Do(t, ctx, "the budget refusal is in the chat",
		chromedp.Navigate(f2.ts.URL+"/?token="+f2.srv.Token()),
		chromedp.WaitVisible(chromedp.ID("chat-input")),
		chromedp.SendKeys(chromedp.ID("chat-input"), "hi\n"),
		testenv.Until(`[...document.querySelectorAll("#chat-log .error")].some(p => p.textContent === `+"`"+budget+"`"+`)
			&& document.querySelector("#chat-log .assistant").classList.contains("done")`, 30*time.Second),
	)
	testenv.Screenshot(t, ctx, "dshsim-budget-refusal")
}
