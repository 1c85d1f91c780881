// Package config loads and validates each process's configuration from
// environment variables. Every error names the variable that caused it, and
// all problems are reported at once so an operator fixes them in one pass.
package config

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Env reads typed values from an environment and collects every problem it
// finds. Callers read all their variables, then check Err once.
type Env struct {
	lookup func(string) (string, bool)
	errs   []error
	// describe, when set, is told of every typed read before it happens:
	// Settings builds the catalogue of variables from it.
	describe func(Setting)
}

// FromOS reads the process environment.
func FromOS() *Env { return &Env{lookup: os.LookupEnv} }

// FromMap reads a fixed map; tests and tools use it instead of mutating the
// process environment.
func FromMap(m map[string]string) *Env {
	return &Env{lookup: func(k string) (string, bool) { v, ok := m[k]; return v, ok }}
}

// Setting is one variable as its loader reads it: its name, kind, default
// and bounds. The chart's values.schema.json is generated from these
// (hack/chartschema), so the chart refuses what the processes would.
type Setting struct {
	Name string
	// Kind is string, secret, integer, boolean, duration, list or enum.
	Kind    string
	Default string
	// Min and Max bound an integer or a duration (as its loader prints it).
	Min, Max string
	// Enum lists an enum's allowed values.
	Enum []string
}

// Settings lists, sorted by name, every variable an aaas process reads:
// each loader runs against an empty environment that records what it is
// asked for and how. A variable read by several loaders is described by
// the first typed read.
func Settings() []Setting {
	seen := map[string]Setting{}
	e := &Env{lookup: func(k string) (string, bool) {
		if _, ok := seen[k]; !ok {
			seen[k] = Setting{Name: k, Kind: "string"}
		}
		return "", false
	}}
	e.describe = func(s Setting) {
		if old, ok := seen[s.Name]; !ok || old.Kind == "string" && old.Default == "" {
			seen[s.Name] = s
		}
	}
	_, _ = LoadEdge(e)
	_, _ = LoadLifecycle(e)
	_, _ = LoadSweeper(e)
	_, _ = LoadSetup(e)
	_, _ = LoadBroker(e)
	_, _ = LoadSecrets(e)
	_, _ = LoadSmoke(e)
	out := make([]Setting, 0, len(seen))
	for _, s := range seen {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Variables lists, sorted, every environment variable an aaas process
// reads (Settings' names). Tools that start processes (devstack) use it to
// pass the operator's settings through.
func Variables() []string {
	var names []string
	for _, s := range Settings() {
		names = append(names, s.Name)
	}
	return names
}

// Err returns every problem found so far, joined, or nil.
func (e *Env) Err() error { return errors.Join(e.errs...) }

// Fail records a validation error against a variable.
func (e *Env) Fail(name, format string, args ...any) {
	e.errs = append(e.errs, fmt.Errorf("%s: %s", name, fmt.Sprintf(format, args...)))
}

func (e *Env) note(s Setting) {
	if e.describe != nil {
		e.describe(s)
	}
}

func (e *Env) raw(name string) (string, bool) {
	v, ok := e.lookup(name)
	v = strings.TrimSpace(v)
	return v, ok && v != ""
}

// Set reports whether the variable is present and non-empty.
func (e *Env) Set(name string) bool { _, ok := e.raw(name); return ok }

// String returns the variable or def when unset.
func (e *Env) String(name, def string) string {
	e.note(Setting{Name: name, Kind: "string", Default: def})
	if v, ok := e.raw(name); ok {
		return v
	}
	return def
}

// Secret is String for values that must never be echoed back in an error.
func (e *Env) Secret(name string) string {
	e.note(Setting{Name: name, Kind: "secret"})
	v, _ := e.raw(name)
	return v
}

// Int returns the variable as an integer within [lo, hi].
func (e *Env) Int(name string, def, lo, hi int) int {
	e.note(Setting{Name: name, Kind: "integer", Default: strconv.Itoa(def), Min: strconv.Itoa(lo), Max: strconv.Itoa(hi)})
	v, ok := e.raw(name)
	if !ok {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		e.Fail(name, "%q is not an integer", v)
		return def
	}
	if n < lo || n > hi {
		e.Fail(name, "%d is outside [%d, %d]", n, lo, hi)
		return def
	}
	return n
}

// Bool accepts 1/0, true/false, yes/no, on/off.
func (e *Env) Bool(name string, def bool) bool {
	e.note(Setting{Name: name, Kind: "boolean", Default: strconv.FormatBool(def)})
	v, ok := e.raw(name)
	if !ok {
		return def
	}
	switch strings.ToLower(v) {
	case "1", "true", "yes", "on":
		return true
	case "0", "false", "no", "off":
		return false
	}
	e.Fail(name, "%q is not a boolean (use true or false)", v)
	return def
}

// Duration accepts Go durations ("90s", "15m") and, like the seed gateway,
// a bare number of seconds ("900"). The result must lie in [lo, hi].
func (e *Env) Duration(name string, def, lo, hi time.Duration) time.Duration {
	e.note(Setting{Name: name, Kind: "duration", Default: def.String(), Min: lo.String(), Max: hi.String()})
	v, ok := e.raw(name)
	if !ok {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		secs, ferr := strconv.ParseFloat(v, 64)
		if ferr != nil {
			e.Fail(name, "%q is not a duration (e.g. 30s, 15m, or seconds)", v)
			return def
		}
		d = time.Duration(secs * float64(time.Second))
	}
	if d < lo || d > hi {
		e.Fail(name, "%s is outside [%s, %s]", d, lo, hi)
		return def
	}
	return d
}

// List splits a comma-separated variable, dropping empty items.
func (e *Env) List(name string, def []string) []string {
	e.note(Setting{Name: name, Kind: "list", Default: strings.Join(def, ",")})
	v, ok := e.raw(name)
	if !ok {
		return def
	}
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// OneOf returns the variable if it is one of the allowed values.
func (e *Env) OneOf(name, def string, allowed ...string) string {
	e.note(Setting{Name: name, Kind: "enum", Default: def, Enum: allowed})
	v := e.String(name, def)
	for _, a := range allowed {
		if v == a {
			return v
		}
	}
	e.Fail(name, "%q is not one of %s", v, strings.Join(allowed, ", "))
	return def
}
