package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// Browser starts headless Chromium (Debian's, which `make tools`
// installs) and returns a chromedp context for one tab. JavaScript
// dialogs (confirm()) are accepted. extra adds or overrides command-line
// switches (host resolver rules, for instance).
func Browser(t testing.TB, extra ...chromedp.ExecAllocatorOption) context.Context {
	t.Helper()
	bin, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium not installed: run `make tools`")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(bin),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
	)
	opts = append(opts, extra...)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	dialogs := chromedp.Events(ctx, page.JavascriptDialogOpening)
	go func() {
		for _, err := range dialogs {
			if err != nil {
				return
			}
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: true})
		}
	}()
	return ctx
}

// Do runs browser steps with a deadline; on failure it saves a screenshot
// and fails the test.
func Do(t testing.TB, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	Get(t, ctx, what, chromedp.Steps(steps...))
}

// Get runs one browser action and returns its value (see Do).
func Get[T any](t testing.TB, ctx context.Context, what string, a chromedp.Action[T]) T {
	t.Helper()
	tctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	v, err := chromedp.Run(tctx, a)
	if err != nil {
		Screenshot(t, ctx, "failure-"+strings.ReplaceAll(t.Name(), "/", "_"))
		t.Fatalf("%s: %v", what, err)
	}
	return v
}

// Cookies lists the names of the cookies the browser sends to the current
// page.
func Cookies(t testing.TB, ctx context.Context) []string {
	t.Helper()
	res, err := chromedp.Call(ctx, network.GetCookies, network.GetCookiesParams{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range res.Cookies {
		names = append(names, c.Name)
	}
	return names
}

// ArtifactDir is where tests leave files for people to look at:
// $AAAS_ARTIFACT_DIR, else test-artifacts/ at the repository root.
func ArtifactDir(t testing.TB) string {
	dir := os.Getenv("AAAS_ARTIFACT_DIR")
	if dir == "" {
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			t.Fatal(err)
		}
		dir = filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), "test-artifacts")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Screenshot saves the current page as <name>.png in the artifact dir.
func Screenshot(t testing.TB, ctx context.Context, name string) string {
	sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Logf("screenshot %s: %v", name, err)
		return ""
	}
	path := filepath.Join(ArtifactDir(t), name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Logf("screenshot %s: %v", name, err)
	}
	return path
}

// Until waits for a JavaScript expression to become true.
func Until(expr string, timeout time.Duration) chromedp.Action[chromedp.Void] {
	p := chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(timeout))
	return func(ctx context.Context, t *chromedp.Target) (chromedp.Void, error) {
		_, err := p(ctx, t)
		return chromedp.Void{}, err
	}
}
