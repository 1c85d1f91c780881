package aaas

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// minimums are the lowest versions the repository may pin, each with the
// reason and where the pin is written: a pin below one (a revert, a
// merge, a copy from an old example) fails this test.
var minimums = []struct {
	what, file, pattern, min, why string
}{
	{"oauth2-proxy", "manifests/exposure/gateway-api-sso/oauth2-proxy.yaml", `image: quay.io/oauth2-proxy/oauth2-proxy:v(\S+)`, "7.15.2",
		"the fixes of 7.11.0, 7.13.0 and 7.15.2 (security review S17)"},
	{"oauth2-proxy (chart)", "charts/aaas/values.yaml", `repository: quay.io/oauth2-proxy/oauth2-proxy\n\s+tag: v(\S+)`, "7.15.2",
		"as above"},
	{"oauth2-proxy (test bed)", "versions.env", `(?m)^OAUTH2_PROXY_VERSION=v(\S+)`, "7.15.2",
		"as above"},
	{"fasthttp", "go.mod", `(?m)^\s+github.com/valyala/fasthttp v(\S+)`, "1.78.0",
		"current at the last review; 1.70 fixed an advisory in its file server (security review S17)"},
	{"Go (Dockerfile)", "Dockerfile", `FROM golang:(\d+\.\d+\.\d+)-`, "1.26.8",
		"the toolchain the project builds and tests with"},
}

// TestPinnedVersionsMeetTheirMinimums reads each pin from its file and
// compares it with the table.
func TestPinnedVersionsMeetTheirMinimums(t *testing.T) {
	for _, m := range minimums {
		b, err := os.ReadFile(m.file)
		if err != nil {
			t.Fatal(err)
		}
		found := regexp.MustCompile(m.pattern).FindAllStringSubmatch(string(b), -1)
		if len(found) == 0 {
			t.Errorf("%s: no pin found in %s (pattern %s)", m.what, m.file, m.pattern)
		}
		for _, f := range found {
			if !atLeast(f[1], m.min) {
				t.Errorf("%s %s in %s is below %s: %s", m.what, f[1], m.file, m.min, m.why)
			}
		}
	}
}

// TestDockerfileBaseImagesArePinnedByDigest: every FROM names its image by
// digest (a tag alone can be moved to other bytes).
func TestDockerfileBaseImagesArePinnedByDigest(t *testing.T) {
	b, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	froms := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.EqualFold(f[0], "FROM") {
			continue
		}
		froms++
		if !regexp.MustCompile(`^[^@\s]+:[^@\s]+@sha256:[0-9a-f]{64}$`).MatchString(f[1]) {
			t.Errorf("Dockerfile: %q is not an image tag pinned by digest", line)
		}
	}
	if froms < 2 {
		t.Fatalf("%d FROM lines: the build and the runtime stage were not found", froms)
	}
}

func TestAtLeast(t *testing.T) {
	for _, c := range []struct {
		v, min string
		want   bool
	}{
		{"7.15.2", "7.15.2", true}, {"7.15.10", "7.15.2", true}, {"7.16.0", "7.15.2", true}, {"8.0.0", "7.15.2", true},
		{"7.8.1", "7.15.2", false}, {"7.15.1", "7.15.2", false}, {"1.58.0", "1.70.0", false}, {"1.70", "1.70.0", true},
		{"1.70.0-rc.1", "1.70.0", false}, {"x", "1.0.0", false},
	} {
		if got := atLeast(c.v, c.min); got != c.want {
			t.Errorf("atLeast(%q, %q) = %v", c.v, c.min, got)
		}
	}
}

// atLeast compares dotted release numbers; a pre-release or anything that
// is not a number is below its release.
func atLeast(v, min string) bool {
	vs, ms := strings.Split(v, "."), strings.Split(min, ".")
	for i := range max(len(vs), len(ms)) {
		a, b := 0, 0
		var err error
		if i < len(vs) {
			if a, err = strconv.Atoi(vs[i]); err != nil {
				return false
			}
		}
		if i < len(ms) {
			b, _ = strconv.Atoi(ms[i])
		}
		if a != b {
			return a > b
		}
	}
	return true
}
