// Package broker is the model-API endpoint sandboxes call instead of
// their providers: it decides whose call it is from the address the
// connection comes from (never from anything the pod sends), refuses what
// a user may not spend, forwards to the provider with the organisation's
// key (or the user's own), streams the answer event by event, meters the
// tokens it carried and publishes the user's activity while the call
// runs. The provider keys live here and nowhere else.
package broker

import (
	"fmt"
	"time"
)

// Refusal is a call the broker answers itself, in the provider's error
// shape, without forwarding anything: Status (403, 429, 503, …) and a
// Message the user is shown (DSH displays a provider's error message).
type Refusal struct {
	Status  int
	Message string
	// RetryAfter, when set, becomes the Retry-After header.
	RetryAfter time.Duration
	// Reason is the metric label (no user in it): "budget",
	// "concurrency", "unattributed", "unavailable", …
	Reason string
}

func (r *Refusal) Error() string { return fmt.Sprintf("%d %s", r.Status, r.Message) }
