package devcluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

const nodeName = "sim-node"

type nodeOptions struct {
	dir          string
	dshsim       string
	pki          *pki
	probePeriod  time.Duration
	crashBackoff time.Duration
	log          *slog.Logger
}

// Node is the simulated kubelet: it binds every pod to itself, runs each
// container as a dshsim process on the pod's own loopback IP, probes it,
// reports status, serves container logs to the API server, and keeps each
// PVC as a directory that lives as long as the PVC.
type Node struct {
	Name string

	client  kubernetes.Interface
	opts    nodeOptions
	ips     *ipPool
	kubelet *http.Server
	pods    corelisters.PodLister
	pvcs    corelisters.PersistentVolumeClaimLister
	queue   workqueue.TypedRateLimitingInterface[string]
	log     *slog.Logger
	ctx     context.Context
	// remote reaches the process that runs the node, on a cluster this
	// process attached to (Attach); nil on the owner.
	remote *http.Client

	mu      sync.Mutex
	running map[string]*podRuntime // by namespace/name
}

func startNode(ctx context.Context, client kubernetes.Interface, o nodeOptions) (*Node, error) {
	ips, err := newIPPool()
	if err != nil {
		return nil, err
	}
	n := &Node{
		Name: nodeName, client: client, opts: o, ips: ips, log: o.log.With("component", "sim-node"), ctx: ctx,
		queue:   newRetryQueue(),
		running: map[string]*podRuntime{},
	}
	port, err := n.serveKubelet()
	if err != nil {
		return nil, err
	}
	if err := n.register(ctx, port); err != nil {
		return nil, err
	}

	factory := informers.NewSharedInformerFactory(client, 0)
	podInformer := factory.Core().V1().Pods()
	pvcInformer := factory.Core().V1().PersistentVolumeClaims()
	n.pods, n.pvcs = podInformer.Lister(), pvcInformer.Lister()
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			n.queue.Add(key)
		}
	}
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, obj any) { enqueue(obj) }, DeleteFunc: enqueue,
	}); err != nil {
		return nil, fmt.Errorf("pod informer: %w", err)
	}
	if _, err := pvcInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		DeleteFunc: n.pvcDeleted,
	}); err != nil {
		return nil, fmt.Errorf("pvc informer: %w", err)
	}
	factory.Start(ctx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return nil, fmt.Errorf("sim-node: %v informer did not sync", typ)
		}
	}
	for i := 0; i < 4; i++ {
		go n.worker()
	}
	go func() { <-ctx.Done(); n.queue.ShutDown() }()
	return n, nil
}

func (n *Node) register(ctx context.Context, kubeletPort int) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: map[string]string{
		"kubernetes.io/hostname": n.Name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
	}}}
	created, err := n.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("register node: %w", err)
	}
	capacity := corev1.ResourceList{
		corev1.ResourceCPU: resource.MustParse("64"), corev1.ResourceMemory: resource.MustParse("256Gi"),
		corev1.ResourcePods: resource.MustParse("1000"), corev1.ResourceEphemeralStorage: resource.MustParse("1Ti"),
	}
	now := metav1.Now()
	created.Status = corev1.NodeStatus{
		Capacity: capacity, Allocatable: capacity,
		Phase: corev1.NodeRunning,
		Conditions: []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			Message: "simulated node is ready", LastHeartbeatTime: now, LastTransitionTime: now,
		}},
		Addresses:       []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}, {Type: corev1.NodeHostName, Address: n.Name}},
		DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: int32(kubeletPort)}},
		NodeInfo: corev1.NodeSystemInfo{
			OperatingSystem: "linux", Architecture: "amd64", KubeletVersion: "v1.37.2-sim", ContainerRuntimeVersion: "sim://1",
		},
	}
	if _, err := n.client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("node status: %w", err)
	}
	return nil
}

// newRetryQueue is the work queue of the test bed's own controllers. Its
// retries back off to at most a few seconds, as a kubelet's sync loop
// does, so that work failed during a control-plane outage is done soon
// after the API server returns rather than after client-go's default
// maximum of 1000 s.
func newRetryQueue() workqueue.TypedRateLimitingInterface[string] {
	return workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[string](5*time.Millisecond, 2*time.Second))
}

func (n *Node) worker() {
	for {
		key, quit := n.queue.Get()
		if quit {
			return
		}
		err := n.sync(n.ctx, key)
		if err != nil && n.ctx.Err() == nil {
			n.log.Debug("pod sync failed; retrying", "pod", key, "err", err)
			n.queue.AddRateLimited(key)
		} else {
			n.queue.Forget(key)
		}
		n.queue.Done(key)
	}
}

func (n *Node) sync(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pod, err := n.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		// Deleted without us (force deletion): stop whatever still runs.
		if rt := n.take(key, ""); rt != nil {
			rt.stop(0)
		}
		return nil
	}
	if err != nil {
		return err
	}
	if pod.Spec.NodeName == "" {
		return n.bind(ctx, pod)
	}
	if pod.Spec.NodeName != n.Name {
		return nil
	}

	n.mu.Lock()
	rt := n.running[key]
	n.mu.Unlock()
	if rt != nil && rt.uid != pod.UID {
		// A new pod with the same name; the old one's processes must go.
		n.take(key, rt.uid).stop(0)
		rt = nil
	}

	if pod.DeletionTimestamp != nil {
		return n.terminate(ctx, key, pod, rt)
	}
	if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		return nil
	}
	if rt == nil {
		if rt, err = n.startPod(pod); err != nil {
			n.setPending(ctx, pod, err)
			return err
		}
		n.mu.Lock()
		n.running[key] = rt
		n.mu.Unlock()
	}
	return n.updateStatus(ctx, pod, rt)
}

func (n *Node) bind(ctx context.Context, pod *corev1.Pod) error {
	err := n.client.CoreV1().Pods(pod.Namespace).Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, UID: pod.UID},
		Target:     corev1.ObjectReference{Kind: "Node", Name: n.Name},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
		return fmt.Errorf("bind %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

// terminate runs graceful deletion: SIGTERM, the pod's grace period, then
// SIGKILL in the background (the pod is queued again once its processes
// are gone), and finally the node's own delete with grace 0 that removes
// the pod object (the API server waits for exactly that). A failed final
// delete returns its error so the queue retries it, as a kubelet's sync
// loop does: a pod left half-deleted stalls its owners' foreground
// deletion for good.
func (n *Node) terminate(ctx context.Context, key string, pod *corev1.Pod, rt *podRuntime) error {
	if rt != nil {
		if rt.markTerminating() {
			grace := 30 * time.Second
			if pod.DeletionGracePeriodSeconds != nil {
				grace = time.Duration(*pod.DeletionGracePeriodSeconds) * time.Second
			}
			go func() {
				rt.stop(grace)
				n.take(rt.key, rt.uid)
				n.queue.Add(key)
			}()
		}
		return nil
	}
	zero := int64(0)
	uid := pod.UID
	err := n.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &uid},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("final delete of %s: %w", key, err)
	}
	return nil
}

// take removes and returns the runtime for key (if uid matches, or any uid
// when uid is empty), releasing its IP.
func (n *Node) take(key string, uid types.UID) *podRuntime {
	n.mu.Lock()
	defer n.mu.Unlock()
	rt := n.running[key]
	if rt == nil || (uid != "" && rt.uid != uid) {
		return nil
	}
	delete(n.running, key)
	n.ips.release(rt.ip)
	return rt
}

func (n *Node) setPending(ctx context.Context, pod *corev1.Pod, cause error) {
	st := pod.Status.DeepCopy()
	st.Phase = corev1.PodPending
	setCondition(st, corev1.PodScheduled, corev1.ConditionTrue, "", "")
	setCondition(st, corev1.PodReady, corev1.ConditionFalse, "ContainersNotReady", cause.Error())
	n.writeStatus(ctx, pod, st)
}

func (n *Node) updateStatus(ctx context.Context, pod *corev1.Pod, rt *podRuntime) error {
	return n.writeStatus(ctx, pod, rt.status(pod))
}

func (n *Node) writeStatus(ctx context.Context, pod *corev1.Pod, st *corev1.PodStatus) error {
	if apiequality.Semantic.DeepEqual(&pod.Status, st) {
		return nil
	}
	p := pod.DeepCopy()
	p.Status = *st
	_, err := n.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("pod status %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

// notify asks the worker to publish a runtime change of pod key.
func (n *Node) notify(key string) { n.queue.Add(key) }

func setCondition(st *corev1.PodStatus, typ corev1.PodConditionType, status corev1.ConditionStatus, reason, msg string) {
	for i := range st.Conditions {
		c := &st.Conditions[i]
		if c.Type == typ {
			if c.Status != status {
				c.LastTransitionTime = metav1.Now()
			}
			c.Status, c.Reason, c.Message = status, reason, msg
			return
		}
	}
	st.Conditions = append(st.Conditions, corev1.PodCondition{Type: typ, Status: status, Reason: reason, Message: msg, LastTransitionTime: metav1.Now()})
}

// pvcDir is where a PVC's data lives. The UID keeps a re-created PVC of the
// same name from seeing its predecessor's files.
func (n *Node) pvcDir(pvc *corev1.PersistentVolumeClaim) string {
	return filepath.Join(n.opts.dir, "pvcs", pvc.Namespace+"_"+pvc.Name+"_"+string(pvc.UID))
}

// PVCDir returns the host directory backing a PVC.
func (n *Node) PVCDir(namespace, name string) (string, error) {
	if n.remote != nil {
		return n.remotePVCDir(namespace, name)
	}
	pvc, err := n.pvcs.PersistentVolumeClaims(namespace).Get(name)
	if err != nil {
		return "", err
	}
	return n.pvcDir(pvc), nil
}

func (n *Node) pvcDeleted(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	pvc, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok {
		return
	}
	if err := os.RemoveAll(n.pvcDir(pvc)); err != nil {
		n.log.Warn("remove pvc dir", "pvc", pvc.Name, "err", err)
	}
}

// Signal sends sig to the running process of a pod's container (for
// example SIGHUP, which makes DSH rotate its launch token).
func (n *Node) Signal(namespace, pod, container string, sig syscall.Signal) error {
	if n.remote != nil {
		return n.remoteSignal(namespace, pod, container, sig)
	}
	n.mu.Lock()
	rt := n.running[namespace+"/"+pod]
	n.mu.Unlock()
	if rt == nil {
		return fmt.Errorf("pod %s/%s is not running on %s", namespace, pod, n.Name)
	}
	return rt.signal(container, sig)
}

func (n *Node) pids() []int {
	n.mu.Lock()
	defer n.mu.Unlock()
	var pids []int
	for _, rt := range n.running {
		pids = append(pids, rt.pids()...)
	}
	return pids
}

// shutdown stops every pod process and the kubelet endpoint.
func (n *Node) shutdown() {
	n.mu.Lock()
	rts := make([]*podRuntime, 0, len(n.running))
	for _, rt := range n.running {
		rts = append(rts, rt)
	}
	n.running = map[string]*podRuntime{}
	n.mu.Unlock()
	var wg sync.WaitGroup
	for _, rt := range rts {
		wg.Add(1)
		go func() { defer wg.Done(); rt.stop(2 * time.Second) }()
	}
	wg.Wait()
	if n.kubelet != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = n.kubelet.Shutdown(ctx)
	}
}

// ipPool hands out loopback addresses 127.X.Y.Z, one per pod. X is random
// per cluster so that clusters of parallel test packages do not collide,
// and an address is only handed out after binding its port succeeded.
type ipPool struct {
	mu    sync.Mutex
	octet int
	used  map[string]bool
	next  int
}

func newIPPool() (*ipPool, error) {
	r, err := rand.Int(rand.Reader, big.NewInt(200))
	if err != nil {
		return nil, err
	}
	return &ipPool{octet: 20 + int(r.Int64()), used: map[string]bool{}}, nil
}

func (p *ipPool) acquire(port int) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for tries := 0; tries < 60000; tries++ {
		i := p.next
		p.next = (p.next + 1) % 60000
		ip := fmt.Sprintf("127.%d.%d.%d", p.octet, i/250, i%250+2)
		if p.used[ip] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
		if err != nil {
			continue
		}
		l.Close()
		p.used[ip] = true
		return ip, nil
	}
	return "", errors.New("no free loopback address")
}

func (p *ipPool) release(ip string) {
	p.mu.Lock()
	delete(p.used, ip)
	p.mu.Unlock()
}
