// Package sandbox is the gateway's access to Kubernetes: it creates and
// deletes SandboxClaims, switches Sandboxes between Running and Suspended,
// reads pod logs, and keeps label-selected informer caches of the claims
// this gateway manages and of the sandboxes and pods behind them.
package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	sandboxv1beta1 "sigs.k8s.io/agent-sandbox/api/v1beta1"
	sandboxclient "sigs.k8s.io/agent-sandbox/clients/k8s/clientset/versioned"
	extclient "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/clientset/versioned"
	extinformers "sigs.k8s.io/agent-sandbox/clients/k8s/extensions/informers/externalversions"
	sandboxinformers "sigs.k8s.io/agent-sandbox/clients/k8s/informers/externalversions"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/state"
)

// Annotations and labels the gateway writes on claims.
const (
	// PodUserLabel names the user on their sandbox's pod, so kubectl
	// finds it by the user: the claim asks for it (additionalPodMetadata)
	// and the agent-sandbox controller puts it on the pod, also on a
	// warm-pool spare as the claim adopts it. sandbox.users.io is the one
	// domain the controller admits by default (its allowed-label-domains).
	PodUserLabel = "sandbox.users.io/user"
	// TokenHashAnnotation holds the hex SHA-256 of the user's bearer token.
	TokenHashAnnotation = "aaas.example.com/token-sha256"
	// SuspendAnnotation, on a Sandbox, is the gateway's last suspend of
	// it: JSON of state.Suspension (when, why, in words). The mirror copies
	// it into the sandbox's record, so the user's pages can say why it
	// sleeps.
	SuspendAnnotation = "aaas.example.com/last-suspend"
	// ProfileAnnotation names the profile (PROFILES) a claim was made of;
	// a claim without it predates profiles and is of the default one.
	ProfileAnnotation = "aaas.example.com/profile"
	// UserLabel names the gateway user a claim belongs to (a named
	// sandbox's: its owner).
	UserLabel = "aaas.example.com/user"
	// RequestAnnotation, on a named sandbox's claim, is the id of the
	// request that made it: a redelivered create finds its own claim.
	RequestAnnotation = "aaas.example.com/request"
	// ClaimUIDLabel is set by agent-sandbox on a claimed sandbox; warm
	// spares lack it, so selecting on it skips the pool.
	ClaimUIDLabel = extv1beta1.SandboxIDLabel
	// podLabel is on every pod a Sandbox owns (and on nothing else). The
	// claim label is not propagated to pods, so pods join their claim
	// through the owning sandbox.
	podLabel    = "agents.x-k8s.io/sandbox-name-hash"
	claimPrefix = "dsh-"
	byClaimUID  = "claim-uid"
	byHalted    = "halted-revision"
	bySandbox   = "sandbox"
)

// Config says which claims are ours and how to reach DSH.
type Config struct {
	Namespace string
	// ManagedKey=ManagedValue marks the claims this gateway created; no
	// other claim is ever suspended or deleted.
	ManagedKey, ManagedValue string
	// Container is the DSH container (its log holds the launch token);
	// empty means the pod's first container.
	Container string
	Port      int
	// UseService addresses DSH by the sandbox's Service FQDN instead of
	// the pod IP.
	UseService bool
	// QPS and Burst rate-limit this client's API calls (a storm of
	// handshakes reads as many pod logs); CallTimeout bounds each call, so
	// a slow API server cannot park a worker.
	QPS         float32
	Burst       int
	CallTimeout time.Duration
	// LogLimitBytes caps a pod-log read: the tenant writes the log.
	LogLimitBytes int64
	Log           *slog.Logger
}

// Cluster is a namespace's claims, sandboxes and pods.
type Cluster struct {
	cfg     Config
	core    kubernetes.Interface
	sandbox sandboxclient.Interface
	ext     extclient.Interface

	claims    cache.SharedIndexInformer
	sandboxes cache.SharedIndexInformer
	pods      cache.SharedIndexInformer
	podLister corelisters.PodLister
	start     []func(<-chan struct{})
	// deniedAt is when a list or watch was last refused (unix nanos): an
	// informer that cannot watch goes stale without failing.
	deniedAt atomic.Int64
	// refusals counts those refusals.
	refusals atomic.Uint64
}

// deniedGrace is how long after a refused list or watch the caches count
// as unhealthy.
const deniedGrace = 30 * time.Second

// New builds clients and informers; Start runs them.
func New(rc *rest.Config, cfg Config) (*Cluster, error) {
	c := &Cluster{cfg: cfg}
	rc = rest.CopyConfig(rc)
	rc.QPS, rc.Burst = cfg.QPS, cfg.Burst
	var err error
	if c.core, err = kubernetes.NewForConfig(rc); err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	if c.sandbox, err = sandboxclient.NewForConfig(rc); err != nil {
		return nil, fmt.Errorf("agent-sandbox client: %w", err)
	}
	if c.ext, err = extclient.NewForConfig(rc); err != nil {
		return nil, fmt.Errorf("agent-sandbox extensions client: %w", err)
	}

	managed := func(o *metav1.ListOptions) { o.LabelSelector = cfg.ManagedKey + "=" + cfg.ManagedValue }
	claimed := func(o *metav1.ListOptions) { o.LabelSelector = ClaimUIDLabel }
	sandboxPods := func(o *metav1.ListOptions) { o.LabelSelector = podLabel }
	ef := extinformers.NewSharedInformerFactoryWithOptions(c.ext, 0, extinformers.WithNamespace(cfg.Namespace), extinformers.WithTweakListOptions(managed))
	sf := sandboxinformers.NewSharedInformerFactoryWithOptions(c.sandbox, 0, sandboxinformers.WithNamespace(cfg.Namespace), sandboxinformers.WithTweakListOptions(claimed))
	cf := informers.NewSharedInformerFactoryWithOptions(c.core, 0, informers.WithNamespace(cfg.Namespace), informers.WithTweakListOptions(sandboxPods))
	c.claims = ef.Extensions().V1beta1().SandboxClaims().Informer()
	c.sandboxes = sf.Agents().V1beta1().Sandboxes().Informer()
	podInf := cf.Core().V1().Pods()
	c.pods, c.podLister = podInf.Informer(), podInf.Lister()

	sandboxUID := cache.Indexers{byClaimUID: func(obj any) ([]string, error) {
		m, err := metaOf(obj)
		if err != nil {
			return nil, err
		}
		if uid := m.GetLabels()[ClaimUIDLabel]; uid != "" {
			return []string{uid}, nil
		}
		return nil, nil
	}, byHalted: func(obj any) ([]string, error) {
		m, err := metaOf(obj)
		if err != nil {
			return nil, err
		}
		if rev := m.GetAnnotations()[HaltedAnnotation]; rev != "" {
			return []string{rev}, nil
		}
		return nil, nil
	}}
	claimUID := cache.Indexers{byClaimUID: func(obj any) ([]string, error) {
		m, err := metaOf(obj)
		if err != nil {
			return nil, err
		}
		return []string{string(m.GetUID())}, nil
	}}
	podOwner := cache.Indexers{bySandbox: func(obj any) ([]string, error) {
		m, err := metaOf(obj)
		if err != nil {
			return nil, err
		}
		if o := metav1.GetControllerOf(m); o != nil && o.Kind == "Sandbox" {
			return []string{o.Name}, nil
		}
		return nil, nil
	}}
	for inf, idx := range map[cache.SharedIndexInformer]cache.Indexers{c.claims: claimUID, c.sandboxes: sandboxUID, c.pods: podOwner} {
		if err := inf.AddIndexers(idx); err != nil {
			return nil, fmt.Errorf("informer index: %w", err)
		}
		if err := inf.SetWatchErrorHandler(c.watchError); err != nil {
			return nil, fmt.Errorf("informer error handler: %w", err)
		}
	}
	c.start = []func(<-chan struct{}){ef.Start, sf.Start, cf.Start}
	return c, nil
}

func metaOf(obj any) (metav1.Object, error) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	m, ok := obj.(metav1.Object)
	if !ok {
		return nil, fmt.Errorf("unexpected object %T", obj)
	}
	return m, nil
}

// Start runs the informers until ctx ends and waits for their first sync.
func (c *Cluster) Start(ctx context.Context) error {
	for _, s := range c.start {
		s(ctx.Done())
	}
	if !cache.WaitForCacheSync(ctx.Done(), c.claims.HasSynced, c.sandboxes.HasSynced, c.pods.HasSynced) {
		return errors.New("kubernetes informers did not sync (check the lifecycle Role: claims, sandboxes and pods need list and watch)")
	}
	return nil
}

// Healthy reports whether all informers have synced and none was refused
// a list or watch recently.
func (c *Cluster) Healthy() bool {
	if time.Since(time.Unix(0, c.deniedAt.Load())) < deniedGrace {
		return false
	}
	return c.claims.HasSynced() && c.sandboxes.HasSynced() && c.pods.HasSynced()
}

// Serving reports whether the API server says it is ready (/readyz, which
// every identity may read): a fresh one refuses requests its authorizer
// has not loaded the rules for yet, and is not ready until it has.
func (c *Cluster) Serving(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, servingTimeout)
	defer cancel()
	_, err := c.core.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	return err == nil
}

// servingTimeout bounds the readiness check.
const servingTimeout = 5 * time.Second

// Refusals counts the lists and watches Kubernetes refused (forbidden or
// unauthorized) since New: the Role lacks a verb the informers need.
func (c *Cluster) Refusals() uint64 { return c.refusals.Load() }

func (c *Cluster) watchError(r *cache.Reflector, err error) {
	if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
		c.deniedAt.Store(time.Now().UnixNano())
		c.refusals.Add(1)
		c.cfg.Log.Error("kubernetes refused a list or watch: check the lifecycle Role", "informer", r.TypeDescription(), "err", err)
		return
	}
	cache.DefaultWatchErrorHandler(context.Background(), r, err)
}

// OnChange calls fn with the user affected by every change to a managed
// claim or to a sandbox or pod behind one.
func (c *Cluster) OnChange(fn func(user string)) error {
	claimHandler := func(obj any) {
		if m, err := metaOf(obj); err == nil {
			if u, ok := UserOf(m.GetName()); ok {
				fn(u)
			}
		}
	}
	byClaim := func(uid string) {
		if claim := c.claimByUID(uid); claim != nil {
			if u, ok := UserOf(claim.Name); ok {
				fn(u)
			}
		}
	}
	sandboxHandler := func(obj any) {
		if m, err := metaOf(obj); err == nil {
			byClaim(m.GetLabels()[ClaimUIDLabel])
		}
	}
	podHandler := func(obj any) {
		m, err := metaOf(obj)
		if err != nil {
			return
		}
		if o := metav1.GetControllerOf(m); o != nil && o.Kind == "Sandbox" {
			if sb, ok, _ := c.sandboxes.GetIndexer().GetByKey(c.cfg.Namespace + "/" + o.Name); ok {
				byClaim(sb.(*sandboxv1beta1.Sandbox).Labels[ClaimUIDLabel])
			}
		}
	}
	for inf, h := range map[cache.SharedIndexInformer]func(any){c.claims: claimHandler, c.sandboxes: sandboxHandler, c.pods: podHandler} {
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: h, UpdateFunc: func(_, o any) { h(o) }, DeleteFunc: h,
		}); err != nil {
			return fmt.Errorf("event handler: %w", err)
		}
	}
	return nil
}

// ClaimName is dsh-<key>: an account's first sandbox's is dsh-<user>, a
// named sandbox's dsh-<user>--<name> (ident.SandboxKey).
func ClaimName(key string) string { return claimPrefix + key }

// UserOf is the inverse of ClaimName.
func UserOf(claim string) (string, bool) {
	u, ok := strings.CutPrefix(claim, claimPrefix)
	return u, ok && u != ""
}

// Managed reports whether a claim carries this gateway's label.
func (c *Cluster) Managed(claim *extv1beta1.SandboxClaim) bool {
	return claim != nil && claim.Labels[c.cfg.ManagedKey] == c.cfg.ManagedValue
}

func (c *Cluster) claimByUID(uid string) *extv1beta1.SandboxClaim {
	if uid == "" {
		return nil
	}
	objs, _ := c.claims.GetIndexer().ByIndex(byClaimUID, uid)
	if len(objs) == 0 {
		return nil
	}
	return objs[0].(*extv1beta1.SandboxClaim)
}

// State is a user's objects as the caches see them; any may be nil.
type State struct {
	Claim   *extv1beta1.SandboxClaim
	Sandbox *sandboxv1beta1.Sandbox
	Pod     *corev1.Pod
}

// Lookup returns the cached state of user's managed claim.
func (c *Cluster) Lookup(user string) State {
	var s State
	obj, ok, _ := c.claims.GetIndexer().GetByKey(c.cfg.Namespace + "/" + ClaimName(user))
	if !ok {
		return s
	}
	s.Claim = obj.(*extv1beta1.SandboxClaim)
	uid := string(s.Claim.UID)
	sbs, _ := c.sandboxes.GetIndexer().ByIndex(byClaimUID, uid)
	for _, o := range sbs {
		sb := o.(*sandboxv1beta1.Sandbox)
		if s.Sandbox == nil || sb.Name == s.Claim.Status.SandboxStatus.Name {
			s.Sandbox = sb
		}
	}
	if s.Sandbox == nil {
		return s
	}
	podName := s.Sandbox.Annotations[sandboxv1beta1.SandboxPodNameAnnotation]
	if podName == "" {
		podName = s.Sandbox.Name
	}
	if pod, err := c.podLister.Pods(c.cfg.Namespace).Get(podName); err == nil {
		if o := metav1.GetControllerOf(pod); o != nil && o.UID == s.Sandbox.UID {
			s.Pod = pod
		}
	}
	return s
}

// Spares counts the warm pool's ready pods: sandbox pods whose sandbox no
// claim has taken (the sandbox informer holds only claimed ones).
func (c *Cluster) Spares() int {
	n := 0
	for _, obj := range c.pods.GetIndexer().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.DeletionTimestamp != nil {
			continue
		}
		o := metav1.GetControllerOf(pod)
		if o == nil || o.Kind != "Sandbox" {
			continue
		}
		if _, claimed, _ := c.sandboxes.GetIndexer().GetByKey(pod.Namespace + "/" + o.Name); claimed {
			continue
		}
		for _, cond := range pod.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				n++
			}
		}
	}
	return n
}

// Users lists the users of every cached managed claim.
func (c *Cluster) Users() []string {
	var users []string
	for _, o := range c.claims.GetStore().List() {
		if u, ok := UserOf(o.(*extv1beta1.SandboxClaim).Name); ok {
			users = append(users, u)
		}
	}
	return users
}

// CreateClaim creates dsh-<user> from profile's warm pool, labelled as
// ours and annotated with the token hash and the profile.
func (c *Cluster) CreateClaim(ctx context.Context, user, tokenHash, profile, pool string) (*extv1beta1.SandboxClaim, error) {
	return c.createClaim(ctx, user, user, map[string]string{TokenHashAnnotation: tokenHash, ProfileAnnotation: profile}, pool)
}

// CreateNamedClaim creates dsh-<key> for owner's named sandbox of key,
// made by request, of profile, from warm pool pool. It carries no token
// hash: the account lives on its first claim.
func (c *Cluster) CreateNamedClaim(ctx context.Context, key, owner, request, profile, pool string) (*extv1beta1.SandboxClaim, error) {
	return c.createClaim(ctx, key, owner, map[string]string{RequestAnnotation: request, ProfileAnnotation: profile}, pool)
}

func (c *Cluster) createClaim(ctx context.Context, key, owner string, annotations map[string]string, pool string) (*extv1beta1.SandboxClaim, error) {
	claim := &extv1beta1.SandboxClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name:        ClaimName(key),
			Namespace:   c.cfg.Namespace,
			Labels:      map[string]string{c.cfg.ManagedKey: c.cfg.ManagedValue, UserLabel: owner},
			Annotations: annotations,
		},
		Spec: extv1beta1.SandboxClaimSpec{WarmPoolRef: extv1beta1.SandboxWarmPoolRef{Name: pool},
			AdditionalPodMetadata: sandboxv1beta1.PodMetadata{Labels: map[string]string{PodUserLabel: owner}}},
	}
	ctx, cancel := c.call(ctx)
	defer cancel()
	out, err := c.ext.ExtensionsV1beta1().SandboxClaims(c.cfg.Namespace).Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create claim %s: %w", claim.Name, err)
	}
	return out, nil
}

// GetClaim reads dsh-<user> from the API server (not the cache): decisions
// about ownership must not rest on a stale view.
func (c *Cluster) GetClaim(ctx context.Context, user string) (*extv1beta1.SandboxClaim, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	claim, err := c.ext.ExtensionsV1beta1().SandboxClaims(c.cfg.Namespace).Get(ctx, ClaimName(user), metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get claim %s: %w", ClaimName(user), err)
	}
	return claim, nil
}

// GetSandbox reads a sandbox from the API server (not the cache), for
// when the sandbox and pod caches disagree about what happened.
func (c *Cluster) GetSandbox(ctx context.Context, name string) (*sandboxv1beta1.Sandbox, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	sb, err := c.sandbox.AgentsV1beta1().Sandboxes(c.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get sandbox %s: %w", name, err)
	}
	return sb, nil
}

// DeleteClaim deletes a claim we manage; the garbage collector removes its
// sandbox, pod and volume. Foreground keeps the claim visible until they
// are gone, for callers that must wait for that. uid guards against
// deleting a newer claim of the same name.
func (c *Cluster) DeleteClaim(ctx context.Context, user string, uid types.UID, foreground bool) error {
	policy := metav1.DeletePropagationBackground
	if foreground {
		policy = metav1.DeletePropagationForeground
	}
	ctx, cancel := c.call(ctx)
	defer cancel()
	err := c.ext.ExtensionsV1beta1().SandboxClaims(c.cfg.Namespace).Delete(ctx, ClaimName(user), metav1.DeleteOptions{
		PropagationPolicy: &policy, Preconditions: &metav1.Preconditions{UID: &uid},
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete claim %s: %w", ClaimName(user), err)
	}
	return nil
}

// DeletePod deletes a sandbox's pod (that pod, by UID, not a newer one of
// the same name), so the agent-sandbox controller makes a new one on the
// same volume.
func (c *Cluster) DeletePod(ctx context.Context, pod *corev1.Pod) error {
	ctx, cancel := c.call(ctx)
	defer cancel()
	err := c.core.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pod.UID}})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete pod %s: %w", pod.Name, err)
	}
	return nil
}

// PodEnded reports whether pod has ended for good (Failed, evicted, or
// Succeeded): the kubelet never runs it again, and agent-sandbox v0.5.6
// leaves it so; only deleting it brings the sandbox back.
func PodEnded(pod *corev1.Pod) bool {
	return pod != nil && pod.DeletionTimestamp == nil && (pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded)
}

// failingWaits are the reasons a container waits for that it will not get
// over by itself: its image cannot be had, its configuration is wrong, or
// it keeps exiting.
var failingWaits = map[string]bool{
	"ErrImagePull": true, "ImagePullBackOff": true, "InvalidImageName": true,
	"CreateContainerConfigError": true, "CreateContainerError": true, "RunContainerError": true,
	"CrashLoopBackOff": true,
}

// PodFailing says why pod, while the kubelet still runs it, is failing
// (a container restarted, or waits on one of failingWaits), or "" when it
// is not. Such a pod never ends (its restart policy is Always): only a
// rollout's probation makes it a reason to act (lifecycle's rollBack).
func PodFailing(pod *corev1.Pod) string {
	if pod == nil || pod.DeletionTimestamp != nil {
		return ""
	}
	for _, list := range [][]corev1.ContainerStatus{pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses} {
		for _, cs := range list {
			switch w := cs.State.Waiting; {
			case w != nil && failingWaits[w.Reason]:
				return "container " + cs.Name + " " + w.Reason
			case cs.RestartCount > 0:
				why := "container " + cs.Name + " restarted"
				if t := cs.LastTerminationState.Terminated; t != nil {
					why += fmt.Sprintf(" (exit %d, %s)", t.ExitCode, t.Reason)
				}
				return why
			}
		}
	}
	return ""
}

// SetTokenHash puts the hash of user's new bearer token on their claim,
// where the account lives (a NATS loss rebuilds the record from it).
func (c *Cluster) SetTokenHash(ctx context.Context, user, hash string) error {
	ctx, cancel := c.call(ctx)
	defer cancel()
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{TokenHashAnnotation: hash}}})
	if err != nil {
		return err
	}
	_, err = c.ext.ExtensionsV1beta1().SandboxClaims(c.cfg.Namespace).Patch(ctx, ClaimName(user), types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// Resume sets a suspended sandbox Running and reports whether it was
// suspended. The patch tests the mode the API server has, not the cache's
// (which may lag a suspend, or a wake of a moment ago): of two wakes
// racing, or one edge's wakes of two revisions of one sleep, exactly one
// changes it, and so is audited.
func (c *Cluster) Resume(ctx context.Context, sandbox string) (bool, error) {
	patch, err := json.Marshal([]map[string]any{
		{"op": "test", "path": "/spec/operatingMode", "value": sandboxv1beta1.SandboxOperatingModeSuspended},
		{"op": "replace", "path": "/spec/operatingMode", "value": sandboxv1beta1.SandboxOperatingModeRunning},
	})
	if err != nil {
		return false, err
	}
	ctx, cancel := c.call(ctx)
	defer cancel()
	_, err = c.sandbox.AgentsV1beta1().Sandboxes(c.cfg.Namespace).Patch(ctx, sandbox, types.JSONPatchType, patch, metav1.PatchOptions{})
	switch {
	case apierrors.IsInvalid(err):
		return false, nil // not suspended: running already
	case err != nil:
		return false, fmt.Errorf("resume sandbox %s: %w", sandbox, err)
	}
	return true, nil
}

// Suspend sets a sandbox Suspended and records why on it
// (SuspendAnnotation), in one patch.
func (c *Cluster) Suspend(ctx context.Context, sandbox string, why state.Suspension) error {
	note, err := json.Marshal(why)
	if err != nil {
		return err
	}
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"annotations": map[string]string{SuspendAnnotation: string(note)}},
		"spec":     map[string]any{"operatingMode": sandboxv1beta1.SandboxOperatingModeSuspended},
	})
	if err != nil {
		return err
	}
	ctx, cancel := c.call(ctx)
	defer cancel()
	if _, err := c.sandbox.AgentsV1beta1().Sandboxes(c.cfg.Namespace).Patch(ctx, sandbox, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("suspend sandbox %s: %w", sandbox, err)
	}
	return nil
}

// LogTail reads the last lines of the DSH container's log through the API
// server (pods/log).
func (c *Cluster) LogTail(ctx context.Context, pod *corev1.Pod, lines int) ([]byte, error) {
	container := c.cfg.Container
	if container == "" && len(pod.Spec.Containers) > 0 {
		container = pod.Spec.Containers[0].Name
	}
	n, limit := int64(lines), c.cfg.LogLimitBytes
	ctx, cancel := c.call(ctx)
	defer cancel()
	b, err := c.core.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: container, TailLines: &n, LimitBytes: &limit}).DoRaw(ctx)
	if apierrors.IsForbidden(err) {
		return nil, fmt.Errorf("read log of %s/%s: forbidden (the Role needs get on pods/log): %w", pod.Name, container, err)
	}
	if err != nil {
		return nil, fmt.Errorf("read log of %s/%s: %w", pod.Name, container, err)
	}
	return b, nil
}

// ClaimGone reports whether the cache has no claim for user with uid.
func (c *Cluster) ClaimGone(user string, uid types.UID) bool {
	obj, ok, _ := c.claims.GetIndexer().GetByKey(c.cfg.Namespace + "/" + ClaimName(user))
	return !ok || obj.(*extv1beta1.SandboxClaim).UID != uid
}

// SandboxGone reports whether neither the sandbox nor any pod it owned is
// cached any more.
func (c *Cluster) SandboxGone(name string) bool {
	_, ok, _ := c.sandboxes.GetIndexer().GetByKey(c.cfg.Namespace + "/" + name)
	pods, _ := c.pods.GetIndexer().ByIndex(bySandbox, name)
	return !ok && len(pods) == 0
}

// call bounds one API call by CallTimeout.
func (c *Cluster) call(ctx context.Context) (context.Context, context.CancelFunc) {
	if c.cfg.CallTimeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.cfg.CallTimeout)
}
