package sandbox_test

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"

	"github.com/aaas-project/aaas/internal/sandbox"
	"github.com/aaas-project/aaas/internal/state"
)

// TestPodFailing: the states of a pod the kubelet keeps that a rollout's
// probation counts as its new revision failing, and those it does not.
func TestPodFailing(t *testing.T) {
	waiting := func(reason string) corev1.ContainerStatus {
		return corev1.ContainerStatus{Name: "dsh", State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason, Message: "tenant text"}}}
	}
	running := corev1.ContainerStatus{Name: "dsh", Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}
	restarted := running
	restarted.RestartCount = 2
	restarted.LastTerminationState.Terminated = &corev1.ContainerStateTerminated{ExitCode: 1, Reason: "Error"}
	gone := metav1.Now()
	for _, c := range []struct {
		name     string
		init     []corev1.ContainerStatus
		main     []corev1.ContainerStatus
		deleting bool
		want     string
	}{
		{name: "being created", main: []corev1.ContainerStatus{waiting("ContainerCreating")}},
		{name: "running", main: []corev1.ContainerStatus{running}},
		{name: "no statuses yet"},
		{name: "image will not pull", main: []corev1.ContainerStatus{waiting("ImagePullBackOff")}, want: "container dsh ImagePullBackOff"},
		{name: "image pull error", main: []corev1.ContainerStatus{waiting("ErrImagePull")}, want: "container dsh ErrImagePull"},
		{name: "bad configuration", main: []corev1.ContainerStatus{waiting("CreateContainerConfigError")}, want: "container dsh CreateContainerConfigError"},
		{name: "crash loop", main: []corev1.ContainerStatus{waiting("CrashLoopBackOff")}, want: "container dsh CrashLoopBackOff"},
		{name: "restarted, running again", main: []corev1.ContainerStatus{restarted}, want: "container dsh restarted (exit 1, Error)"},
		{name: "an init container's", init: []corev1.ContainerStatus{waiting("ErrImagePull")}, main: []corev1.ContainerStatus{waiting("PodInitializing")}, want: "container dsh ErrImagePull"},
		{name: "being deleted", main: []corev1.ContainerStatus{waiting("CrashLoopBackOff")}, deleting: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			pod := &corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodRunning, InitContainerStatuses: c.init, ContainerStatuses: c.main}}
			if c.deleting {
				pod.DeletionTimestamp = &gone
			}
			if got := sandbox.PodFailing(pod); got != c.want {
				t.Errorf("PodFailing = %q, want %q", got, c.want)
			}
		})
	}
	if got := sandbox.PodFailing(nil); got != "" {
		t.Errorf("PodFailing(nil) = %q", got)
	}
}

// A revision has the shape the admin view's filter accepts, and the same
// for the same pod spec.
func TestRevisionShape(t *testing.T) {
	sb := &sandboxv1beta1.Sandbox{}
	sb.Spec.PodTemplate.Spec.Containers = []corev1.Container{{Name: "dsh", Image: "dsh-web:1.0.0"}}
	rev := sandbox.Revision(sb)
	if !state.ValidRevision(rev) || sandbox.Revision(sb.DeepCopy()) != rev {
		t.Fatalf("revision %q", rev)
	}
	for _, r := range []string{"", "abc", "ABCDEF01", "abcdef012", "abcdefg0", "<b>12345"} {
		if state.ValidRevision(r) {
			t.Errorf("ValidRevision(%q)", r)
		}
	}
}
