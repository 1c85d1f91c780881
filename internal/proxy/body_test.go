package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// browserBody is a request body arriving on a connection: the test writes
// the browser's side, the bodyReader reads the edge's side.
func browserBody(t *testing.T, size int64) (*bodyReader, net.Conn) {
	t.Helper()
	edge, browser := net.Pipe()
	t.Cleanup(func() { edge.Close(); browser.Close() })
	return &bodyReader{r: edge, conn: edge, read: 5 * time.Second, max: 1 << 20, size: size}, browser
}

// A streaming answer that DSH starts as soon as it has the body's bytes
// must reach the browser whole, although the handler returns (and detaches
// the body) before the client has read the body's end. (With net/http's
// Transport, the extra read after Content-Length bytes failed after detach
// and the Transport closed the connection mid-stream.)
func TestAnswerStreamedBeforeTheBodyEndSurvivesDetach(t *testing.T) {
	const words = 6
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var msg struct{ Message string }
		if err := json.NewDecoder(r.Body).Decode(&msg); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range words {
			fmt.Fprintf(w, "data: %s %d\n\n", msg.Message, i)
			w.(http.Flusher).Flush()
			time.Sleep(20 * time.Millisecond)
		}
	}))
	defer up.Close()

	payload := `{"message":"hello"}`
	body, browser := browserBody(t, int64(len(payload)))
	go func() { _, _ = browser.Write([]byte(payload)) }() // and the connection stays open, as a keep-alive would

	u := newUpstream()
	defer u.CloseIdle()
	a, err := u.RoundTrip(context.Background(), up.Listener.Addr().String(), &outgoing{method: "POST", uri: []byte("/"), header: []byte("Host: x\r\n"), body: body})
	if err != nil {
		t.Fatal(err)
	}
	body.detach() // the handler returned: the response streams on without it
	got, err := io.ReadAll(a.Body)
	a.Close()
	if err != nil || strings.Count(string(got), "data: hello") != words {
		t.Fatalf("streamed answer cut: %v after %q", err, got)
	}
}

func TestBodyReaderEnds(t *testing.T) {
	for _, tt := range []struct {
		name string
		size int64
		// closeAfter: when the browser's side ends the chunked body (0:
		// never, an upload still under way).
		closeAfter time.Duration
		wantErr    error
	}{
		{"known length, all read", 5, 0, io.EOF},
		{"chunked, end arrives within the grace", -1, 5 * time.Millisecond, io.EOF},
		{"chunked, upload still under way", -1, 0, errDetached},
	} {
		t.Run(tt.name, func(t *testing.T) {
			body, browser := browserBody(t, tt.size)
			go func() {
				_, _ = browser.Write([]byte("hello"))
				if tt.closeAfter > 0 {
					time.Sleep(tt.closeAfter)
					browser.Close()
				}
			}()
			buf := make([]byte, 64)
			n, err := io.ReadAtLeast(body, buf, 5)
			if n != 5 || (err != nil && !errors.Is(err, io.EOF)) {
				t.Fatalf("read %d bytes, %v", n, err)
			}
			body.detach()
			if _, err := body.Read(buf); !errors.Is(err, tt.wantErr) {
				t.Fatalf("read after detach: %v, want %v", err, tt.wantErr)
			}
			if !bytes.Equal(buf[:5], []byte("hello")) {
				t.Fatalf("body %q", buf[:5])
			}
		})
	}
}
