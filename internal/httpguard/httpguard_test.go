package httpguard_test

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/httpguard"
)

// app is an edge-like server with the guards and a few routes, on a real
// listener (StreamRequestBody, as the edge runs).
func app(t *testing.T) (string, *bytes.Buffer) {
	return appWith(t, httpguard.ConsumeBody)
}

// appWith is app with another body rule in ConsumeBody's place.
func appWith(t *testing.T, consume fiber.Handler) (string, *bytes.Buffer) {
	var logs bytes.Buffer
	a := fiber.New(fiber.Config{StreamRequestBody: true, DisableStartupMessage: true, ReadBufferSize: 4 << 10})
	a.Use(consume, httpguard.Recover(slog.New(slog.NewJSONHandler(&logs, nil))), httpguard.Methods, httpguard.Pages)
	a.Get("/ok", func(c *fiber.Ctx) error { return c.SendString("ok") })
	a.Get("/tenant", func(c *fiber.Ctx) error { httpguard.TenantAnswer(c); return c.SendString("a sandbox's") })
	a.Post("/redirect", func(c *fiber.Ctx) error { return c.Redirect("/ok", fiber.StatusSeeOther) })
	a.Get("/panic", func(c *fiber.Ctx) error { panic("injected") })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = a.Listener(ln) }()
	t.Cleanup(func() { _ = a.Shutdown() })
	return ln.Addr().String(), &logs
}

func TestAPanicIsOneRequests500(t *testing.T) {
	addr, logs := app(t)
	resp, err := http.Get("http://" + addr + "/panic")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("panic answered %d", resp.StatusCode)
	}
	if !strings.Contains(logs.String(), `"msg":"handler panic"`) || !strings.Contains(logs.String(), "injected") {
		t.Fatalf("panic not logged: %s", logs.String())
	}
	resp, err = http.Get("http://" + addr + "/ok")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("after the panic: %v %v", resp, err)
	}
	resp.Body.Close()
}

func TestTraceAndConnectAreRefusedAndPagesCarryTheirHeaders(t *testing.T) {
	addr, _ := app(t)
	for _, m := range []string{"TRACE", "CONNECT"} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		target := "/ok"
		if m == "CONNECT" {
			target = "example.com:443"
		}
		_, _ = io.WriteString(c, m+" "+target+" HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		c.Close()
		if err != nil || resp.StatusCode != http.StatusMethodNotAllowed {
			t.Fatalf("%s: %v %v", m, resp, err)
		}
	}
	resp, err := http.Get("http://" + addr + "/ok")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for _, h := range httpguard.PageHeaders {
		if resp.Header.Get(h.Name) != h.Value {
			t.Errorf("%s: %q, want %q", h.Name, resp.Header.Get(h.Name), h.Value)
		}
	}
	// A sandbox's own answer carries its own headers, none of the edge's.
	resp, err = http.Get("http://" + addr + "/tenant")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for _, h := range httpguard.PageHeaders {
		if v := resp.Header.Get(h.Name); v != "" {
			t.Errorf("a sandbox's answer got the edge's %s: %q", h.Name, v)
		}
	}
}

// A body the handler never read is drained, not parsed as a request, at
// every size up to a large one that arrives in time.
func TestUnreadBodiesAreDrained(t *testing.T) {
	addr, _ := app(t)
	for _, size := range []int{10, 5000, 1 << 20} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		hidden := "GET /panic HTTP/1.1\r\nHost: x\r\n\r\n"
		body := strings.Repeat("x", size) + hidden
		go func() {
			_, _ = io.WriteString(c, "POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: "+itoa(len(body))+"\r\n\r\n"+body+
				"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
		}()
		r := bufio.NewReader(c)
		var statuses []int
		for {
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			resp, err := http.ReadResponse(r, nil)
			if err != nil {
				break
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses = append(statuses, resp.StatusCode)
		}
		c.Close()
		if len(statuses) != 2 || statuses[0] != http.StatusSeeOther || statuses[1] != http.StatusOK {
			t.Fatalf("%d-byte body: responses %v, want [303 200]", size, statuses)
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// exchange writes parts (strings, and pauses as time.Durations) on a new
// connection to addr, in the background as a client still sending would,
// and reads responses until the server ends the connection: their
// statuses.
func exchange(t *testing.T, addr string, parts ...any) []int {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		for _, part := range parts {
			switch p := part.(type) {
			case time.Duration:
				time.Sleep(p)
			case string:
				if _, err := io.WriteString(c, p); err != nil {
					return
				}
			}
		}
	}()
	var statuses []int
	r := bufio.NewReader(c)
	for {
		// A hang guard, not a timing goal: every exchange here ends by
		// the server's doing well before it.
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("no answer and no close within 30 s (after %v)", statuses)
			}
			return statuses
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		statuses = append(statuses, resp.StatusCode)
	}
}

// A body that keeps trickling, so that no single read stalls, is still
// drained for at most drainTime (3 s): then the answer goes out with
// Connection: close and the connection ends, instead of holding the
// connection (and a goroutine) for as long as the client cares to send.
// A body that takes a while but ends within the bound is drained and the
// connection kept (the control).
func TestASlowBodyClosesTheConnection(t *testing.T) {
	addr, _ := app(t)
	// fasthttp reads the first 8 KiB of a body before the handler runs
	// (the edge's HTTP_READ_TIMEOUT bounds that wait); the rest trickles.
	const size, first = 1 << 20, 16 << 10
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: "+itoa(size)+"\r\n\r\n"+strings.Repeat("x", first))
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		// The rest at a byte per 50 ms would take half a day.
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				if _, err := c.Write([]byte("x")); err != nil {
					return
				}
			}
		}
	}()
	r := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(60 * time.Second)) // a hang guard
	start := time.Now()
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatalf("no answer to a request whose body trickles: %v", err)
	}
	resp.Body.Close()
	took := time.Since(start)
	if resp.StatusCode != http.StatusSeeOther || !resp.Close {
		t.Fatalf("answer %d, Connection: close %v; want 303 and the connection closed", resp.StatusCode, resp.Close)
	}
	if _, err := r.ReadByte(); err == nil {
		t.Fatal("the connection stayed open after the answer to a body that never ended")
	}
	t.Logf("answered after %s of trickling (drain bound 3 s)", took.Round(time.Millisecond))

	// The control: the whole body, its end a second late, then the next
	// request.
	statuses := exchange(t, addr,
		"POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: "+itoa(first+5)+"\r\n\r\n"+strings.Repeat("x", first),
		time.Second, "xxxxx",
		"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	if len(statuses) != 2 || statuses[0] != http.StatusSeeOther || statuses[1] != http.StatusOK {
		t.Fatalf("a late but complete body: responses %v, want [303 200] on one connection", statuses)
	}
}

// The byte bound, shrunk to 64 KiB: a body up to it is drained and the
// connection kept; one byte more closes it, and so does a declared length
// beyond it, at once.
func TestABodyPastTheByteBoundClosesTheConnection(t *testing.T) {
	const bound = 64 << 10
	addr, _ := appWith(t, httpguard.ConsumeBodyWithin(bound, time.Minute))
	next := "GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
	post := func(n int) string {
		return "POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: " + itoa(n) + "\r\n\r\n" + strings.Repeat("x", n)
	}
	if got := exchange(t, addr, post(bound), next); len(got) != 2 || got[1] != http.StatusOK {
		t.Fatalf("a body of exactly the bound: responses %v, want [303 200]", got)
	}
	if got := exchange(t, addr, post(bound+1), next); len(got) != 1 || got[0] != http.StatusSeeOther {
		t.Fatalf("a body one byte past the bound: responses %v, want [303] and the connection closed", got)
	}
	chunked := "POST /redirect HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
		strconv.FormatInt(bound+1, 16) + "\r\n" + strings.Repeat("x", bound+1) + "\r\n0\r\n\r\n"
	if got := exchange(t, addr, chunked, next); len(got) != 1 || got[0] != http.StatusSeeOther {
		t.Fatalf("a chunked body one byte past the bound: responses %v, want [303] and the connection closed", got)
	}
	// Declared beyond the bound, and never sent in full: answered and
	// closed at once, not after the drain's minute (fasthttp reads the
	// first 8 KiB of a body before the handler runs, so they are sent).
	declared := "POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: " + itoa(bound+1) + "\r\n\r\n" + strings.Repeat("x", 9<<10)
	if got := exchange(t, addr, declared); len(got) != 1 || got[0] != http.StatusSeeOther {
		t.Fatalf("a declared length past the bound: responses %v, want [303] and the connection closed", got)
	}
}

// A hidden request in a chunked body, or in a body that declares both a
// length and chunks (the classic smuggling pair, each reading of which ends
// the body somewhere else), is never answered: one response for the one
// request. A CL+TE request's connection is closed after its answer, as RFC
// 9112 §6.3 requires, since whatever follows its chunked end was, by its
// Content-Length, still body.
func TestHiddenRequestsInChunkedAndAmbiguousBodies(t *testing.T) {
	addr, logs := app(t)
	hidden := "GET /panic HTTP/1.1\r\nHost: x\r\n\r\n"
	next := "GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
	chunk := func(s string) string { return strconv.FormatInt(int64(len(s)), 16) + "\r\n" + s + "\r\n" }
	for _, tc := range []struct {
		name, raw string
		want      []int
	}{
		{"chunked, hidden in a chunk", "POST /redirect HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
			chunk(hidden) + "0\r\n\r\n" + next, []int{303, 200}},
		{"chunked, hidden behind 64 KiB", "POST /redirect HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
			chunk(strings.Repeat("x", 64<<10)) + chunk(hidden) + "0\r\n\r\n" + next, []int{303, 200}},
		{"chunked with an extension and a trailer", "POST /redirect HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
			strconv.FormatInt(int64(len(hidden)), 16) + ";ext=1\r\n" + hidden + "\r\n0\r\nX-Trailer: 1\r\n\r\n" + next, []int{303, 200}},
		// CL.TE: a front reading Content-Length forwards it all as one
		// body; read as chunked, the hidden request follows the body.
		{"Content-Length covering a request after the last chunk", "POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: " +
			itoa(len("0\r\n\r\n"+hidden)) + "\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + hidden + next, []int{303}},
		// TE.CL: read by its Content-Length, the body ends inside the
		// first chunk and the hidden request follows.
		{"Content-Length ending inside the first chunk", "POST /redirect HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" +
			chunk(hidden) + "0\r\n\r\n" + next, []int{303}},
		{"Transfer-Encoding before Content-Length", "POST /redirect HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\ncontent-length: 4\r\n\r\n" +
			chunk(hidden) + "0\r\n\r\n" + next, []int{303}},
	} {
		got := exchange(t, addr, tc.raw)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: responses %v, want %v", tc.name, got, tc.want)
		}
	}
	if strings.Contains(logs.String(), "handler panic") {
		t.Error("a hidden request was served (GET /panic ran)")
	}
}

// HSTS is sent on answers to requests that came over HTTPS, as
// TRUSTED_PROXIES decides: a trusted front's X-Forwarded-Proto: https,
// never the same header from anyone else, never plain HTTP, never for a
// host the gateway does not serve, and not at all with max-age 0.
func TestHSTSOnlyOverHTTPS(t *testing.T) {
	serve := func(trusted []netip.Prefix, maxAge time.Duration) string {
		p, err := httpguard.NewPolicy(httpguard.Options{TrustedProxies: trusted, PublicHosts: []string{"gw.example"}})
		if err != nil {
			t.Fatal(err)
		}
		a := fiber.New(fiber.Config{DisableStartupMessage: true})
		a.Use(httpguard.Pages, p.Middleware, httpguard.HSTS(maxAge))
		a.Get("/ok", func(c *fiber.Ctx) error { return c.SendString("ok") })
		a.Get("/fail", func(c *fiber.Ctx) error { return fiber.NewError(fiber.StatusNotFound, "no") })
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = a.Listener(ln) }()
		t.Cleanup(func() { _ = a.Shutdown() })
		return "http://" + ln.Addr().String()
	}
	loopback := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	trusted, untrusted, off := serve(loopback, 365*24*time.Hour), serve(nil, 365*24*time.Hour), serve(loopback, 0)
	for _, tc := range []struct {
		name, base, path, host, proto, want string
	}{
		{"https through a trusted front", trusted, "/ok", "gw.example", "https", "max-age=31536000"},
		{"an error page over https", trusted, "/fail", "gw.example", "https", "max-age=31536000"},
		{"plain http through a trusted front", trusted, "/ok", "gw.example", "http", ""},
		{"no forwarding header (plain http)", trusted, "/ok", "gw.example", "", ""},
		{"https claimed by an untrusted peer", untrusted, "/ok", "gw.example", "https", ""},
		{"a host the gateway does not serve", trusted, "/ok", "evil.example", "https", ""},
		{"max-age 0", off, "/ok", "gw.example", "https", ""},
	} {
		req, _ := http.NewRequest("GET", tc.base+tc.path, nil)
		req.Host = tc.host
		if tc.proto != "" {
			req.Header.Set("X-Forwarded-Proto", tc.proto)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := resp.Header.Get("Strict-Transport-Security"); got != tc.want {
			t.Errorf("%s: Strict-Transport-Security %q, want %q", tc.name, got, tc.want)
		}
	}
}
