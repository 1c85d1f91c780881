package sandbox

import (
	"encoding/json"
	"net"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/state"
)

// stuckReasons are container waiting reasons that will not clear without
// someone acting; the user is shown them as Failed.
var stuckReasons = map[string]bool{
	"CrashLoopBackOff": true, "ImagePullBackOff": true, "ErrImagePull": true,
	"CreateContainerConfigError": true, "CreateContainerError": true, "RunContainerError": true,
}

// Derive computes a user's sandbox record from the Kubernetes objects.
// prev is the record as last written (its phase tells a first start from a
// resume, and its ReadySince survives while the sandbox stays Ready).
func (c *Cluster) Derive(user string, s State, prev state.Sandbox) state.Sandbox {
	r := state.Sandbox{User: user, Managed: c.Managed(s.Claim), Updated: time.Now().UTC()}
	if s.Claim == nil {
		r.Phase = state.PhaseDeleting
		return r
	}
	r.Claim, r.Profile = s.Claim.Name, s.Claim.Annotations[ProfileAnnotation]
	if s.Sandbox != nil {
		r.Sandbox, r.Revision, r.Halted = s.Sandbox.Name, Revision(s.Sandbox), s.Sandbox.Annotations[HaltedAnnotation]
		r.LastSuspend = lastSuspend(s.Sandbox.Annotations[SuspendAnnotation])
	}
	if s.Pod != nil && s.Pod.DeletionTimestamp == nil {
		r.PodName, r.PodUID = s.Pod.Name, string(s.Pod.UID)
	}
	starting := state.PhaseClaiming
	if prev.Phase != "" && prev.Phase != state.PhaseClaiming {
		starting = state.PhaseWaking
	}

	switch {
	case s.Claim.DeletionTimestamp != nil:
		r.Phase = state.PhaseDeleting
	case s.Sandbox == nil:
		r.Phase = state.PhaseClaiming
		if cond := meta.FindStatusCondition(s.Claim.Status.Conditions, "Ready"); cond != nil && cond.Reason != "" && cond.Status != "True" {
			r.Reason = cond.Message
		}
	case s.Sandbox.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeSuspended:
		r.Phase = state.PhaseSuspended
		if s.Pod != nil {
			r.Phase = state.PhaseSuspending
		}
	case s.Pod == nil || s.Pod.DeletionTimestamp != nil:
		r.Phase = starting
	default:
		r.Phase, r.Reason = podPhase(s.Pod, starting)
	}
	if r.Phase == state.PhaseReady {
		r.Address, r.PodIP = c.Address(s), s.Pod.Status.PodIP
		r.ReadySince = prev.ReadySince
		if prev.Phase != state.PhaseReady || prev.PodUID != r.PodUID || r.ReadySince.IsZero() {
			r.ReadySince = r.Updated
		}
	}
	return r
}

// lastSuspend reads SuspendAnnotation; nil when absent or unreadable (an
// annotation edited by hand says nothing).
func lastSuspend(note string) *state.Suspension {
	if note == "" {
		return nil
	}
	var s state.Suspension
	if json.Unmarshal([]byte(note), &s) != nil || s.At.IsZero() || s.Reason == "" {
		return nil
	}
	return &s
}

func podPhase(pod *corev1.Pod, starting state.Phase) (state.Phase, string) {
	switch pod.Status.Phase {
	case corev1.PodFailed, corev1.PodSucceeded:
		return state.PhaseFailed, "pod " + string(pod.Status.Phase) + ": " + pod.Status.Message
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil && stuckReasons[w.Reason] {
			msg := w.Reason
			if t := cs.LastTerminationState.Terminated; t != nil && t.Message != "" {
				msg += ": " + t.Message
			}
			return state.PhaseFailed, msg
		}
	}
	for _, cond := range pod.Status.Conditions {
		if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue && pod.Status.PodIP != "" {
			return state.PhaseReady, ""
		}
	}
	return starting, ""
}

// Address is where DSH listens for a running sandbox: the pod IP, or the
// sandbox's Service name when configured.
func (c *Cluster) Address(s State) string {
	port := strconv.Itoa(c.cfg.Port)
	if c.cfg.UseService && s.Sandbox.Status.ServiceFQDN != "" {
		return net.JoinHostPort(s.Sandbox.Status.ServiceFQDN, port)
	}
	return net.JoinHostPort(s.Pod.Status.PodIP, port)
}
