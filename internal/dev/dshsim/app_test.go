package dshsim

import (
	"encoding/json"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fasthttp/websocket"
)

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// An agent starts a dev server through DSH; it serves on DSH's host at the
// port asked for, trusts only local Host names as Vite does, builds
// redirects from the Host it got, and pushes hot reloads to its sockets.
func TestAppsAnAgentStarts(t *testing.T) {
	o := testOptions(t)
	o.Listen = "127.0.0.1:0"
	f := newFixture(t, o)
	cookie := f.handshake()
	port := freePort(t)
	start := "/api/apps?port=" + strconv.Itoa(port)
	if got := f.status(http.MethodPost, start, nil); got != http.StatusUnauthorized {
		t.Fatalf("start without DSH's cookie: %d", got)
	}
	if got := f.status(http.MethodPost, "/api/apps?port=0", cookie); got != http.StatusBadRequest {
		t.Fatalf("port 0: %d", got)
	}
	if got := f.status(http.MethodPost, start, cookie); got != http.StatusCreated {
		t.Fatalf("start: %d", got)
	}
	if got := f.status(http.MethodPost, start, cookie); got != http.StatusOK {
		t.Fatalf("start again: %d", got)
	}
	t.Cleanup(f.srv.stopApps)

	addr := "127.0.0.1:" + strconv.Itoa(port)
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(host, path string) *http.Response {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
		req.Host = host
		req.Header.Set("Cookie", "a=b")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	local := "localhost:" + strconv.Itoa(port)
	resp := get(local, "/echo?x=1")
	var e struct {
		Host, Query string
		Headers     http.Header
	}
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("echo: %d %v", resp.StatusCode, err)
	}
	if e.Host != local || e.Query != "x=1" || e.Headers.Get("Cookie") != "a=b" {
		t.Fatalf("echo = %+v", e)
	}
	if resp := get(strconv.Itoa(port)+"-ann.sandboxes.example.com", "/echo"); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("a foreign Host: %d", resp.StatusCode)
	}
	if resp := get(local, "/redirect"); resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "http://"+local+"/echo" {
		t.Fatalf("redirect: %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	if resp := get(local, "/"); resp.Header.Get("Set-Cookie") == "" {
		t.Fatal("the page sets no cookie for the gateway to drop")
	}

	d := websocket.Dialer{Subprotocols: []string{"vite-hmr"}}
	ws, wr, err := d.Dial("ws://"+addr+"/hmr", http.Header{"Host": {local}})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	if wr.Header.Get("Sec-WebSocket-Protocol") != "vite-hmr" {
		t.Fatalf("subprotocol %q", wr.Header.Get("Sec-WebSocket-Protocol"))
	}
	read := func() string {
		_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, b, err := ws.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if m := read(); m != `{"type":"connected"}` {
		t.Fatalf("first message %q", m)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/__reload", nil)
	req.Host = local
	rr, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	rr.Body.Close()
	if m := read(); m != `{"type":"full-reload","path":"*"}` {
		t.Fatalf("after a reload %q", m)
	}
	if err := ws.WriteMessage(websocket.TextMessage, []byte("ping")); err != nil {
		t.Fatal(err)
	}
	if m := read(); m != "ping" {
		t.Fatalf("echo %q", m)
	}
	f.srv.stopApps()
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, _, err := ws.ReadMessage(); err == nil {
		t.Fatal("the socket outlived the sandbox")
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Fatal("the app still listens after the sandbox stopped")
	}
}

// DSHSIM_APPS starts apps with the sandbox (an agent's dev server that
// runs from boot), and they end with it.
func TestAppsAtBoot(t *testing.T) {
	env := map[string]string{"DSHSIM_APPS": "5173,x"}
	if _, err := OptionsFromEnv(nil, func(k string) string { return env[k] }); err == nil || !strings.Contains(err.Error(), "DSHSIM_APPS") {
		t.Fatalf("a bad port: %v", err)
	}
	port := freePort(t)
	env["DSHSIM_APPS"] = strconv.Itoa(port)
	o, err := OptionsFromEnv(nil, func(k string) string { return env[k] })
	if err != nil || len(o.Apps) != 1 || o.Apps[0] != port {
		t.Fatalf("apps %v: %v", o.Apps, err)
	}
	t2 := testOptions(t)
	t2.Listen, t2.Apps = "127.0.0.1:0", o.Apps
	r := startRun(t, t2)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	eventually(t, "the app", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	r.cancel()
	if err := r.wait(t); err != nil {
		t.Fatal(err)
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Fatal("the app outlived the sandbox")
	}
}
