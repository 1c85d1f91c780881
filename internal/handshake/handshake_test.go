package handshake_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/dshsim"
	"github.com/aaas-project/aaas/internal/handshake"
)

func TestTokenFromLogTakesTheNewestLineThroughNoise(t *testing.T) {
	log := strings.Join([]string{
		"dsh: loading config from /home/node/.dsh",
		"\x1b[32mdsh web: http://0.0.0.0:3080/?token=OLDOLDOLDOLDOLDOLDOLDOLD\x1b[0m",
		"model: here is how you pass ?token=not-a-real-token to a server",
		"dsh web: 1 client connected",
		"\x1b[1m\x1b[32mdsh web: http://0.0.0.0:3080/?token=NEW_new-NEW_new-NEW_new-1234\x1b[0m\r",
		"\x1b[33mmodel output: dsh web: http://example/?token=short\x1b[0m",
		"",
	}, "\n")
	got, err := handshake.TokenFromLog([]byte(log))
	if err != nil || got != "NEW_new-NEW_new-NEW_new-1234" {
		t.Fatalf("token = %q, %v", got, err)
	}
}

// The tenant controls its log: fake token lines printed after the real one
// come first, but are bounded, and repeats are tried once.
func TestTokensFromLogAreNewestFirstAndBounded(t *testing.T) {
	lines := []string{"dsh web: http://0.0.0.0:3080/?token=REALREALREALREALREALREAL"}
	for i := 0; i < 20; i++ {
		lines = append(lines, fmt.Sprintf("dsh web: http://0.0.0.0:3080/?token=FAKEFAKEFAKEFAKEFAKE%04d", i%10))
	}
	got, err := handshake.TokensFromLog([]byte(strings.Join(lines, "\n")))
	var want []string
	for i := 9; len(want) < handshake.MaxCandidates; i-- {
		want = append(want, fmt.Sprintf("FAKEFAKEFAKEFAKEFAKE%04d", i))
	}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("tokens = %q, %v; want %q", got, err, want)
	}
	got, _ = handshake.TokensFromLog([]byte(strings.Join(lines[:2], "\n")))
	if !slices.Equal(got, []string{"FAKEFAKEFAKEFAKEFAKE0000", "REALREALREALREALREALREAL"}) {
		t.Fatalf("tokens = %q", got)
	}
}

func TestTokenFromLogWithoutTokenLine(t *testing.T) {
	for _, log := range []string{"", "dsh: starting\nmodel: ?token=abcdefabcdefabcdefabcdef\n", "dsh web: listening on :3080"} {
		if _, err := handshake.TokenFromLog([]byte(log)); !errors.Is(err, handshake.ErrNoToken) {
			t.Errorf("log %q: err = %v, want ErrNoToken", log, err)
		}
	}
}

func TestSealBindsToKeyAndAdditionalData(t *testing.T) {
	key, err := handshake.ParseKey("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=")
	if err != nil {
		t.Fatal(err)
	}
	s, _ := handshake.NewSealer(key)
	sealed := s.Seal([]byte("dsh-auth-1=secret"), []byte("bob.uid.host"))
	if bytes.Contains(sealed, []byte("secret")) {
		t.Fatal("plaintext visible in sealed value")
	}
	if got, err := s.Open(sealed, []byte("bob.uid.host")); err != nil || string(got) != "dsh-auth-1=secret" {
		t.Fatalf("open = %q, %v", got, err)
	}
	if _, err := s.Open(sealed, []byte("alice.uid.host")); !errors.Is(err, handshake.ErrUnseal) {
		t.Fatalf("opened under another key: %v", err)
	}
	other, _ := handshake.NewSealer(bytes.Repeat([]byte{7}, 32))
	if _, err := other.Open(sealed, []byte("bob.uid.host")); !errors.Is(err, handshake.ErrUnseal) {
		t.Fatalf("opened with another key: %v", err)
	}
	for _, bad := range []string{"", "short", strings.Repeat("a", 63)} {
		if _, err := handshake.ParseKey(bad); err == nil {
			t.Errorf("key %q accepted", bad)
		}
	}
}

// startDSH runs the simulator in-process and returns its address and the
// token it printed.
func startDSH(t *testing.T, trusted ...string) (*httptest.Server, *dshsim.Server) {
	t.Helper()
	dir := t.TempDir()
	s, err := dshsim.NewServer(dshsim.Options{Listen: "127.0.0.1:0", DSHHome: dir + "/dsh", Workspace: dir + "/ws", TrustedHosts: trusted, AuthTTL: time.Hour}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(ts.Close)
	return ts, s
}

func TestExchangeAgainstDSH(t *testing.T) {
	ts, dsh := startDSH(t, "gw.example.com")
	addr := strings.TrimPrefix(ts.URL, "http://")
	ctx := context.Background()

	cookie, err := handshake.Exchange(ctx, handshake.Client(), handshake.Request{Address: addr, Token: dsh.Token(), Host: "gw.example.com", Proto: "https", Prefix: "/u/bob"})
	if err != nil || !strings.HasPrefix(cookie, "dsh-auth-") {
		t.Fatalf("cookie = %q, %v", cookie, err)
	}
	req, _ := http.NewRequest(http.MethodGet, ts.URL+"/api/files", nil)
	req.Host = "gw.example.com"
	req.Header.Set("Cookie", cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("request with the cookie: %v %v", resp.Status, err)
	}
	resp.Body.Close()

	var herr *handshake.Error
	_, err = handshake.Exchange(ctx, handshake.Client(), handshake.Request{Address: addr, Token: "wrong-token-wrong-token", Host: "localhost"})
	if !errors.As(err, &herr) || herr.Status != 401 {
		t.Fatalf("wrong token: %v", err)
	}
	_, err = handshake.Exchange(ctx, handshake.Client(), handshake.Request{Address: addr, Token: dsh.Token(), Host: "evil.example.com"})
	if !errors.As(err, &herr) || herr.Status != 403 || !strings.Contains(err.Error(), "DSH_TRUSTED_HOSTS") {
		t.Fatalf("untrusted host: %v", err)
	}
	ts.Close()
	_, err = handshake.Exchange(ctx, handshake.Client(), handshake.Request{Address: addr, Token: dsh.Token(), Host: "localhost"})
	if err == nil || strings.Contains(err.Error(), dsh.Token()) {
		t.Fatalf("unreachable DSH: error %v must exist and must not carry the token", err)
	}
}

// TestExchangeRefusesAnOversizedCookie: a pod answering the handshake is
// the tenant's, and may set any cookie; one longer than MaxCookieLen is a
// failed handshake (nothing kept), and one at the bound is kept.
func TestExchangeRefusesAnOversizedCookie(t *testing.T) {
	for _, tc := range []struct {
		n    int
		kept bool
	}{{handshake.MaxCookieLen, true}, {handshake.MaxCookieLen + 1, false}, {1 << 20, false}} {
		name := "dsh-auth-8888"
		value := strings.Repeat("v", tc.n-len(name)-1)
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.SetCookie(w, &http.Cookie{Name: name, Value: value, Path: "/"})
			w.Header().Set("Location", "/")
			w.WriteHeader(http.StatusSeeOther)
		}))
		cookie, err := handshake.Exchange(context.Background(), handshake.Client(), handshake.Request{Address: strings.TrimPrefix(ts.URL, "http://"), Token: "tok", Host: "localhost"})
		ts.Close()
		var herr *handshake.Error
		switch {
		case tc.kept && (err != nil || cookie != name+"="+value):
			t.Errorf("a %d-byte cookie: %d bytes kept, %v", tc.n, len(cookie), err)
		case !tc.kept && (cookie != "" || !errors.As(err, &herr) || !strings.Contains(err.Error(), "at most")):
			t.Errorf("a %d-byte cookie: %d bytes kept, %v", tc.n, len(cookie), err)
		}
	}
}
