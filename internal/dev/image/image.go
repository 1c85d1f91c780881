// Package image builds container images from static binaries without
// Docker or a registry: one layer of files on an empty base, a config with
// the entrypoint and a numeric user, written as a docker-archive tarball
// that `ctr images import` (and `docker load`) accept. It describes the
// aaas image exactly as the Dockerfile does (a test keeps them equal) and
// the images the real-node devcluster needs: the DSH stand-in, NATS, the
// agent-sandbox controller, the pod sandbox (pause), and this machine's
// own programs that operators' scripts run in pods (curl).
package image

import (
	"archive/tar"
	"bytes"
	"cmp"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aaas-project/aaas"
	"github.com/aaas-project/aaas/internal/dev/gobuild"
)

// NonRoot is the user every aaas image runs as: distroless's "nonroot",
// written as numbers because the kubelet can only verify runAsNonRoot
// against a numeric image user, and copies only the UID from it (pods set
// runAsGroup for the GID).
const NonRoot = "65532:65532"

// Spec describes one image.
type Spec struct {
	// Ref is the name the image is tagged with, as manifests refer to it.
	Ref string
	// Files maps a path in the image to the host file copied there
	// (mode 0755: every file here is a program).
	Files map[string]string
	// Entrypoint is the command the image runs.
	Entrypoint []string
	// User is the numeric uid:gid the image runs as ("" for root).
	User string
	// Env is the image's environment; PATH is the directory of the
	// entrypoint unless set.
	Env []string
	// Labels are the image's OCI annotations.
	Labels map[string]string
	// Arch is the image's CPU architecture, GOARCH's name ("" for amd64);
	// Files must hold programs built for it.
	Arch string
	// OCI builds the image with OCI media types (a release's), instead
	// of Docker's, which docker load and ctr import take.
	OCI bool
}

// AAASBinaries are the commands of the aaas image, in the Dockerfile's order.
var AAASBinaries = []string{"edge", "lifecycle", "sweeper", "broker", "setup"}

// AAAS is the image the Dockerfile builds: the aaas processes and the
// setup step in /usr/local/bin, the edge by default, running as NonRoot.
func AAAS(binDir, ref string) Spec {
	s := Spec{Ref: ref, Files: map[string]string{}, Entrypoint: []string{"/usr/local/bin/edge"}, User: NonRoot, Labels: Labels(tagOf(ref))}
	for _, b := range AAASBinaries {
		s.Files["/usr/local/bin/"+b] = filepath.Join(binDir, b)
	}
	return s
}

// Labels are the OCI labels of the aaas image (the Dockerfile's LABEL):
// what it is, where it comes from, and the release it carries.
func Labels(version string) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":    "aaas",
		"org.opencontainers.image.source":   "https://github.com/aaas-project/aaas",
		"org.opencontainers.image.version":  version,
		"org.opencontainers.image.licenses": "Apache-2.0",
	}
}

// tagOf is a reference's tag ("" for none or a digest).
func tagOf(ref string) string {
	name := ref[strings.LastIndex(ref, "/")+1:]
	if _, tag, ok := strings.Cut(name, ":"); ok && !strings.Contains(name, "@") {
		return tag
	}
	return ""
}

// DSHSim is the DSH Web stand-in as the Dockerfile's dshsim target builds
// it, with the model provider stand-in beside it: the SandboxTemplate's args (`web --host 0.0.0.0 --port 3080`) go
// straight to it, as they would to DSH Web's own entrypoint.
// Its tag is its DSHSIM_VERSION, which the stand-in reports, so a test
// sees which image a sandbox's pod runs.
func DSHSim(binDir, ref string) Spec {
	return Spec{Ref: ref, Files: map[string]string{"/usr/local/bin/dshsim": filepath.Join(binDir, "dshsim"), "/usr/local/bin/providersim": filepath.Join(binDir, "providersim")},
		Entrypoint: []string{"/usr/local/bin/dshsim"}, User: NonRoot, Env: []string{"PATH=/usr/local/bin", "DSHSIM_VERSION=" + tagOf(ref)}}
}

// BuildBinaries compiles into dir what AAAS and DSHSim put in their
// images: the aaas commands (cmd/) and the stand-ins (internal/dev/cmd/).
func BuildBinaries(dir string) error {
	pkgs := map[string]string{"dshsim": "internal/dev/cmd/dshsim", "providersim": "internal/dev/cmd/providersim"}
	for _, b := range AAASBinaries {
		pkgs[b] = "cmd/" + b
	}
	for _, pkg := range pkgs {
		if _, err := gobuild.Binary(dir, "github.com/aaas-project/aaas/"+pkg); err != nil {
			return err
		}
	}
	return nil
}

// NATSRef is the NATS image the manifests name (versions.env).
func NATSRef() string { return "docker.io/library/" + aaas.Version("NATS_IMAGE") }

// NATS is nats-server, built from the module at go.mod's version, where the
// official image keeps it; the StatefulSet's args and its preStop
// `nats-server -sl=ldm=…` work unchanged.
func NATS(bin string) Spec {
	return Spec{Ref: NATSRef(), Files: map[string]string{"/usr/local/bin/nats-server": bin},
		Entrypoint: []string{"/usr/local/bin/nats-server"}}
}

// BuildNATS compiles nats-server from the main module's pinned version.
func BuildNATS(dir string) (string, error) {
	return gobuild.BinaryNamed(dir, "github.com/nats-io/nats-server/v2", "nats-server")
}

// AgentSandboxRef is the controller image the agent-sandbox release
// manifests name.
func AgentSandboxRef() string {
	return "registry.k8s.io/agent-sandbox/agent-sandbox-controller:" + aaas.Version("AGENT_SANDBOX_VERSION")
}

// AgentSandbox is the controller image as the agent-sandbox Dockerfile
// builds it (distroless nonroot, the binary at the root).
func AgentSandbox(bin string) Spec {
	return Spec{Ref: AgentSandboxRef(), Files: map[string]string{"/agent-sandbox-controller": bin},
		Entrypoint: []string{"/agent-sandbox-controller"}, User: NonRoot}
}

// PauseRef is the pod sandbox image containerd is configured with.
const PauseRef = "registry.k8s.io/pause:3.10"

// Pause builds the pod sandbox image into dir and returns the tarball.
func Pause(dir string) (string, error) {
	return Program(dir, "github.com/aaas-project/aaas/internal/dev/image/pause", PauseRef, "65535:65535")
}

// Program compiles the main package pkg and writes an image of it (the
// binary at the root, as its entrypoint) into dir; it returns the tarball.
func Program(dir, pkg, ref, user string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	bin, err := gobuild.Binary(dir, pkg)
	if err != nil {
		return "", err
	}
	s := Spec{Ref: ref, Files: map[string]string{"/" + path.Base(pkg): bin}, Entrypoint: []string{"/" + path.Base(pkg)}, User: user}
	out := filepath.Join(dir, path.Base(pkg)+".tar")
	return out, s.Write(out)
}

// HostProgram writes into dir an image of a dynamically linked program of
// this machine (such as Debian's curl) with the shared libraries it loads,
// at the paths the loader looks for them, as its entrypoint's directory's
// PATH; it returns the tarball. It is for tools that operators' scripts
// run in a pod (scripts/preflight-sso.sh runs curl), which the real node
// cannot pull.
func HostProgram(dir, bin, ref, user string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return "", fmt.Errorf("image %s: ldd %s: %w", ref, bin, err)
	}
	files := map[string]string{bin: bin}
	for _, line := range strings.Split(string(out), "\n") {
		// "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)" or the
		// loader itself, "/lib64/ld-linux-x86-64.so.2 (0x…)"; the vDSO has
		// no file.
		f := strings.Fields(line)
		switch {
		case len(f) == 4 && f[1] == "=>":
			files[f[2]] = f[2]
		case len(f) == 2 && strings.HasPrefix(f[0], "/"):
			files[f[0]] = f[0]
		}
	}
	s := Spec{Ref: ref, Files: files, Entrypoint: []string{bin}, User: user}
	tar := filepath.Join(dir, path.Base(bin)+".tar")
	return tar, s.Write(tar)
}

// Write builds the image and writes it to out as a docker-archive tarball.
func (s Spec) Write(out string) error {
	img, err := s.Image()
	if err != nil {
		return err
	}
	ref, err := name.NewTag(s.Ref)
	if err != nil {
		return fmt.Errorf("image %s: %w", s.Ref, err)
	}
	if err := tarball.WriteToFile(out, ref, img); err != nil {
		return fmt.Errorf("image %s: %w", s.Ref, err)
	}
	return nil
}

// Image builds the image in memory.
func (s Spec) Image() (v1.Image, error) {
	layer, err := s.layer()
	if err != nil {
		return nil, err
	}
	base := empty.Image
	if s.OCI {
		base = mutate.MediaType(mutate.ConfigMediaType(base, types.OCIConfigJSON), types.OCIManifestSchema1)
	}
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Ref, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Ref, err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", cmp.Or(s.Arch, "amd64")
	cf.Config.User = s.User
	cf.Config.Entrypoint = s.Entrypoint
	cf.Config.Env = s.Env
	cf.Config.Labels = s.Labels
	if len(cf.Config.Env) == 0 && len(s.Entrypoint) > 0 {
		cf.Config.Env = []string{"PATH=" + path.Dir(s.Entrypoint[0])}
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Ref, err)
	}
	return img, nil
}

// layer is one tar of the files, their parent directories and a
// world-writable /tmp (programs and controllers write certificates and
// scratch files there), with fixed timestamps so equal inputs give equal
// digests.
func (s Spec) layer() (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	dirs := map[string]bool{}
	mkdir := func(d string, mode int64) error {
		parts := strings.Split(strings.Trim(d, "/"), "/")
		for i := range parts {
			p := strings.Join(parts[:i+1], "/")
			if p == "" || dirs[p] {
				continue
			}
			dirs[p] = true
			m := int64(0o755)
			if i == len(parts)-1 {
				m = mode
			}
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: p + "/", Mode: m, ModTime: epoch}); err != nil {
				return err
			}
		}
		return nil
	}
	if err := mkdir("tmp", 0o1777); err != nil {
		return nil, err
	}
	dsts := make([]string, 0, len(s.Files))
	for dst := range s.Files {
		dsts = append(dsts, dst)
	}
	sort.Strings(dsts)
	for _, dst := range dsts {
		b, err := os.ReadFile(s.Files[dst])
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", s.Ref, err)
		}
		if err := mkdir(path.Dir(dst), 0o755); err != nil {
			return nil, err
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(dst, "/"), Mode: 0o755, Size: int64(len(b)), ModTime: epoch}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	// Compressed once: the digest, the manifest and the archive each ask
	// for the compressed bytes, and compressing 50 MiB of binaries takes
	// seconds.
	opts := []tarball.LayerOption{tarball.WithCompressedCaching}
	if s.OCI {
		opts = append(opts, tarball.WithMediaType(types.OCILayer))
	}
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }, opts...)
}

// Install builds into dir the images an install on the real node needs:
// aaas (aaasRef) and the DSH stand-in (dshRef) from the static binaries in
// binDir, NATS from its module, and the agent-sandbox controller from its
// binary. It returns the tarballs, ready for import.
func Install(binDir, dir, aaasRef, dshRef, agentSandboxBin string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	nats, err := BuildNATS(dir)
	if err != nil {
		return nil, err
	}
	specs := map[string]Spec{
		"aaas.tar":          AAAS(binDir, aaasRef),
		"dsh-web.tar":       DSHSim(binDir, dshRef),
		"nats.tar":          NATS(nats),
		"agent-sandbox.tar": AgentSandbox(agentSandboxBin),
	}
	var out []string
	for file, s := range specs {
		p := filepath.Join(dir, file)
		if err := s.Write(p); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	sort.Strings(out)
	return out, nil
}
