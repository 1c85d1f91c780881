package release

import (
	"debug/buildinfo"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/aaas-project/aaas/internal/dev/image"
)

// modules records what the binaries in bin were built from, as Go wrote
// it into each (debug/buildinfo): the Go release, the main module and
// every module linked in.
func (r *run) modules(bin string) error {
	if r.deps == nil {
		r.deps = map[string]string{}
	}
	for _, c := range image.AAASBinaries {
		info, err := buildinfo.ReadFile(filepath.Join(bin, c))
		if err != nil {
			return fmt.Errorf("build info of %s: %w", c, err)
		}
		r.goVersion = info.GoVersion
		for _, m := range info.Deps {
			if m.Replace != nil {
				m = m.Replace
			}
			r.deps[m.Path] = m.Version
		}
	}
	return nil
}

// spdx is the part of SPDX 2.3's JSON form the SBOM uses.
type spdx struct {
	Version       string         `json:"spdxVersion"`
	DataLicense   string         `json:"dataLicense"`
	ID            string         `json:"SPDXID"`
	Name          string         `json:"name"`
	Namespace     string         `json:"documentNamespace"`
	CreationInfo  spdxCreation   `json:"creationInfo"`
	Packages      []spdxPackage  `json:"packages"`
	Relationships []spdxRelation `json:"relationships"`
}

type spdxCreation struct {
	Created  string   `json:"created"`
	Creators []string `json:"creators"`
}

type spdxPackage struct {
	Name            string    `json:"name"`
	ID              string    `json:"SPDXID"`
	Version         string    `json:"versionInfo,omitempty"`
	Download        string    `json:"downloadLocation"`
	FilesAnalyzed   bool      `json:"filesAnalyzed"`
	LicenseDeclared string    `json:"licenseDeclared,omitempty"`
	Purpose         string    `json:"primaryPackagePurpose,omitempty"`
	ExternalRefs    []spdxRef `json:"externalRefs,omitempty"`
}

type spdxRef struct {
	Category string `json:"referenceCategory"`
	Type     string `json:"referenceType"`
	Locator  string `json:"referenceLocator"`
}

type spdxRelation struct {
	Element string `json:"spdxElementId"`
	Type    string `json:"relationshipType"`
	Related string `json:"relatedSpdxElement"`
}

// sbom writes aaas_<version>.sbom.spdx.json: the image (by digest), the
// aaas module, the Go standard library and every module its binaries
// link, each with its package URL, for scanners (grype, trivy) to match
// against advisories.
func (r *run) sbom(digest v1.Hash) error {
	r.logf("writing the SBOM")
	purl := func(path, version string) []spdxRef {
		return []spdxRef{{Category: "PACKAGE-MANAGER", Type: "purl", Locator: "pkg:golang/" + path + "@" + version}}
	}
	doc := spdx{
		Version: "SPDX-2.3", DataLicense: "CC0-1.0", ID: "SPDXRef-DOCUMENT", Name: "aaas-" + r.o.Version,
		Namespace:    fmt.Sprintf("https://github.com/aaas-project/aaas/releases/%s/sbom/%s", r.o.Version, digest.Hex),
		CreationInfo: spdxCreation{Created: r.epoch.Format(time.RFC3339), Creators: []string{"Tool: aaas-release-" + r.o.Version, "Organization: aaas"}},
		Packages: []spdxPackage{
			{Name: "aaas", ID: "SPDXRef-Image", Version: r.o.Version, Download: "NOASSERTION", LicenseDeclared: "Apache-2.0", Purpose: "CONTAINER",
				ExternalRefs: []spdxRef{{Category: "PACKAGE-MANAGER", Type: "purl",
					Locator: "pkg:oci/aaas@" + strings.Replace(digest.String(), ":", "%3A", 1) + "?repository_url=" + Repository}}},
			{Name: "github.com/aaas-project/aaas", ID: "SPDXRef-Main", Version: "v" + r.o.Version, Download: "https://github.com/aaas-project/aaas",
				LicenseDeclared: "Apache-2.0", Purpose: "APPLICATION", ExternalRefs: purl("github.com/aaas-project/aaas", "v"+r.o.Version)},
			{Name: "stdlib", ID: "SPDXRef-Go-stdlib", Version: r.goVersion, Download: "https://go.dev/dl/", Purpose: "LIBRARY", ExternalRefs: purl("stdlib", r.goVersion)},
		},
		Relationships: []spdxRelation{{Element: "SPDXRef-DOCUMENT", Type: "DESCRIBES", Related: "SPDXRef-Image"},
			{Element: "SPDXRef-Image", Type: "CONTAINS", Related: "SPDXRef-Main"},
			{Element: "SPDXRef-Main", Type: "DEPENDS_ON", Related: "SPDXRef-Go-stdlib"}},
	}
	paths := make([]string, 0, len(r.deps))
	for p := range r.deps {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for i, p := range paths {
		id := fmt.Sprintf("SPDXRef-Go-%d", i+1)
		doc.Packages = append(doc.Packages, spdxPackage{Name: p, ID: id, Version: r.deps[p], Download: "NOASSERTION", Purpose: "LIBRARY", ExternalRefs: purl(p, r.deps[p])})
		doc.Relationships = append(doc.Relationships, spdxRelation{Element: "SPDXRef-Main", Type: "DEPENDS_ON", Related: id})
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	return r.write(fmt.Sprintf("aaas_%s.sbom.spdx.json", r.o.Version), append(b, '\n'))
}
