package release

import (
	"archive/tar"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/testenv"
)

// chartVersion is the release the checkout says it is (Chart.yaml).
func chartVersion(t *testing.T, root string) string {
	b, err := os.ReadFile(filepath.Join(root, "charts", "aaas", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^version: (\S+)$`).FindSubmatch(b)
	if m == nil {
		t.Fatal("Chart.yaml has no version")
	}
	return string(m[1])
}

// TestReleaseIsReproducibleAndPinned cuts the checkout's release twice,
// into two directories, the second packaging the first's binaries again
// (linking both architectures' twice would double a slow test): the
// checksums are equal, and a binary built again on its own is the
// release's byte for byte, so the binaries reproduce too. The checksums
// hold for every file, the chart installs exactly the image the OCI
// archive holds (by digest, for every architecture), the SBOM lists what
// the binaries link, and the notes are CHANGELOG's section.
func TestReleaseIsReproducibleAndPinned(t *testing.T) {
	if testing.Short() {
		t.Skip("cuts a release twice (Go builds for two architectures): not under -short")
	}
	root := testenv.Root()
	version := chartVersion(t, root)
	dir := t.TempDir()
	bins := filepath.Join(dir, "bin")
	var results [2]Result
	var sums [2][]byte
	for i := range results {
		out := filepath.Join(dir, fmt.Sprint(i))
		start := time.Now()
		r, err := Build(Options{Version: version, Root: root, Out: out, Log: t.Output(), prebuilt: bins})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("release %d cut in %s", i, time.Since(start).Round(time.Millisecond))
		results[i] = r
		if sums[i], err = os.ReadFile(filepath.Join(out, "SHA256SUMS")); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(sums[0], sums[1]) || results[0].Digest != results[1].Digest {
		t.Fatalf("two builds of one commit differ:\n%s\n%s", sums[0], sums[1])
	}
	out := filepath.Join(dir, "0")
	t.Logf("release %s: image %s\n%s", version, results[0].Digest, sums[0])
	again := filepath.Join(dir, "again")
	if err := Binaries(root, version, "amd64", again, "setup"); err != nil {
		t.Fatal(err)
	}
	built, err := os.ReadFile(filepath.Join(again, "setup"))
	if err != nil {
		t.Fatal(err)
	}
	released, err := os.ReadFile(filepath.Join(bins, "amd64", "setup"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(built, released) {
		t.Fatal("setup built again is not the release's byte for byte: the binaries do not reproduce")
	}

	// Every file is in SHA256SUMS and matches it.
	listed := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(sums[0]))
	for sc.Scan() {
		sum, name, _ := strings.Cut(sc.Text(), "  ")
		b, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		if got := sha256.Sum256(b); hex.EncodeToString(got[:]) != sum {
			t.Errorf("%s does not match SHA256SUMS", name)
		}
		listed[name] = true
	}
	for _, want := range []string{"aaas_" + version + "_linux_amd64.tar.gz", "aaas_" + version + "_linux_arm64.tar.gz", "aaas_" + version + ".oci.tar",
		"aaas_" + version + ".sbom.spdx.json", "aaas-" + version + ".tgz", "RELEASE_NOTES.md"} {
		if !listed[want] {
			t.Errorf("the release has no %s (SHA256SUMS: %s)", want, sums[0])
		}
	}

	// The OCI archive: index.json names the release's image index, which
	// lists both architectures, all of whose blobs are there.
	blobs, index := ociArchive(t, filepath.Join(out, "aaas_"+version+".oci.tar"))
	if len(index.Manifests) != 1 || index.Manifests[0].Digest != results[0].Digest.String() || index.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != version {
		t.Fatalf("index.json: %+v, want the image index %s named %s", index, results[0].Digest, version)
	}
	var images struct {
		Manifests []struct {
			Digest   string `json:"digest"`
			Platform struct {
				Architecture string `json:"architecture"`
			} `json:"platform"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal(blobs[results[0].Digest.String()], &images); err != nil {
		t.Fatal(err)
	}
	arches := map[string]bool{}
	for _, m := range images.Manifests {
		arches[m.Platform.Architecture] = true
		var manifest struct {
			Config struct{ Digest string }   `json:"config"`
			Layers []struct{ Digest string } `json:"layers"`
		}
		if err := json.Unmarshal(blobs[m.Digest], &manifest); err != nil {
			t.Fatalf("%s's manifest: %v", m.Platform.Architecture, err)
		}
		for _, d := range append([]string{manifest.Config.Digest}, manifest.Layers[0].Digest) {
			if _, ok := blobs[d]; !ok {
				t.Errorf("%s's blob %s is missing", m.Platform.Architecture, d)
			}
		}
	}
	if !arches["amd64"] || !arches["arm64"] || len(arches) != 2 {
		t.Fatalf("the image's platforms: %v", arches)
	}

	// The chart installs that image by digest, and says its version.
	rendered, err := exec.Command(devcluster.HelmBinary(), "template", "aaas", filepath.Join(out, "aaas-"+version+".tgz"), "-n", "aaas").CombinedOutput()
	if err != nil {
		t.Fatalf("helm template: %v: %s", err, rendered)
	}
	pinned := "image: " + Repository + "@" + results[0].Digest.String()
	if n := strings.Count(string(rendered), pinned); n < 5 {
		t.Fatalf("the chart names %q %d times, want every aaas process's", pinned, n)
	}
	if strings.Contains(string(rendered), Repository+":") {
		t.Fatalf("the chart still names the image by tag")
	}

	// The SBOM lists the modules the binaries link, at go.mod's versions.
	var sbom spdx
	b, err := os.ReadFile(filepath.Join(out, "aaas_"+version+".sbom.spdx.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &sbom); err != nil {
		t.Fatal(err)
	}
	mod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	nats := regexp.MustCompile(`(?m)^\s+github.com/nats-io/nats.go (\S+)`).FindSubmatch(mod)
	found := false
	for _, p := range sbom.Packages {
		found = found || (p.Name == "github.com/nats-io/nats.go" && p.Version == string(nats[1]))
	}
	if sbom.Version != "SPDX-2.3" || !found || !strings.Contains(sbom.Namespace, results[0].Digest.Hex) {
		t.Fatalf("SBOM %s: %d packages, nats.go %s listed: %v", sbom.Namespace, len(sbom.Packages), nats[1], found)
	}

	// The notes are CHANGELOG's section for the version.
	section, err := Notes(root, version)
	if err != nil {
		t.Fatal(err)
	}
	notes, err := os.ReadFile(filepath.Join(out, "RELEASE_NOTES.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(string(notes), section) || !strings.Contains(string(notes), results[0].Digest.String()) {
		t.Fatalf("RELEASE_NOTES.md:\n%s", notes)
	}
}

type ociIndex struct {
	Manifests []struct {
		Digest      string            `json:"digest"`
		Annotations map[string]string `json:"annotations"`
	} `json:"manifests"`
}

// ociArchive reads an OCI layout tarball: its blobs by digest, each
// checked against its name, and index.json.
func ociArchive(t *testing.T, file string) (map[string][]byte, ociIndex) {
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	blobs := map[string][]byte{}
	var index ociIndex
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case h.Name == "index.json":
			if err := json.Unmarshal(b, &index); err != nil {
				t.Fatal(err)
			}
		case h.Typeflag == tar.TypeReg && strings.HasPrefix(h.Name, "blobs/sha256/"):
			sum := sha256.Sum256(b)
			if hx := strings.TrimPrefix(h.Name, "blobs/sha256/"); hx != hex.EncodeToString(sum[:]) {
				t.Fatalf("blob %s holds sha256:%x", hx, sum)
			}
			blobs["sha256:"+strings.TrimPrefix(h.Name, "blobs/sha256/")] = b
		}
	}
	return blobs, index
}

// A release the checkout does not say is refused before anything is
// built, with what to do.
func TestReleaseRefusesWhatTheCheckoutDoesNotSay(t *testing.T) {
	root := testenv.Root()
	for version, want := range map[string]string{
		"v1.2.3":  "is not x.y.z",
		"1.2":     "is not x.y.z",
		"99.0.0":  `CHANGELOG.md has no section "## 99.0.0"`,
		"01.0.0":  "is not x.y.z",
		"1.2.3-x": "is not x.y.z",
	} {
		out := filepath.Join(t.TempDir(), "out")
		if _, err := Build(Options{Version: version, Root: root, Out: out}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("release %s: %v, want %q", version, err, want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("release %s wrote %s", version, out)
		}
	}
	// A checkout whose chart says another version.
	dir := t.TempDir()
	changelog := "# Changelog\n\n## 7.7.7\n\n- a release\n\n## 0.1.0\n\n- the first\n"
	files := map[string]string{"CHANGELOG.md": changelog, "charts/aaas/Chart.yaml": "version: 0.1.0\nappVersion: \"0.1.0\"\n",
		"manifests/base/kustomization.yaml": "    newTag: \"7.7.7\"\n", "README.md": "git clone --branch v7.7.7 …\n  - …//manifests/base?ref=v7.7.7\n"}
	for name, text := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Build(Options{Version: "7.7.7", Root: dir, Out: filepath.Join(dir, "out")}); err == nil || !strings.Contains(err.Error(), `Chart.yaml does not say "version: 7.7.7"`) {
		t.Fatalf("a chart of another version: %v", err)
	}
	// And a README that installs another.
	files["charts/aaas/Chart.yaml"], files["README.md"] = "version: 7.7.7\nappVersion: \"7.7.7\"\n", "git clone --branch v7.7.6 …\n"
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Build(Options{Version: "7.7.7", Root: dir, Out: filepath.Join(dir, "out")}); err == nil || !strings.Contains(err.Error(), "README.md's install does not pin v7.7.7") {
		t.Fatalf("a README pinning another release: %v", err)
	}
	if notes, err := Notes(dir, "7.7.7"); err != nil || notes != "## 7.7.7\n\n- a release\n\n" {
		t.Fatalf("notes %q, %v", notes, err)
	}
}
