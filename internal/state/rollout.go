package state

import (
	"maps"
	"time"
)

// BucketRollouts holds each profile's rollout (Rollout), by profile name:
// written by lifecycle's lease holder, which counts every sandbox, and
// read by the admin view, which cannot.
const BucketRollouts = "rollouts"

// Rollout is how far a profile's sandboxes have come to its
// SandboxTemplate's revision (ROLLOUT).
type Rollout struct {
	Profile string `json:"profile"`
	// Target is the revision of the profile's template now: where a
	// rollout takes its sandboxes ("" while it cannot be read).
	Target string `json:"target,omitempty"`
	// Sandboxes counts the profile's sandboxes by the revision of their
	// pod template ("": not known yet).
	Sandboxes map[string]int `json:"sandboxes"`
	// Halted counts the sandboxes rolled back, by the revision a pod of
	// which failed them: no sandbox is rolled to it again.
	Halted map[string]int `json:"halted,omitempty"`
	// At is when the counts were taken.
	At time.Time `json:"at"`
}

// Same reports whether r and o say the same, whenever each was taken.
func (r Rollout) Same(o Rollout) bool {
	return r.Profile == o.Profile && r.Target == o.Target && maps.Equal(r.Sandboxes, o.Sandboxes) && maps.Equal(r.Halted, o.Halted)
}
