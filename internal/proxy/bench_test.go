package proxy

import (
	"io"
	"net/http"
	"strconv"
	"testing"
)

// payload serves n bytes at /bytes?n=.
var payload = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	n, _ := strconv.Atoi(r.URL.Query().Get("n"))
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.Itoa(n))
	buf := make([]byte, 32<<10)
	for n > 0 {
		k := min(n, len(buf))
		_, _ = w.Write(buf[:k])
		n -= k
	}
})

// BenchmarkProxy is the cached path (Ready sandbox, handshake cached)
// under parallel load; the CPU profile of this benchmark is the edge's
// per-request cost (the load generator shows up in it as net/http client
// frames).
func BenchmarkProxy(b *testing.B) {
	f := newFixture(b, payload, nil)
	for _, size := range []int{1 << 10, 1 << 20} {
		b.Run(strconv.Itoa(size>>10)+"KiB", func(b *testing.B) {
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			url := f.url + "/u/bob/bytes?n=" + strconv.Itoa(size)
			b.SetBytes(int64(size))
			b.SetParallelism(16)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					req, _ := http.NewRequest("GET", url, nil)
					req.Header.Set("Authorization", fixtureToken)
					resp, err := client.Do(req)
					if err != nil {
						b.Error(err)
						return
					}
					n, _ := io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 || n != int64(size) {
						b.Errorf("%d, %d bytes", resp.StatusCode, n)
						return
					}
				}
			})
		})
	}
}

// BenchmarkPreview is one request at a time through a preview origin, with
// the DSH origin's cached path as its baseline (the same fixture, one
// sandbox) and a preview port nothing listens on (the 502 page).
func BenchmarkPreview(b *testing.B) {
	pf := newPreviewFixture(b, nil)
	pf.seal(pf.localHost())
	client := &http.Client{}
	for _, c := range []struct {
		name, host, path string
		status           int
	}{
		{"dsh", fixtureUser + "." + fixtureDomain, "/echo", http.StatusOK},
		{"preview", previewHost(pf.app, fixtureUser), "/echo", http.StatusOK},
		{"nothing-listening", previewHost(pf.idle, fixtureUser), "/", http.StatusBadGateway},
	} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				req, _ := http.NewRequest("GET", pf.url+c.path, nil)
				req.Host = c.host
				req.Header.Set("Authorization", fixtureToken)
				resp, err := client.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != c.status {
					b.Fatalf("%s: %d", c.name, resp.StatusCode)
				}
			}
		})
	}
}
