package config

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
)

// Profile is one kind of sandbox a user may choose (PROFILES): which warm
// pool, and so which SandboxTemplate, its claim draws from, and who may
// choose it.
type Profile struct {
	Name        string `json:"name"`
	Description string `json:"description,omitempty"`
	// WarmPool is the SandboxWarmPool the profile's claims draw from.
	WarmPool string `json:"warm_pool"`
	// Groups are the SSO groups (AUTH_PROXY_GROUPS_HEADER) whose members
	// may choose the profile; empty: every user.
	Groups []string `json:"groups,omitempty"`
	// MaxRunning caps the profile's sandboxes that hold a pod (0: no cap
	// of its own; MAX_RUNNING_SANDBOXES still counts every profile):
	// wakes beyond it queue, and pass over no other profile's.
	MaxRunning int `json:"max_running,omitempty"`
	// IdleTimeout and MaxRuntime replace IDLE_TIMEOUT and MAX_RUNTIME for
	// the profile's sandboxes (0: the global one).
	IdleTimeout Duration `json:"idle_timeout,omitzero"`
	MaxRuntime  Duration `json:"max_runtime,omitzero"`
}

// Duration is a time.Duration written as Go writes one ("30m", "8h").
type Duration time.Duration

// UnmarshalJSON reads "30m" and the like.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("a duration is a string such as \"30m\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// Policy is base, the idle rule of IDLE_TIMEOUT and MAX_RUNTIME, with
// p's own idle_timeout and max_runtime in their place where given.
func (p Profile) Policy(base idle.Policy) idle.Policy {
	if p.IdleTimeout > 0 {
		base.IdleTimeout = time.Duration(p.IdleTimeout)
	}
	if p.MaxRuntime > 0 {
		base.MaxRuntime = time.Duration(p.MaxRuntime)
	}
	return base
}

// PolicyOf is the idle rule of the sandboxes of profile name ("" or one
// PROFILES no longer lists: the default's).
func (ps Profiles) PolicyOf(base idle.Policy, name string) idle.Policy {
	p, ok := ps.Find(name)
	if !ok {
		p = ps[0]
	}
	return p.Policy(base)
}

// checkPolicies refuses a profile whose idle rule, merged with base,
// would suspend every sandbox at its ceiling before it could fall idle
// (the rule idlePolicy applies to IDLE_TIMEOUT and MAX_RUNTIME).
func checkPolicies(e *Env, ps Profiles, base idle.Policy) {
	for _, p := range ps {
		if r := p.Policy(base); r.MaxRuntime > 0 && r.MaxRuntime < r.IdleTimeout {
			e.Fail("PROFILES", "profile %q: max_runtime %s is shorter than its idle timeout %s", p.Name, r.MaxRuntime, r.IdleTimeout)
		}
	}
}

// Profiles is PROFILES in its order: the first is the default, which a
// user who chooses none gets, and which every sandbox made before
// profiles existed (a claim that names none) is.
type Profiles []Profile

// Find returns the named profile; "" names the default.
func (ps Profiles) Find(name string) (Profile, bool) {
	if name == "" {
		return ps[0], true
	}
	for _, p := range ps {
		if p.Name == name {
			return p, true
		}
	}
	return Profile{}, false
}

// Kept is the profile a sandbox of profile name is remade of: that
// one, or the default when PROFILES no longer lists it.
func (ps Profiles) Kept(name string) Profile {
	if p, ok := ps.Find(name); ok {
		return p
	}
	return ps[0]
}

// NameOf is the name of the profile a record or claim names: name, or
// the default's for "" (one made before profiles).
func (ps Profiles) NameOf(name string) string {
	if name == "" {
		return ps[0].Name
	}
	return name
}

// Names lists the profiles' names, for messages.
func (ps Profiles) Names() string {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	return strings.Join(names, ", ")
}

// Caps is each capped profile's MaxRunning, by name.
func (ps Profiles) Caps() map[string]int {
	caps := map[string]int{}
	for _, p := range ps {
		if p.MaxRunning > 0 {
			caps[p.Name] = p.MaxRunning
		}
	}
	return caps
}

// Allows reports whether a user in the groups member says may choose p.
func (p Profile) Allows(member func(group string) bool) bool {
	if len(p.Groups) == 0 {
		return true
	}
	for _, g := range p.Groups {
		if member(g) {
			return true
		}
	}
	return false
}

// maxDescription bounds a profile's description: it is shown on every
// user's page.
const maxDescription = 200

// loadProfiles reads PROFILES, or makes the one default profile of
// WARM_POOL when it is unset: one name per setting, so the two are not
// set together. sso says whether groups can be known (the edge; lifecycle
// passes true: it checks no groups).
func loadProfiles(e *Env, sso bool) Profiles {
	v := e.String("PROFILES", "")
	pool := e.String("WARM_POOL", "dsh-pool")
	if v == "" {
		if !dns1123.MatchString(pool) {
			e.Fail("WARM_POOL", "%q is not a Kubernetes object name", pool)
		}
		return Profiles{{Name: "default", WarmPool: pool}}
	}
	if e.Set("WARM_POOL") {
		e.Fail("WARM_POOL", "set with PROFILES, which names each profile's warm_pool; leave WARM_POOL unset")
	}
	var ps Profiles
	dec := json.NewDecoder(strings.NewReader(v))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ps); err != nil || dec.More() {
		e.Fail("PROFILES", `not a JSON list of profiles such as [{"name":"small","description":"2 CPUs","warm_pool":"dsh-pool"}]: %v`, err)
		return Profiles{{Name: "default", WarmPool: pool}}
	}
	if len(ps) == 0 {
		e.Fail("PROFILES", "lists no profile; leave it unset for one default profile")
		return Profiles{{Name: "default", WarmPool: pool}}
	}
	seen := map[string]bool{}
	for _, p := range ps {
		switch {
		case ident.ValidateProfile(p.Name) != nil:
			e.Fail("PROFILES", "profile name %q: %v", p.Name, ident.ErrBadProfile)
		case seen[p.Name]:
			e.Fail("PROFILES", "profile %q is listed twice", p.Name)
		case !dns1123.MatchString(p.WarmPool):
			e.Fail("PROFILES", "profile %q: warm_pool %q is not a Kubernetes object name", p.Name, p.WarmPool)
		case len(p.Description) > maxDescription:
			e.Fail("PROFILES", "profile %q: a description of %d bytes (at most %d)", p.Name, len(p.Description), maxDescription)
		case p.IdleTimeout != 0 && (p.IdleTimeout < Duration(time.Second) || p.IdleTimeout > Duration(30*24*time.Hour)):
			e.Fail("PROFILES", "profile %q: idle_timeout %s is not from 1s to 720h", p.Name, time.Duration(p.IdleTimeout))
		case p.MaxRuntime < 0 || p.MaxRuntime > Duration(365*24*time.Hour):
			e.Fail("PROFILES", "profile %q: max_runtime %s is not from 0 to 8760h", p.Name, time.Duration(p.MaxRuntime))
		case p.MaxRunning < 0:
			e.Fail("PROFILES", "profile %q: max_running %d is below 0", p.Name, p.MaxRunning)
		case len(p.Groups) > 0 && !sso:
			e.Fail("PROFILES", "profile %q names groups, which need SSO (AUTH_PROXY_HEADER): groups come from the SSO proxy", p.Name)
		}
		seen[p.Name] = true
	}
	if len(ps[0].Groups) > 0 {
		// Everyone may have to fall back on the default: accounts made
		// before profiles, and users who choose none.
		e.Fail("PROFILES", "the first profile, %q, is the default every user may get: it names no groups", ps[0].Name)
	}
	return ps
}
