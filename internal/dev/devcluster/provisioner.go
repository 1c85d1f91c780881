package devcluster

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// StorageClass is the real node's default StorageClass.
const StorageClass = "devcluster-local"

const (
	provisionerName = "devcluster.aaas.dev/local"
	// annProvisionedBy marks the PersistentVolumes this provisioner made
	// (the same annotation external provisioners set).
	annProvisionedBy = "pv.kubernetes.io/provisioned-by"
)

// The provisioner is a minimal external provisioner, as local-path
// provisioners are: each claim of the default class gets a directory and a
// `local` PersistentVolume pinned to the node, pre-bound to the claim (the
// controller manager's binder completes the binding); a Released volume's
// directory and object are deleted. A `local` volume, unlike hostPath, gets
// the pod's fsGroup applied by the kubelet, as a cloud disk would: the
// sandboxes and NATS run as non-root users. The directory is created 0777
// so that it works for pods without an fsGroup too.
type provisioner struct {
	client kubernetes.Interface
	node   string
	dir    string
	log    *slog.Logger
	queue  workqueue.TypedRateLimitingInterface[string]
	pvcs   cache.Indexer
	pvs    cache.Indexer
}

func startProvisioner(ctx context.Context, client kubernetes.Interface, node, dir string, log *slog.Logger) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	p := &provisioner{client: client, node: node, dir: dir, log: log.With("component", "provisioner"),
		queue: newRetryQueue()}
	factory := informers.NewSharedInformerFactory(client, 0)
	pvcInf := factory.Core().V1().PersistentVolumeClaims().Informer()
	pvInf := factory.Core().V1().PersistentVolumes().Informer()
	p.pvcs, p.pvs = pvcInf.GetIndexer(), pvInf.GetIndexer()
	enqueue := func(prefix string) cache.ResourceEventHandlerFuncs {
		add := func(obj any) {
			if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
				p.queue.Add(prefix + key)
			}
		}
		return cache.ResourceEventHandlerFuncs{AddFunc: add, UpdateFunc: func(_, obj any) { add(obj) }}
	}
	if _, err := pvcInf.AddEventHandler(enqueue("pvc/")); err != nil {
		return err
	}
	if _, err := pvInf.AddEventHandler(enqueue("pv/")); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("provisioner: %v informer did not sync", typ)
		}
	}
	go func() { <-ctx.Done(); p.queue.ShutDown() }()
	go func() {
		for {
			key, quit := p.queue.Get()
			if quit {
				return
			}
			if err := p.sync(ctx, key); err != nil && ctx.Err() == nil {
				p.log.Debug("provisioner retrying", "key", key, "err", err)
				p.queue.AddRateLimited(key)
			} else {
				p.queue.Forget(key)
			}
			p.queue.Done(key)
		}
	}()
	return nil
}

func (p *provisioner) sync(ctx context.Context, key string) error {
	if k, ok := strings.CutPrefix(key, "pvc/"); ok {
		obj, exists, err := p.pvcs.GetByKey(k)
		if err != nil || !exists {
			return err
		}
		return p.provision(ctx, obj.(*corev1.PersistentVolumeClaim))
	}
	k, _ := strings.CutPrefix(key, "pv/")
	obj, exists, err := p.pvs.GetByKey(k)
	if err != nil || !exists {
		return err
	}
	return p.reclaim(ctx, obj.(*corev1.PersistentVolume))
}

func (p *provisioner) provision(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	if pvc.Spec.VolumeName != "" || pvc.DeletionTimestamp != nil || pvc.Annotations["volume.kubernetes.io/storage-provisioner"] != provisionerName {
		return nil
	}
	name := "pvc-" + string(pvc.UID)
	path := filepath.Join(p.dir, name)
	if err := os.MkdirAll(path, 0o777); err != nil {
		return err
	}
	if err := os.Chmod(path, 0o777); err != nil { // MkdirAll honours the umask
		return err
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{annProvisionedBy: provisionerName}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: pvc.Spec.Resources.Requests[corev1.ResourceStorage]},
			AccessModes:                   pvc.Spec.AccessModes,
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              StorageClass,
			VolumeMode:                    pvc.Spec.VolumeMode,
			ClaimRef: &corev1.ObjectReference{
				Kind: "PersistentVolumeClaim", APIVersion: "v1",
				Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID,
			},
			PersistentVolumeSource: corev1.PersistentVolumeSource{Local: &corev1.LocalVolumeSource{Path: path}},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "kubernetes.io/hostname", Operator: corev1.NodeSelectorOpIn, Values: []string{p.node}}},
			}}}},
		},
	}
	if _, err := p.client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create %s: %w", name, err)
	}
	return nil
}

func (p *provisioner) reclaim(ctx context.Context, pv *corev1.PersistentVolume) error {
	if pv.Annotations[annProvisionedBy] != provisionerName || pv.Status.Phase != corev1.VolumeReleased ||
		pv.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete || pv.Spec.Local == nil ||
		filepath.Dir(pv.Spec.Local.Path) != p.dir {
		return nil
	}
	if err := os.RemoveAll(pv.Spec.Local.Path); err != nil {
		return err
	}
	err := p.client.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pv.UID}})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete %s: %w", pv.Name, err)
	}
	return nil
}
