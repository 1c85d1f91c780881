package telemetry

import (
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// Version is the release this binary was built from: `make build` and the
// Dockerfile set it to `git describe` with
// -ldflags "-X github.com/aaas-project/aaas/internal/telemetry.Version=…".
// Unset, the VCS revision Go recorded stands in, else "dev".
var Version = ""

// BuildVersion is Version, or what stands in for it.
func BuildVersion() string {
	if Version != "" {
		return Version
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if rev != "" && dirty {
			return rev + "-dirty"
		}
		if rev != "" {
			return rev
		}
	}
	return "dev"
}

// buildInfo is aaas_build_info: always 1, its labels name the build, so a
// dashboard can tell which replicas run which release during an upgrade.
func buildInfo() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "aaas_build_info",
		Help:        "The running build: version (git describe) and Go version; always 1.",
		ConstLabels: prometheus.Labels{"version": BuildVersion(), "goversion": runtime.Version()},
	})
	g.Set(1)
	return g
}
