package sandbox

import (
	"net"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/kv"
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
func (c *Cluster) Derive(user string, s State, prev kv.Sandbox) kv.Sandbox {
	r := kv.Sandbox{User: user, Managed: c.Managed(s.Claim), Updated: time.Now().UTC()}
	if s.Claim == nil {
		r.Phase = kv.PhaseDeleting
		return r
	}
	r.Claim = s.Claim.Name
	if s.Sandbox != nil {
		r.Sandbox = s.Sandbox.Name
	}
	if s.Pod != nil && s.Pod.DeletionTimestamp == nil {
		r.PodName, r.PodUID = s.Pod.Name, string(s.Pod.UID)
	}
	starting := kv.PhaseClaiming
	if prev.Phase != "" && prev.Phase != kv.PhaseClaiming {
		starting = kv.PhaseWaking
	}

	switch {
	case s.Claim.DeletionTimestamp != nil:
		r.Phase = kv.PhaseDeleting
	case s.Sandbox == nil:
		r.Phase = kv.PhaseClaiming
		if cond := meta.FindStatusCondition(s.Claim.Status.Conditions, "Ready"); cond != nil && cond.Reason != "" && cond.Status != "True" {
			r.Reason = cond.Message
		}
	case s.Sandbox.Spec.OperatingMode == sandboxv1beta1.SandboxOperatingModeSuspended:
		r.Phase = kv.PhaseSuspended
		if s.Pod != nil {
			r.Phase = kv.PhaseSuspending
		}
	case s.Pod == nil || s.Pod.DeletionTimestamp != nil:
		r.Phase = starting
	default:
		r.Phase, r.Reason = podPhase(s.Pod, starting)
	}
	if r.Phase == kv.PhaseReady {
		r.Address = c.Address(s)
		r.ReadySince = prev.ReadySince
		if prev.Phase != kv.PhaseReady || prev.PodUID != r.PodUID || r.ReadySince.IsZero() {
			r.ReadySince = r.Updated
		}
	}
	return r
}

func podPhase(pod *corev1.Pod, starting kv.Phase) (kv.Phase, string) {
	switch pod.Status.Phase {
	case corev1.PodFailed, corev1.PodSucceeded:
		return kv.PhaseFailed, "pod " + string(pod.Status.Phase) + ": " + pod.Status.Message
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil && stuckReasons[w.Reason] {
			msg := w.Reason
			if t := cs.LastTerminationState.Terminated; t != nil && t.Message != "" {
				msg += ": " + t.Message
			}
			return kv.PhaseFailed, msg
		}
	}
	for _, cond := range pod.Status.Conditions {
		if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue && pod.Status.PodIP != "" {
			return kv.PhaseReady, ""
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
