package httpguard_test

import (
	"bufio"
	"bytes"
	"io"
	"log/slog"
	"net"
	"net/http"
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
	var logs bytes.Buffer
	a := fiber.New(fiber.Config{StreamRequestBody: true, DisableStartupMessage: true, ReadBufferSize: 4 << 10})
	a.Use(httpguard.ConsumeBody, httpguard.Recover(slog.New(slog.NewJSONHandler(&logs, nil))), httpguard.Methods, httpguard.Pages)
	a.Get("/ok", func(c *fiber.Ctx) error { return c.SendString("ok") })
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
	for k, v := range httpguard.PageHeaders {
		if resp.Header.Get(k) != v {
			t.Errorf("%s: %q, want %q", k, resp.Header.Get(k), v)
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
