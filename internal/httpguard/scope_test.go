package httpguard_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
)

// The request scope's context carries the request id and ends when the
// client leaves mid-request, when the handler returns, or, detached, when
// its new owner says: each observed on a real connection.
func TestRequestContext(t *testing.T) {
	p, err := httpguard.NewPolicy(httpguard.Options{PublicHosts: []string{"*"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go p.Run(ctx)
	type seen struct {
		id    string
		ended bool // the context had ended when the handler returned
	}
	waited := make(chan seen, 4)
	type taken struct {
		ctx context.Context
		end context.CancelFunc
	}
	held := make(chan taken, 2)
	app := fiber.New(fiber.Config{DisableStartupMessage: true})
	app.Use(p.Access(slog.New(slog.DiscardHandler)))
	app.Get("/wait", func(c *fiber.Ctx) error {
		rc := httpguard.Context(c)
		select {
		case <-rc.Done():
		case <-time.After(10 * time.Second):
		}
		waited <- seen{id: ident.RequestIDOf(rc), ended: rc.Err() != nil}
		return nil
	})
	app.Get("/quick", func(c *fiber.Ctx) error {
		held <- taken{ctx: httpguard.Context(c)}
		return c.SendString("quick")
	})
	app.Get("/detach", func(c *fiber.Ctx) error {
		ctx, end := httpguard.Detach(c)
		held <- taken{ctx: ctx, end: end}
		return c.SendString("streaming")
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go app.Listener(ln)
	t.Cleanup(func() { _ = app.Shutdown() })
	request := func(path string) net.Conn {
		conn, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: gw\r\nX-Request-Id: abc\r\n\r\n", path)
		return conn
	}
	answer := func(conn net.Conn) string {
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		b := make([]byte, 4096)
		n, _ := conn.Read(b)
		return string(b[:n])
	}

	// A client that leaves ends its request's context while the handler
	// still waits.
	conn := request("/wait")
	testutil.Eventually(t, 5*time.Second, func() error {
		if httpguard.InFlight(p) == 0 {
			return fmt.Errorf("the request has not asked for its context yet")
		}
		return nil
	})
	conn.Close()
	select {
	case s := <-waited:
		if !s.ended || s.id == "" {
			t.Fatalf("the context of a departed client: ended %v, id %q", s.ended, s.id)
		}
	case <-time.After(8 * time.Second):
		t.Fatal("the context did not end when the client left")
	}

	// The handler's return ends it.
	conn = request("/quick")
	answer(conn)
	// The id is the edge's own: the peer is no trusted proxy.
	if q := <-held; q.ctx.Err() == nil || ident.RequestIDOf(q.ctx) == "" || ident.RequestIDOf(q.ctx) == "abc" {
		t.Fatalf("after its handler: err %v, id %q", q.ctx.Err(), ident.RequestIDOf(q.ctx))
	}
	conn.Close()

	// Detached, it lives on after the handler until its owner ends it.
	conn = request("/detach")
	answer(conn)
	d := <-held
	if d.ctx.Err() != nil {
		t.Fatal("a detached context ended with its handler")
	}
	d.end()
	if d.ctx.Err() == nil {
		t.Fatal("end did not end it")
	}
	conn.Close()
}
