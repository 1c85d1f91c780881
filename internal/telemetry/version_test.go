package telemetry

import (
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestBuildInfoNamesTheVersion(t *testing.T) {
	for _, tc := range []struct{ set, want string }{
		{"v1.2.3-4-gabcdef0", "v1.2.3-4-gabcdef0"},
		// Unset: the test binary has no VCS stamp, so "dev" stands in.
		{"", "dev"},
	} {
		Version = tc.set
		r := Registry()
		want := `aaas_build_info{goversion="` + runtime.Version() + `",version="` + tc.want + `"} 1`
		if err := testutil.GatherAndCompare(r, strings.NewReader("# HELP aaas_build_info The running build: version (git describe) and Go version; always 1.\n# TYPE aaas_build_info gauge\n"+want+"\n"), "aaas_build_info"); err != nil {
			t.Errorf("Version %q: %v", tc.set, err)
		}
	}
	Version = ""
}
