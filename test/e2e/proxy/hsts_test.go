package proxy_test

import (
	"net/http"
	"testing"

	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// HSTS_MAX_AGE, over HTTPS only (security review S15): behind a trusted
// TLS-terminating front (its X-Forwarded-Proto: https, by TRUSTED_PROXIES)
// the edge's own pages, its error pages and proxied answers carry the
// edge's HSTS, one value; over plain HTTP, or with the same header from a
// peer the edge does not trust, nothing does.
func TestHSTSOverHTTPSOnly(t *testing.T) {
	w := newStack(t, nil)
	trusted := w.Edge("edge-a", map[string]string{"TRUSTED_PROXIES": "127.0.0.1", "HSTS_MAX_AGE": "720h"})
	untrusted := w.Edge("edge-b", map[string]string{"HSTS_MAX_AGE": "720h"})
	token := testenv.NewClient(t, trusted.URL).Signup("hsts", "")
	const want = "max-age=2592000"
	for _, tc := range []struct {
		name        string
		edge        *testenv.Edge
		proto, want string
	}{
		{"https through the trusted front", trusted, "https", want},
		{"http through the trusted front", trusted, "http", ""},
		{"plain http, no front", trusted, "", ""},
		{"https claimed by an untrusted peer", untrusted, "https", ""},
	} {
		for _, path := range []string{"/", "/nope", "/u/hsts/", "/u/hsts/api/files"} {
			req, _ := http.NewRequest("GET", tc.edge.URL+path, nil)
			req.Header.Set("Authorization", "Bearer "+token)
			if tc.proto != "" {
				req.Header.Set("X-Forwarded-Proto", tc.proto)
			}
			resp, err := testenv.NoRedirects().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			got := resp.Header.Values("Strict-Transport-Security")
			switch {
			case tc.want == "" && len(got) != 0, tc.want != "" && (len(got) != 1 || got[0] != tc.want):
				t.Errorf("%s, %s (%d): Strict-Transport-Security %q, want %q", tc.name, path, resp.StatusCode, got, tc.want)
			}
		}
	}
}
