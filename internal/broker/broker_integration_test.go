package broker_test

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

// clientFrom is an HTTP client whose connections come from ip, as a
// pod's come from its pod IP (every 127/8 address is local on Linux).
func clientFrom(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 10 * time.Second}
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}, Timeout: time.Minute}
}

// The broker binary, on real NATS, knows a call's user by its source
// address alone: a client sending from the address of ann's Ready
// sandbox is forwarded (with the broker's key); one from an address no
// sandbox has is 403 whatever it claims, and the provider sees nothing;
// once ann's sandbox is suspended her old address is refused too.
func TestAttributionBySourceAddress(t *testing.T) {
	st := pkg.NewStack(t, testenv.StackOptions{})
	// The provider's far end: an httptest server standing in for the
	// provider, recording the calls that reached it.
	var mu sync.Mutex
	var reached []string
	far := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		reached = append(reached, r.Header.Get("Authorization"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
	}))
	t.Cleanup(far.Close)
	seen := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), reached...)
	}

	base := fmt.Sprintf("127.%d.%d.", 100+rand.IntN(100), rand.IntN(250))
	annIP, strangerIP := base+"10", base+"11"
	ctx := testenv.Context(t, 2*time.Minute)
	boxes, err := kv.Open[state.Sandbox](ctx, st.JS, state.BucketSandboxes)
	if err != nil {
		t.Fatal(err)
	}
	ready := state.Sandbox{User: "ann", Phase: state.PhaseReady, Managed: true, Claim: "ann", PodIP: annIP, Updated: time.Now()}
	if _, err := boxes.Put(ctx, "ann", ready); err != nil {
		t.Fatal(err)
	}

	keys := t.TempDir()
	if err := os.WriteFile(filepath.Join(keys, "deepseek"), []byte("sk-broker-key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	providers, _ := json.Marshal([]config.Provider{{Name: "deepseek", API: config.APIOpenAI, BaseURL: far.URL, Models: []string{"deepseek-chat"}}})
	b := st.Broker("broker-1", map[string]string{"BROKER_PROVIDERS": string(providers), "BROKER_KEYS_DIR": keys})

	call := func(from string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/deepseek/chat/completions", strings.NewReader(`{"model":"deepseek-chat","user":"ann"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer aaas-broker")
		req.Header.Set("X-Forwarded-For", annIP)
		resp, err := clientFrom(from).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}

	// The index was loaded before the broker was ready: no waiting.
	if code, body := call(annIP); code != 200 || !strings.Contains(body, "hi") {
		t.Fatalf("ann's call: %d %s", code, body)
	}
	if got := seen(); len(got) != 1 || got[0] != "Bearer sk-broker-key" {
		t.Fatalf("the provider saw %q", got)
	}
	code, body := call(strangerIP)
	if code != 403 || !strings.Contains(body, "not a running sandbox") || !strings.Contains(body, `"permission_error"`) {
		t.Fatalf("a stranger's call: %d %s", code, body)
	}
	if n, _ := b.MetricSum("aaas_broker_refused_total", "reason", "unattributed"); n != 1 {
		t.Fatalf("refusals counted: %v", n)
	}

	suspended := ready
	suspended.Phase, suspended.Updated = state.PhaseSuspended, time.Now()
	if _, err := boxes.Put(ctx, "ann", suspended); err != nil {
		t.Fatal(err)
	}
	// Until the broker's index sees the suspension, a call from the address
	// is still ann's and goes through; those are counted, not refused.
	served := 1
	testutil.Eventually(t, time.Minute, func() error {
		code, body := call(annIP)
		if code == 200 {
			served++
		}
		if code != 403 {
			return fmt.Errorf("a suspended sandbox's address: %d %s", code, body)
		}
		return nil
	})
	if code, body := call(annIP); code != 403 {
		t.Fatalf("a suspended sandbox's address, again: %d %s", code, body)
	}
	if got := seen(); len(got) != served {
		t.Fatalf("refused calls reached the provider: %d calls, %d served", len(got), served)
	}
	if n, _ := b.MetricSum("aaas_broker_calls_total", "code", "2xx"); n != float64(served) {
		t.Fatalf("calls counted: %v, %d served", n, served)
	}
}
