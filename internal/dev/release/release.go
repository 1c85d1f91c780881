// Package release cuts a release of aaas from a checkout: the binaries,
// the aaas image for each architecture as one OCI archive, an SBOM of the
// image, the Helm chart with that image pinned by digest, the release's
// notes from CHANGELOG.md, and SHA256SUMS over all of them. Everything is
// reproducible: the same commit and version give the same bytes (fixed
// timestamps, -trimpath, no build ids), so anyone can rebuild a release
// and compare its checksums with the published ones.
package release

import (
	"archive/tar"
	"bufio"
	"bytes"
	"cmp"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/aaas-project/aaas/internal/dev/image"
	"github.com/aaas-project/aaas/internal/dev/manifests"
)

// Repository is where the release's image is published.
const Repository = "ghcr.io/aaas-project/aaas"

// Arches are the architectures a release builds for.
var Arches = []string{"amd64", "arm64"}

// Options say what to release, from where, to where.
type Options struct {
	// Version is the release, x.y.z (no leading v).
	Version string
	// Root is the checkout; Out the directory the release is written to
	// (created; it must not hold a release already).
	Root, Out string
	// Log receives progress lines.
	Log io.Writer
	// prebuilt, in tests, holds the binaries of an earlier Build of the
	// same checkout (<prebuilt>/<arch>/), which this one packages again
	// instead of building; Build leaves its binaries there when it is
	// set and empty.
	prebuilt string
}

// Result is what Build made: the image index's digest, which the chart
// pins, and the files written (relative to Out, sorted).
type Result struct {
	Digest v1.Hash
	Files  []string
}

var semver = regexp.MustCompile(`^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$`)

// Build cuts the release.
func Build(o Options) (Result, error) {
	if !semver.MatchString(o.Version) {
		return Result{}, fmt.Errorf("version %q is not x.y.z", o.Version)
	}
	notes, err := Notes(o.Root, o.Version)
	if err != nil {
		return Result{}, err
	}
	if err := checkVersions(o.Root, o.Version); err != nil {
		return Result{}, err
	}
	epoch, err := commitTime(o.Root)
	if err != nil {
		return Result{}, err
	}
	if _, err := os.Stat(o.Out); err == nil {
		return Result{}, fmt.Errorf("%s exists: a release is written into a new directory", o.Out)
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return Result{}, err
	}
	work, err := os.MkdirTemp("", "release-")
	if err != nil {
		return Result{}, err
	}
	defer os.RemoveAll(work)
	r := &run{o: o, epoch: epoch, work: work}

	var images []v1.Image
	for _, arch := range Arches {
		bin := filepath.Join(cmp.Or(o.prebuilt, filepath.Join(work, "bin")), arch)
		if _, err := os.Stat(bin); o.prebuilt == "" || err != nil {
			r.logf("building the binaries for linux/%s", arch)
			if err := Binaries(o.Root, o.Version, arch, bin, image.AAASBinaries...); err != nil {
				return Result{}, err
			}
		}
		if err := r.modules(bin); err != nil {
			return Result{}, err
		}
		if err := r.binariesArchive(arch, bin); err != nil {
			return Result{}, err
		}
		spec := image.AAAS(bin, Repository+":"+o.Version)
		spec.Arch, spec.OCI = arch, true
		img, err := spec.Image()
		if err != nil {
			return Result{}, err
		}
		images = append(images, img)
	}
	idx, err := index(images)
	if err != nil {
		return Result{}, err
	}
	digest, err := idx.Digest()
	if err != nil {
		return Result{}, err
	}
	if err := r.ociArchive(idx); err != nil {
		return Result{}, err
	}
	if err := r.sbom(digest); err != nil {
		return Result{}, err
	}
	if err := r.chart(digest); err != nil {
		return Result{}, err
	}
	if err := r.notes(notes, digest); err != nil {
		return Result{}, err
	}
	files, err := r.checksums()
	if err != nil {
		return Result{}, err
	}
	return Result{Digest: digest, Files: files}, nil
}

// run is one release being built.
type run struct {
	o     Options
	epoch time.Time
	work  string
	// What the binaries were built from (modules): the SBOM's packages.
	goVersion string
	deps      map[string]string
}

func (r *run) logf(format string, args ...any) {
	if r.o.Log != nil {
		fmt.Fprintf(r.o.Log, "release: "+format+"\n", args...)
	}
}

// Binaries compiles cmds (./cmd/<name>) of the checkout at root for
// linux/arch into dir, as a release does: static, trimmed paths, no build
// id, the version stamped; Go makes that the same bytes from the same
// source, wherever and whenever it is built.
func Binaries(root, version, arch, dir string, cmds ...string) error {
	args := []string{"build", "-trimpath", "-ldflags", "-s -w -buildid= -X github.com/aaas-project/aaas/internal/telemetry.Version=v" + version, "-o", dir + "/"}
	for _, c := range cmds {
		args = append(args, "./cmd/"+c)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch, "GOFLAGS=-mod=readonly")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build for %s: %v: %s", arch, err, out)
	}
	return nil
}

// binariesArchive writes aaas_<version>_linux_<arch>.tar.gz: the
// commands, the licence and the README.
func (r *run) binariesArchive(arch, bin string) error {
	files := map[string]string{"LICENSE": filepath.Join(r.o.Root, "LICENSE"), "README.md": filepath.Join(r.o.Root, "README.md")}
	for _, c := range image.AAASBinaries {
		files[c] = filepath.Join(bin, c)
	}
	name := fmt.Sprintf("aaas_%s_linux_%s", r.o.Version, arch)
	var entries []entry
	for n, src := range files {
		b, err := os.ReadFile(src)
		if err != nil {
			return err
		}
		mode := int64(0o755)
		if strings.ToUpper(n) == n || strings.HasSuffix(n, ".md") {
			mode = 0o644
		}
		entries = append(entries, entry{name: name + "/" + n, data: b, mode: mode})
	}
	return r.writeTar(name+".tar.gz", true, entries)
}

// index is the multi-architecture image over images (one per Arches).
func index(images []v1.Image) (v1.ImageIndex, error) {
	var adds []mutate.IndexAddendum
	for i, img := range images {
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: Arches[i]}}})
	}
	return mutate.AppendManifests(empty.Index, adds...), nil
}

// ociArchive writes aaas_<version>.oci.tar, an OCI image layout whose
// index.json names the image index as <version> (skopeo copy
// oci-archive:aaas_<version>.oci.tar:<version> docker://…, crane push,
// docker load on Docker 25 and later).
func (r *run) ociArchive(idx v1.ImageIndex) error {
	r.logf("writing the image")
	blobs := map[string][]byte{}
	add := func(b []byte) v1.Hash {
		sum := sha256.Sum256(b)
		h := v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])}
		blobs[h.Hex] = b
		return h
	}
	raw, err := idx.RawManifest()
	if err != nil {
		return err
	}
	idxDigest := add(raw)
	im, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	for _, d := range im.Manifests {
		img, err := idx.Image(d.Digest)
		if err != nil {
			return err
		}
		for _, get := range []func() ([]byte, error){img.RawManifest, img.RawConfigFile} {
			b, err := get()
			if err != nil {
				return err
			}
			add(b)
		}
		layers, err := img.Layers()
		if err != nil {
			return err
		}
		for _, l := range layers {
			rc, err := l.Compressed()
			if err != nil {
				return err
			}
			b, err := io.ReadAll(rc)
			rc.Close()
			if err != nil {
				return err
			}
			add(b)
		}
	}
	mt, err := idx.MediaType()
	if err != nil {
		return err
	}
	top := fmt.Sprintf(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":%q,"digest":%q,"size":%d,"annotations":{"org.opencontainers.image.ref.name":%q}}]}`,
		mt, idxDigest.String(), len(raw), r.o.Version)
	entries := []entry{
		{name: "oci-layout", data: []byte(`{"imageLayoutVersion":"1.0.0"}`), mode: 0o644},
		{name: "index.json", data: []byte(top), mode: 0o644},
	}
	for hexsum, b := range blobs {
		entries = append(entries, entry{name: "blobs/sha256/" + hexsum, data: b, mode: 0o644})
	}
	return r.writeTar(fmt.Sprintf("aaas_%s.oci.tar", r.o.Version), false, entries)
}

// chart writes aaas-<version>.tgz: charts/aaas as `helm package`
// archives it (symbolic links followed), with values.yaml's image.digest
// set to the release's.
func (r *run) chart(digest v1.Hash) error {
	r.logf("packaging the chart")
	var entries []entry
	err := walkFiles(filepath.Join(r.o.Root, manifests.Chart), "aaas", func(name string, b []byte) error {
		if name == "aaas/values.yaml" {
			var err error
			if b, err = pinDigest(b, digest); err != nil {
				return err
			}
		}
		entries = append(entries, entry{name: name, data: b, mode: 0o644})
		return nil
	})
	if err != nil {
		return err
	}
	return r.writeTar(fmt.Sprintf("aaas-%s.tgz", r.o.Version), true, entries)
}

// walkFiles calls fn with every file under dir, named under prefix,
// following symbolic links (the chart links files it shares with the
// kustomize bases).
func walkFiles(dir, prefix string, fn func(name string, b []byte) error) error {
	des, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, d := range des {
		p, name := filepath.Join(dir, d.Name()), prefix+"/"+d.Name()
		st, err := os.Stat(p) // follows a link
		if err != nil {
			return err
		}
		if st.IsDir() {
			if err := walkFiles(p, name, fn); err != nil {
				return err
			}
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if err := fn(name, b); err != nil {
			return err
		}
	}
	return nil
}

// pinDigest sets image.digest in the chart's values.yaml.
func pinDigest(values []byte, digest v1.Hash) ([]byte, error) {
	re := regexp.MustCompile(`(?m)^(image:\n(?:  .*\n)*?  digest: )""`)
	if !re.Match(values) {
		return nil, fmt.Errorf("the chart's values.yaml has no empty image.digest to pin")
	}
	return re.ReplaceAll(values, []byte(`${1}"`+digest.String()+`"`)), nil
}

// notes writes RELEASE_NOTES.md: the CHANGELOG's section and what to
// install.
func (r *run) notes(section string, digest v1.Hash) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# aaas %s\n\n", r.o.Version)
	fmt.Fprintf(&b, "Image: `%s:%s@%s` (linux/%s).\n", Repository, r.o.Version, digest, strings.Join(Arches, ", linux/"))
	fmt.Fprintf(&b, "Chart: `aaas-%s.tgz` (its values pin that digest).\n", r.o.Version)
	fmt.Fprintf(&b, "Verify what you downloaded: `sha256sum -c SHA256SUMS`; rebuild it from the tag: `make release VERSION=%s`, same checksums.\n\n", r.o.Version)
	b.WriteString(section)
	return r.write("RELEASE_NOTES.md", b.Bytes())
}

// checksums writes SHA256SUMS over every file of the release and
// returns their names.
func (r *run) checksums() ([]string, error) {
	des, err := os.ReadDir(r.o.Out)
	if err != nil {
		return nil, err
	}
	var names []string
	var b bytes.Buffer
	for _, d := range des {
		b2, err := os.ReadFile(filepath.Join(r.o.Out, d.Name()))
		if err != nil {
			return nil, err
		}
		sum := sha256.Sum256(b2)
		fmt.Fprintf(&b, "%x  %s\n", sum, d.Name())
		names = append(names, d.Name())
	}
	if err := r.write("SHA256SUMS", b.Bytes()); err != nil {
		return nil, err
	}
	return append(names, "SHA256SUMS"), nil
}

func (r *run) write(name string, b []byte) error {
	return os.WriteFile(filepath.Join(r.o.Out, name), b, 0o644)
}

// entry is one file of an archive.
type entry struct {
	name string
	data []byte
	mode int64
}

// tarball writes entries to w as a tar, sorted by name, every time the
// commit's.
func (r *run) tarball(w io.Writer, entries []entry) error {
	sort.Slice(entries, func(i, j int) bool { return entries[i].name < entries[j].name })
	tw := tar.NewWriter(w)
	dirs := map[string]bool{}
	for _, e := range entries {
		for d := path.Dir(e.name); d != "." && !dirs[d]; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var dirList []string
	for d := range dirs {
		dirList = append(dirList, d)
	}
	sort.Strings(dirList)
	for _, d := range dirList {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: r.epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
	}
	for _, e := range entries {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: e.mode, Size: int64(len(e.data)), ModTime: r.epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		if _, err := tw.Write(e.data); err != nil {
			return err
		}
	}
	return tw.Close()
}

// writeTar writes entries as the release's file name, a tar, or with
// gz a gzipped one (the fastest level: binaries barely compress further,
// and every level gives the same bytes every time).
func (r *run) writeTar(name string, gz bool, entries []entry) error {
	f, err := os.OpenFile(filepath.Join(r.o.Out, name), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	bw := bufio.NewWriterSize(f, 1<<20)
	var w io.Writer = bw
	var zw *gzip.Writer
	if gz {
		if zw, err = gzip.NewWriterLevel(bw, gzip.BestSpeed); err != nil {
			return err
		}
		zw.ModTime, w = r.epoch, zw
	}
	if err := r.tarball(w, entries); err != nil {
		return err
	}
	if zw != nil {
		if err := zw.Close(); err != nil {
			return err
		}
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	return f.Close()
}

// Notes is CHANGELOG.md's section for version ("## x.y.z", up to the
// next section), the release's notes and upgrade steps.
func Notes(root, version string) (string, error) {
	b, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		return "", err
	}
	text := string(b)
	loc := regexp.MustCompile(`(?m)^## ` + regexp.QuoteMeta(version) + `(?:[ \t].*)?$`).FindStringIndex(text)
	if loc == nil {
		return "", fmt.Errorf("CHANGELOG.md has no section \"## %s\": write the release's notes and upgrade steps there first", version)
	}
	section := text[loc[0]:]
	if i := strings.Index(section[loc[1]-loc[0]:], "\n## "); i >= 0 {
		section = section[:loc[1]-loc[0]+i+1]
	}
	if strings.TrimSpace(section[loc[1]-loc[0]:]) == "" {
		return "", fmt.Errorf("CHANGELOG.md's section \"## %s\" is empty", version)
	}
	return section, nil
}

// checkVersions refuses a release whose checkout does not say it: the
// chart's version and appVersion, the kustomize install's image tag and
// README's install (the clone and the kustomize refs) must all name
// version, so that what the tag's README installs is it.
func checkVersions(root, version string) error {
	chart, err := os.ReadFile(filepath.Join(root, manifests.Chart, "Chart.yaml"))
	if err != nil {
		return err
	}
	for _, want := range []string{"version: " + version + "\n", "appVersion: " + strconv.Quote(version) + "\n"} {
		if !bytes.Contains(chart, []byte(want)) {
			return fmt.Errorf("charts/aaas/Chart.yaml does not say %q: bump it in the release's commit", strings.TrimSpace(want))
		}
	}
	kust, err := os.ReadFile(filepath.Join(root, "manifests", "base", "kustomization.yaml"))
	if err != nil {
		return err
	}
	if !bytes.Contains(kust, []byte("newTag: "+strconv.Quote(version))) {
		return fmt.Errorf("manifests/base/kustomization.yaml does not tag the image %q: bump it in the release's commit", version)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		return err
	}
	for _, want := range []string{"--branch v" + version + " ", "?ref=v" + version + "\n"} {
		if !bytes.Contains(readme, []byte(want)) {
			return fmt.Errorf("README.md's install does not pin v%s (%q): bump it in the release's commit", version, strings.TrimSpace(want))
		}
	}
	return nil
}

// commitTime is HEAD's commit time: every timestamp of the release.
func commitTime(root string) (time.Time, error) {
	out, err := exec.Command("git", "-C", root, "log", "-1", "--format=%ct").Output()
	if err != nil {
		return time.Time{}, fmt.Errorf("git log: %w", err)
	}
	sec, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if err != nil {
		return time.Time{}, err
	}
	return time.Unix(sec, 0).UTC(), nil
}
