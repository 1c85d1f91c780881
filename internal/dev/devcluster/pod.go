package devcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/aaas-project/aaas/internal/dev/child"
)

// podRuntime is one pod on the simulated node.
type podRuntime struct {
	n      *Node
	key    string
	uid    types.UID
	ip     string
	dir    string
	policy corev1.RestartPolicy
	start  metav1.Time
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu          sync.Mutex
	containers  []*containerRuntime
	terminating bool
	grace       time.Duration // how long stop waits after SIGTERM
}

// containerRuntime is one container: a dshsim process, restarted with
// back-off when it crashes.
type containerRuntime struct {
	spec corev1.Container
	env  []string
	logs string // directory of this container's log files, one per run

	// guarded by podRuntime.mu
	proc        *child.Process
	restarts    int
	ready       bool
	runningAt   metav1.Time
	waiting     *corev1.ContainerStateWaiting
	terminated  *corev1.ContainerStateTerminated // final state (no restart)
	lastTermin  *corev1.ContainerStateTerminated
	containerID string
}

func (n *Node) startPod(pod *corev1.Pod) (*podRuntime, error) {
	port := 3080
	if len(pod.Spec.Containers) > 0 && len(pod.Spec.Containers[0].Ports) > 0 {
		port = int(pod.Spec.Containers[0].Ports[0].ContainerPort)
	}
	ip, err := n.ips.acquire(port)
	if err != nil {
		return nil, err
	}
	rt := &podRuntime{
		n: n, key: pod.Namespace + "/" + pod.Name, uid: pod.UID, ip: ip,
		dir:    filepath.Join(n.opts.dir, "pods", string(pod.UID)),
		policy: pod.Spec.RestartPolicy, start: metav1.Now(),
	}
	fail := func(err error) (*podRuntime, error) {
		n.ips.release(ip)
		return nil, err
	}
	volumes, err := n.volumes(pod, rt.dir)
	if err != nil {
		return fail(err)
	}
	for _, c := range pod.Spec.Containers {
		env, err := n.containerEnv(pod, c, volumes, rt.dir, ip)
		if err != nil {
			return fail(err)
		}
		cr := &containerRuntime{spec: c, env: env, logs: filepath.Join(rt.dir, "logs", c.Name)}
		if err := os.MkdirAll(cr.logs, 0o700); err != nil {
			return fail(fmt.Errorf("log dir: %w", err))
		}
		cr.waiting = &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}
		rt.containers = append(rt.containers, cr)
	}
	rt.ctx, rt.cancel = context.WithCancel(n.ctx)
	for _, cr := range rt.containers {
		rt.wg.Add(1)
		go rt.run(cr)
	}
	return rt, nil
}

// volumes maps each pod volume to a host directory: a PVC to its
// directory, everything else to a fresh directory in the pod's own dir.
func (n *Node) volumes(pod *corev1.Pod, podDir string) (map[string]string, error) {
	dirs := map[string]string{}
	for _, v := range pod.Spec.Volumes {
		dir := filepath.Join(podDir, "volumes", v.Name)
		if v.PersistentVolumeClaim != nil {
			pvc, err := n.pvcs.PersistentVolumeClaims(pod.Namespace).Get(v.PersistentVolumeClaim.ClaimName)
			if err != nil {
				return nil, fmt.Errorf("volume %s: waiting for PVC %s: %w", v.Name, v.PersistentVolumeClaim.ClaimName, err)
			}
			dir = n.pvcDir(pvc)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("volume %s: %w", v.Name, err)
		}
		dirs[v.Name] = dir
	}
	return dirs, nil
}

// containerEnv resolves the container's environment and rewrites values
// that point into a volume mount to the host directory behind it, since the
// process sees the host file system.
func (n *Node) containerEnv(pod *corev1.Pod, c corev1.Container, volumes map[string]string, podDir, ip string) ([]string, error) {
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		dir, ok := volumes[m.Name]
		if !ok {
			return nil, fmt.Errorf("container %s: mount of unknown volume %s", c.Name, m.Name)
		}
		host := filepath.Join(dir, m.SubPath)
		if err := os.MkdirAll(host, 0o755); err != nil {
			return nil, fmt.Errorf("mount %s: %w", m.MountPath, err)
		}
		mounts[filepath.Clean(m.MountPath)] = host
	}
	mapPath := func(v string) string {
		best := ""
		for mp := range mounts {
			if (v == mp || strings.HasPrefix(v, mp+"/")) && len(mp) > len(best) {
				best = mp
			}
		}
		if best == "" {
			return v
		}
		return mounts[best] + strings.TrimPrefix(v, best)
	}

	vars := map[string]string{}
	for _, ef := range c.EnvFrom {
		data, err := n.envSource(pod.Namespace, ef)
		if err != nil {
			return nil, err
		}
		for k, v := range data {
			vars[ef.Prefix+k] = v
		}
	}
	for _, e := range c.Env {
		v, ok, err := n.envValue(pod, e, ip)
		if err != nil {
			return nil, fmt.Errorf("container %s env %s: %w", c.Name, e.Name, err)
		}
		if ok {
			vars[e.Name] = v
		}
	}
	port := 3080
	if len(c.Ports) > 0 {
		port = int(c.Ports[0].ContainerPort)
	}
	env := []string{
		"PATH=" + os.Getenv("PATH"),
		"HOSTNAME=" + pod.Name,
		"DSHSIM_LISTEN=" + net.JoinHostPort(ip, strconv.Itoa(port)),
	}
	if _, ok := vars["HOME"]; !ok {
		vars["HOME"] = filepath.Join(podDir, "home")
	}
	keys := make([]string, 0, len(vars))
	for k := range vars {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+mapPath(vars[k]))
	}
	// The simulated pods share the host's network namespace, so their
	// connections would come from 127.0.0.1; a real pod's come from its pod
	// IP, which the broker attributes model calls by. dshsim binds its
	// provider connections to this address. Last, so the pod spec cannot
	// name another (the environment's last entry wins).
	env = append(env, "DEVCLUSTER_POD_IP="+ip)
	return env, nil
}

func (n *Node) envValue(pod *corev1.Pod, e corev1.EnvVar, ip string) (string, bool, error) {
	if e.ValueFrom == nil {
		return e.Value, true, nil
	}
	ctx := n.ctx
	switch vf := e.ValueFrom; {
	case vf.SecretKeyRef != nil:
		s, err := n.client.CoreV1().Secrets(pod.Namespace).Get(ctx, vf.SecretKeyRef.Name, metav1.GetOptions{})
		if err != nil || s.Data[vf.SecretKeyRef.Key] == nil {
			if vf.SecretKeyRef.Optional != nil && *vf.SecretKeyRef.Optional {
				return "", false, nil
			}
			return "", false, fmt.Errorf("secret %s key %s: %v", vf.SecretKeyRef.Name, vf.SecretKeyRef.Key, err)
		}
		return string(s.Data[vf.SecretKeyRef.Key]), true, nil
	case vf.ConfigMapKeyRef != nil:
		cm, err := n.client.CoreV1().ConfigMaps(pod.Namespace).Get(ctx, vf.ConfigMapKeyRef.Name, metav1.GetOptions{})
		v, ok := "", false
		if err == nil {
			v, ok = cm.Data[vf.ConfigMapKeyRef.Key]
		}
		if !ok {
			if vf.ConfigMapKeyRef.Optional != nil && *vf.ConfigMapKeyRef.Optional {
				return "", false, nil
			}
			return "", false, fmt.Errorf("configmap %s key %s: %v", vf.ConfigMapKeyRef.Name, vf.ConfigMapKeyRef.Key, err)
		}
		return v, true, nil
	case vf.FieldRef != nil:
		switch vf.FieldRef.FieldPath {
		case "metadata.name":
			return pod.Name, true, nil
		case "metadata.namespace":
			return pod.Namespace, true, nil
		case "metadata.uid":
			return string(pod.UID), true, nil
		case "status.podIP":
			return ip, true, nil
		case "spec.nodeName":
			return n.Name, true, nil
		}
		return "", false, fmt.Errorf("field %s is not simulated", vf.FieldRef.FieldPath)
	}
	return "", false, errors.New("unsupported valueFrom")
}

func (n *Node) envSource(ns string, ef corev1.EnvFromSource) (map[string]string, error) {
	switch {
	case ef.SecretRef != nil:
		s, err := n.client.CoreV1().Secrets(ns).Get(n.ctx, ef.SecretRef.Name, metav1.GetOptions{})
		if err != nil {
			if ef.SecretRef.Optional != nil && *ef.SecretRef.Optional {
				return nil, nil
			}
			return nil, fmt.Errorf("envFrom secret %s: %w", ef.SecretRef.Name, err)
		}
		out := map[string]string{}
		for k, v := range s.Data {
			out[k] = string(v)
		}
		return out, nil
	case ef.ConfigMapRef != nil:
		cm, err := n.client.CoreV1().ConfigMaps(ns).Get(n.ctx, ef.ConfigMapRef.Name, metav1.GetOptions{})
		if err != nil {
			if ef.ConfigMapRef.Optional != nil && *ef.ConfigMapRef.Optional {
				return nil, nil
			}
			return nil, fmt.Errorf("envFrom configmap %s: %w", ef.ConfigMapRef.Name, err)
		}
		return cm.Data, nil
	}
	return nil, nil
}

// run keeps one container going: start, wait, and on exit either restart
// with back-off (doubling, capped) or stop, per the restart policy.
func (rt *podRuntime) run(cr *containerRuntime) {
	defer rt.wg.Done()
	backoff := rt.n.opts.crashBackoff
	for {
		rt.mu.Lock()
		run := cr.restarts
		rt.mu.Unlock()
		p, err := child.Start(child.Options{Name: cr.spec.Name, Path: rt.n.opts.dshsim, Env: cr.env, Dir: rt.dir, Log: filepath.Join(cr.logs, strconv.Itoa(run)+".log")})
		started := metav1.Now()
		if err == nil {
			rt.mu.Lock()
			cr.proc, cr.runningAt, cr.waiting, cr.ready = p, started, nil, cr.spec.ReadinessProbe == nil
			cr.containerID = fmt.Sprintf("sim://%s-%s-%d", rt.uid, cr.spec.Name, run)
			rt.mu.Unlock()
			rt.n.notify(rt.key)
			pctx, stopProbes := context.WithCancel(rt.ctx)
			go rt.probe(pctx, cr, p)
			select {
			case <-p.Done():
			case <-rt.ctx.Done():
			}
			stopProbes()
			if rt.ctx.Err() != nil {
				rt.mu.Lock()
				grace := rt.grace
				rt.mu.Unlock()
				p.Stop(grace)
				return
			}
		}

		term := &corev1.ContainerStateTerminated{ExitCode: 128, Reason: "StartError", StartedAt: started, FinishedAt: metav1.Now()}
		if err != nil {
			term.Message = err.Error()
		} else {
			term.ExitCode = int32(p.ExitCode())
			term.Reason = "Error"
			if term.ExitCode == 0 {
				term.Reason = "Completed"
			} else if term.ExitCode < 0 {
				term.ExitCode, term.Reason = 137, "OOMKilled"
			}
			term.Message = p.LogTail(5)
			term.ContainerID = cr.containerID
		}
		final := rt.policy == corev1.RestartPolicyNever || (rt.policy == corev1.RestartPolicyOnFailure && term.ExitCode == 0)
		if time.Since(started.Time) > 60*time.Second {
			backoff = rt.n.opts.crashBackoff // it ran fine for a while: forgive
		}
		rt.mu.Lock()
		cr.ready, cr.proc = false, nil
		if final {
			cr.terminated = term
		} else {
			cr.lastTermin = term
			cr.waiting = &corev1.ContainerStateWaiting{
				Reason:  "CrashLoopBackOff",
				Message: fmt.Sprintf("back-off %s restarting failed container=%s pod=%s", backoff, cr.spec.Name, rt.key),
			}
		}
		rt.mu.Unlock()
		rt.n.notify(rt.key)
		if final {
			return
		}
		select {
		case <-time.After(backoff):
		case <-rt.ctx.Done():
			return
		}
		if backoff < 32*rt.n.opts.crashBackoff {
			backoff *= 2
		}
		rt.mu.Lock()
		cr.restarts++
		rt.mu.Unlock()
	}
}

// probe runs the readiness and liveness probes of one run of a container.
// A failed liveness probe kills the process, which run then restarts.
func (rt *podRuntime) probe(ctx context.Context, cr *containerRuntime, p *child.Process) {
	type state struct {
		spec  *corev1.Probe
		fails int
		oks   int
	}
	readiness, liveness := &state{spec: cr.spec.ReadinessProbe}, &state{spec: cr.spec.LivenessProbe}
	if readiness.spec == nil && liveness.spec == nil {
		return
	}
	// Probe fast until the container is first ready (tests should not wait
	// for production timings), then at the pod's own period, capped so a
	// crash still shows up quickly.
	fast := rt.n.opts.probePeriod
	period := func(spec *corev1.Probe) time.Duration {
		return min(time.Duration(max(spec.PeriodSeconds, 1))*time.Second, 8*fast)
	}
	t := time.NewTimer(fast)
	defer t.Stop()
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		next := fast
		rt.mu.Lock()
		if cr.ready && readiness.spec != nil {
			next = period(readiness.spec)
		}
		rt.mu.Unlock()
		t.Reset(next)
		if s := readiness; s.spec != nil && time.Since(start) >= capDelay(s.spec.InitialDelaySeconds, fast) {
			ok := rt.check(ctx, cr, s.spec)
			rt.mu.Lock()
			was := cr.ready
			if ok {
				s.fails = 0
				s.oks++
				if s.oks >= int(max(s.spec.SuccessThreshold, 1)) {
					cr.ready = true
				}
			} else {
				s.oks = 0
				s.fails++
				if s.fails >= int(max(s.spec.FailureThreshold, 1)) {
					cr.ready = false
				}
			}
			changed := was != cr.ready
			rt.mu.Unlock()
			if changed {
				rt.n.notify(rt.key)
			}
		}
		if s := liveness; s.spec != nil && time.Since(start) >= capDelay(s.spec.InitialDelaySeconds, fast) {
			if rt.check(ctx, cr, s.spec) {
				s.fails = 0
			} else if s.fails++; s.fails >= int(max(s.spec.FailureThreshold, 3)) {
				_ = p.Signal(syscall.SIGKILL)
				return
			}
		}
	}
}

// capDelay shortens a probe's initial delay like its period, so tests do
// not wait for production timings.
func capDelay(seconds int32, period time.Duration) time.Duration {
	return min(time.Duration(seconds)*time.Second, 4*period)
}

func (rt *podRuntime) check(ctx context.Context, cr *containerRuntime, pr *corev1.Probe) bool {
	timeout := time.Second
	if pr.TimeoutSeconds > 0 {
		timeout = min(timeout, time.Duration(pr.TimeoutSeconds)*time.Second)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch {
	case pr.HTTPGet != nil:
		g := pr.HTTPGet
		host := g.Host
		if host == "" {
			host = rt.ip
		}
		scheme := "http"
		if g.Scheme == corev1.URISchemeHTTPS {
			scheme = "https"
		}
		url := scheme + "://" + net.JoinHostPort(host, strconv.Itoa(portOf(cr.spec, g.Port))) + g.Path
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false
		}
		for _, h := range g.HTTPHeaders {
			if strings.EqualFold(h.Name, "Host") {
				req.Host = h.Value
			} else {
				req.Header.Add(h.Name, h.Value)
			}
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode >= 200 && resp.StatusCode < 400
	case pr.TCPSocket != nil:
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(rt.ip, strconv.Itoa(portOf(cr.spec, pr.TCPSocket.Port))))
		if err != nil {
			return false
		}
		c.Close()
		return true
	}
	return false // exec and gRPC probes are not simulated
}

func portOf(c corev1.Container, p intstr.IntOrString) int {
	if p.Type == intstr.Int {
		return p.IntValue()
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return int(cp.ContainerPort)
		}
	}
	return 0
}

// status renders the runtime as a PodStatus based on the pod's current one.
func (rt *podRuntime) status(pod *corev1.Pod) *corev1.PodStatus {
	st := pod.Status.DeepCopy()
	rt.mu.Lock()
	defer rt.mu.Unlock()
	st.HostIP, st.HostIPs = "127.0.0.1", []corev1.HostIP{{IP: "127.0.0.1"}}
	st.PodIP, st.PodIPs = rt.ip, []corev1.PodIP{{IP: rt.ip}}
	st.StartTime = &rt.start

	allReady, anyRunning, allDone, anyFailed := true, false, true, false
	st.ContainerStatuses = st.ContainerStatuses[:0]
	for _, cr := range rt.containers {
		cs := corev1.ContainerStatus{
			Name: cr.spec.Name, Image: cr.spec.Image, ImageID: "sim://" + cr.spec.Image,
			RestartCount: int32(cr.restarts), Ready: cr.ready, ContainerID: cr.containerID,
		}
		if cr.lastTermin != nil {
			cs.LastTerminationState.Terminated = cr.lastTermin
		}
		started := false
		switch {
		case cr.terminated != nil:
			cs.State.Terminated = cr.terminated
			anyFailed = anyFailed || cr.terminated.ExitCode != 0
		case cr.proc != nil:
			cs.State.Running = &corev1.ContainerStateRunning{StartedAt: cr.runningAt}
			started, anyRunning, allDone = true, true, false
		default:
			cs.State.Waiting = cr.waiting
			allDone = false
		}
		cs.Started = &started
		allReady = allReady && cr.ready
		st.ContainerStatuses = append(st.ContainerStatuses, cs)
	}
	switch {
	case allDone && anyFailed:
		st.Phase = corev1.PodFailed
	case allDone:
		st.Phase = corev1.PodSucceeded
	case anyRunning || rt.anyRestarted():
		st.Phase = corev1.PodRunning
	default:
		st.Phase = corev1.PodPending
	}
	ready, reason := corev1.ConditionFalse, "ContainersNotReady"
	if allReady && st.Phase == corev1.PodRunning {
		ready, reason = corev1.ConditionTrue, ""
	}
	setCondition(st, corev1.PodScheduled, corev1.ConditionTrue, "", "")
	setCondition(st, corev1.PodInitialized, corev1.ConditionTrue, "", "")
	setCondition(st, corev1.ContainersReady, ready, reason, "")
	setCondition(st, corev1.PodReady, ready, reason, "")
	return st
}

func (rt *podRuntime) anyRestarted() bool {
	for _, cr := range rt.containers {
		if cr.restarts > 0 || cr.lastTermin != nil {
			return true
		}
	}
	return false
}

// markTerminating flags graceful deletion; false if it was already flagged.
func (rt *podRuntime) markTerminating() bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if rt.terminating {
		return false
	}
	rt.terminating = true
	return true
}

// stop ends every container (SIGTERM, grace, SIGKILL) and waits for them.
func (rt *podRuntime) stop(grace time.Duration) {
	rt.mu.Lock()
	rt.grace = grace
	rt.mu.Unlock()
	rt.cancel()
	rt.wg.Wait()
}

func (rt *podRuntime) signal(container string, sig syscall.Signal) error {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for _, cr := range rt.containers {
		if cr.spec.Name == container && cr.proc != nil {
			return cr.proc.Signal(sig)
		}
	}
	return fmt.Errorf("container %s of %s is not running", container, rt.key)
}

func (rt *podRuntime) pids() []int {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	var pids []int
	for _, cr := range rt.containers {
		if cr.proc != nil && !cr.proc.Exited() {
			pids = append(pids, cr.proc.PID())
		}
	}
	return pids
}

// logFile returns the log of the current run, or of the previous one.
func (rt *podRuntime) logFile(container string, previous bool) (path string, live *child.Process, err error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for _, cr := range rt.containers {
		if cr.spec.Name != container {
			continue
		}
		run := cr.restarts
		if previous {
			if cr.lastTermin == nil {
				return "", nil, fmt.Errorf("previous terminated container %q in pod %q not found", container, rt.key)
			}
			if cr.proc != nil || cr.terminated != nil {
				run--
			}
		} else {
			live = cr.proc
		}
		return filepath.Join(cr.logs, strconv.Itoa(run)+".log"), live, nil
	}
	return "", nil, fmt.Errorf("container %q not found in pod %q", container, rt.key)
}
