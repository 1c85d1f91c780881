package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// The conformance suite holds a transport to net/http's server (and, for
// what it cannot do, a server of a few lines that speaks as old servers
// do): framing, interim answers, connection reuse and 100-continue, each
// case with the connection count that says whether a connection was kept.

// conformanceServer is an httptest server counting the connections it
// accepted.
type conformanceServer struct {
	*httptest.Server
	conns atomic.Int32
}

func serveConformance(t *testing.T, h http.HandlerFunc) *conformanceServer {
	t.Helper()
	s := &conformanceServer{Server: httptest.NewUnstartedServer(h)}
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s
}

func (s *conformanceServer) addr() string { return s.Listener.Addr().String() }

// exchanged is what a round trip gave.
type exchanged struct {
	status int
	header func(string) string
	body   *string // nil: the answer had no body
	size   int64
}

func roundTrip(t *testing.T, tr transport, addr string, o *outgoing) exchanged {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, err := tr.RoundTrip(ctx, addr, o)
	if err != nil {
		t.Fatalf("%s %s: %v", o.method, o.uri, err)
	}
	ex := exchanged{status: a.Header.StatusCode(), size: a.Size}
	hdr := map[string]string{}
	for k, v := range a.Header.All() {
		hdr[http.CanonicalHeaderKey(string(k))] = string(v)
	}
	ex.header = func(k string) string { return hdr[k] }
	if a.Body != nil {
		b, err := io.ReadAll(a.Body)
		if err != nil {
			t.Fatalf("%s %s: body: %v", o.method, o.uri, err)
		}
		s := string(b)
		ex.body = &s
	}
	if err := a.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	return ex
}

func get(uri string) *outgoing {
	return &outgoing{method: "GET", uri: []byte(uri), header: []byte("Host: sandbox\r\n")}
}

// post is a request whose body arrives from the browser as the test
// writes it; nil payload: the browser sends nothing yet.
func post(t *testing.T, payload []byte, size int64) *outgoing {
	body, browser := browserBody(t, size)
	if payload != nil {
		go func() {
			_, _ = browser.Write(payload)
			if size < 0 {
				browser.Close() // the chunked upload's end
			}
		}()
	}
	return &outgoing{method: "POST", uri: []byte("/"), header: []byte("Host: sandbox\r\n"), body: body}
}

func TestTransportConformance(t *testing.T) {
	for name, newTransport := range map[string]func() transport{
		"upstream": func() transport {
			u := newUpstream()
			u.continueFor = 100 * time.Millisecond
			return u
		},
	} {
		t.Run(name, func(t *testing.T) { conformance(t, newTransport) })
	}
}

func conformance(t *testing.T, newTransport func() transport) {
	fresh := func(t *testing.T) transport {
		tr := newTransport()
		t.Cleanup(tr.CloseIdle)
		return tr
	}
	t.Run("chunked with trailers, then the connection again", func(t *testing.T) {
		s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Trailer", "X-Sum")
			io.WriteString(w, "hello ")
			w.(http.Flusher).Flush()
			io.WriteString(w, "world")
			w.Header().Set("X-Sum", "42")
		})
		tr := fresh(t)
		ex := roundTrip(t, tr, s.addr(), get("/"))
		if ex.status != 200 || ex.body == nil || *ex.body != "hello world" || ex.size != -1 {
			t.Fatalf("%d %v size %d", ex.status, ex.body, ex.size)
		}
		roundTrip(t, tr, s.addr(), get("/"))
		if n := s.conns.Load(); n != 1 {
			t.Fatalf("%d connections: a chunked answer read to its trailer must leave its connection reusable", n)
		}
	})
	t.Run("1xx before the answer", func(t *testing.T) {
		s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Link", "</app.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusProcessing)
			io.WriteString(w, "final")
		})
		ex := roundTrip(t, fresh(t), s.addr(), get("/"))
		if ex.status != 200 || ex.body == nil || *ex.body != "final" {
			t.Fatalf("%d %v", ex.status, ex.body)
		}
	})
	for _, code := range []int{http.StatusNoContent, http.StatusNotModified} {
		t.Run(fmt.Sprintf("%d has no body", code), func(t *testing.T) {
			s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("ETag", `"v1"`)
				w.WriteHeader(code)
			})
			tr := fresh(t)
			for range 2 {
				if ex := roundTrip(t, tr, s.addr(), get("/")); ex.status != code || ex.body != nil {
					t.Fatalf("%d, body %v", ex.status, ex.body)
				}
			}
			if n := s.conns.Load(); n != 1 {
				t.Fatalf("%d connections", n)
			}
		})
	}
	t.Run("HEAD has no body whatever its length says", func(t *testing.T) {
		s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "11")
			io.WriteString(w, "hello world")
		})
		tr := fresh(t)
		o := get("/")
		o.method, o.head = "HEAD", true
		if ex := roundTrip(t, tr, s.addr(), o); ex.status != 200 || ex.body != nil || ex.header("Content-Length") != "11" {
			t.Fatalf("%d, body %v, length %q", ex.status, ex.body, ex.header("Content-Length"))
		}
		if ex := roundTrip(t, tr, s.addr(), get("/")); ex.body == nil || *ex.body != "hello world" {
			t.Fatalf("the GET after a HEAD: %v", ex.body)
		}
		if n := s.conns.Load(); n != 1 {
			t.Fatalf("%d connections", n)
		}
	})
	t.Run("Connection: close is honoured", func(t *testing.T) {
		// The server says it closes and, unlike net/http's, does not:
		// only the client's own rule keeps it from reusing the connection.
		s := serveRaw(t, func([]byte) string { return "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye" })
		tr := fresh(t)
		for range 2 {
			if ex := roundTrip(t, tr, s.addr, get("/")); ex.body == nil || *ex.body != "bye" {
				t.Fatalf("body %v", ex.body)
			}
		}
		if n := s.conns.Load(); n != 2 {
			t.Fatalf("%d connections: a connection the server said it closes was used again", n)
		}
	})
	t.Run("an early answer leaves the body unread", func(t *testing.T) {
		s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "too large", http.StatusRequestEntityTooLarge)
		})
		o := post(t, nil, 1<<20)
		if ex := roundTrip(t, fresh(t), s.addr(), o); ex.status != http.StatusRequestEntityTooLarge {
			t.Fatalf("%d", ex.status)
		}
		if !o.body.untouched() {
			t.Fatal("the body was read although the server answered before asking for it")
		}
	})
	t.Run("a stale pooled connection is retried once on a fresh one", func(t *testing.T) {
		s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, r.URL.Path) })
		tr := fresh(t)
		roundTrip(t, tr, s.addr(), get("/first"))
		s.CloseClientConnections()
		if ex := roundTrip(t, tr, s.addr(), get("/second")); ex.body == nil || *ex.body != "/second" {
			t.Fatalf("body %v", ex.body)
		}
		if n := s.conns.Load(); n != 2 {
			t.Fatalf("%d connections, want the closed one and a fresh one", n)
		}
	})
	t.Run("100-continue: the body goes when the server asks", func(t *testing.T) {
		s := serveConformance(t, func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Expect") != "100-continue" {
				http.Error(w, "no Expect", http.StatusBadRequest)
				return
			}
			io.Copy(w, r.Body)
		})
		payload := []byte("the upload")
		if ex := roundTrip(t, fresh(t), s.addr(), post(t, payload, int64(len(payload)))); ex.status != 200 || ex.body == nil || *ex.body != "the upload" {
			t.Fatalf("%d %v", ex.status, ex.body)
		}
	})
	t.Run("100-continue: a server that never says Continue still gets the body", func(t *testing.T) {
		s := serveRaw(t, func(body []byte) string {
			return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		})
		payload := []byte("chunk by chunk")
		o := post(t, payload, -1)
		if ex := roundTrip(t, fresh(t), s.addr, o); ex.status != 200 || ex.body == nil || *ex.body != "chunk by chunk" {
			t.Fatalf("%d %v", ex.status, ex.body)
		}
		if !s.asked.Load() {
			t.Fatal("the request did not ask Expect: 100-continue: the case tests nothing")
		}
	})
}

// rawServer is an HTTP/1.1 server as old ones are, for what net/http's
// will not do: it never answers 100 Continue, and it keeps a connection
// open after saying Connection: close. It reads each request and its
// body (chunked or not) and writes what answer returns.
type rawServer struct {
	addr  string
	conns atomic.Int32
	// asked: a request said Expect: 100-continue.
	asked atomic.Bool
}

func serveRaw(t *testing.T, answer func(body []byte) string) *rawServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	s := &rawServer{addr: ln.Addr().String()}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			s.conns.Add(1)
			go func() {
				defer conn.Close()
				br := bufio.NewReader(conn)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					if req.Header.Get("Expect") == "100-continue" {
						s.asked.Store(true)
					}
					body, err := io.ReadAll(req.Body)
					if err != nil {
						return
					}
					io.WriteString(conn, answer(body))
				}
			}()
		}
	}()
	return s
}
