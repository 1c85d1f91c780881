package devcluster

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/aaas-project/aaas/internal/dev/child"
)

// serveKubelet starts the part of the kubelet API the API server uses for
// `pods/log`: GET /containerLogs/<ns>/<pod>/<container> with tailLines,
// limitBytes, previous and follow. The API server does not verify the
// kubelet's certificate, so a cert from the cluster CA is plenty.
func (n *Node) serveKubelet() (int, error) {
	cert, err := tls.LoadX509KeyPair(n.opts.pki.path("kubelet.crt"), n.opts.pki.path("kubelet.key"))
	if err != nil {
		return 0, fmt.Errorf("kubelet cert: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("kubelet listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /containerLogs/{ns}/{pod}/{container}", n.containerLogs)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	n.kubelet = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: nil}
	go func() { _ = n.kubelet.Serve(tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{cert}})) }()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func (n *Node) containerLogs(w http.ResponseWriter, r *http.Request) {
	key := r.PathValue("ns") + "/" + r.PathValue("pod")
	n.mu.Lock()
	rt := n.running[key]
	n.mu.Unlock()
	if rt == nil {
		http.Error(w, fmt.Sprintf("pod %s not found on %s", key, n.Name), http.StatusNotFound)
		return
	}
	q := r.URL.Query()
	path, live, err := rt.logFile(r.PathValue("container"), q.Get("previous") == "true")
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	b, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	offset := int64(len(b))
	if s := q.Get("tailLines"); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n >= 0 {
			b = child.Tail(b, n)
		}
	}
	if s := q.Get("limitBytes"); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n >= 0 && n < len(b) {
			b = b[:n]
		}
	}
	w.Header().Set("Content-Type", "text/plain")
	_, _ = w.Write(b)
	if q.Get("follow") != "true" || live == nil {
		return
	}
	follow(w, r, path, offset, live)
}

// follow streams what the container writes after offset until it exits or
// the client goes away.
func follow(w http.ResponseWriter, r *http.Request, path string, offset int64, live *child.Process) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return
	}
	flusher, _ := w.(http.Flusher)
	rd := bufio.NewReader(f)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		if _, err := io.Copy(w, rd); err != nil {
			return
		}
		if flusher != nil {
			flusher.Flush()
		}
		if live.Exited() {
			_, _ = io.Copy(w, rd)
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		}
	}
}
