package lifecycle_test

import (
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	extv1beta1 "sigs.k8s.io/agent-sandbox/extensions/api/v1beta1"

	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// BenchmarkWakeOverhead measures how long after a woken pod turns Ready
// the sandboxes bucket says Ready: the cost of lifecycle's mirror (watch
// event, derive, KV write, KV watch). Run with -benchtime=50x.
func BenchmarkWakeOverhead(b *testing.B) {
	f := setup(b, nil)
	f.lifecycle("lc-a")
	f.signup("wb")
	pods, err := pkg.Cluster.Client.CoreV1().Pods(f.NS.Name).Watch(ctx(b), metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer pods.Stop()
	var mu sync.Mutex
	readyAt := map[string]time.Time{} // pod UID -> when we saw it Ready
	go func() {
		for ev := range pods.ResultChan() {
			pod, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			for _, c := range pod.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					mu.Lock()
					if _, seen := readyAt[string(pod.UID)]; !seen {
						readyAt[string(pod.UID)] = time.Now()
					}
					mu.Unlock()
				}
			}
		}
	}()

	var overheads []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		box, _ := f.boxes.Get("wb")
		f.command(events.NewSuspend("wb", f.lastActivitySeq("wb"), box.Revision, time.Now(), "idle", ""))
		f.waitPhase("wb", state.PhaseSuspended)
		e, _ := f.boxes.Get("wb")
		b.StartTimer()
		f.command(events.NewWake("wb", e.Revision))
		ready := f.waitPhase("wb", state.PhaseReady)
		kvAt := time.Now()
		b.StopTimer()
		// The benchmark's pod watch and lifecycle's informer are separate
		// streams: ours may deliver the Ready pod after KV already said so,
		// which makes that sample's overhead negative rather than missing.
		var podAt time.Time
		testutil.Eventually(b, 10*time.Second, func() error {
			mu.Lock()
			defer mu.Unlock()
			var ok bool
			if podAt, ok = readyAt[ready.PodUID]; !ok {
				return fmt.Errorf("pod %s not seen Ready by the benchmark's watch", ready.PodUID)
			}
			return nil
		})
		overheads = append(overheads, kvAt.Sub(podAt))
		b.StartTimer()
	}
	b.StopTimer()
	sort.Slice(overheads, func(i, j int) bool { return overheads[i] < overheads[j] })
	pct := func(p float64) float64 {
		return float64(overheads[int(p*float64(len(overheads)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(0.5), "overhead-p50-ms")
	b.ReportMetric(pct(0.99), "overhead-p99-ms")
}

// BenchmarkClaimsFromWarmPool measures signups per second while the warm
// pool has a spare for each: claim command to Ready in KV, 10 at a time.
func BenchmarkClaimsFromWarmPool(b *testing.B) {
	const batch = 10
	f := setup(b, func(_ *extv1beta1.SandboxTemplate, pool *extv1beta1.SandboxWarmPool) {
		n := int32(batch)
		pool.Spec.Replicas = &n
	})
	f.lifecycle("lc-a")
	f.lifecycle("lc-b")
	_, ext, _ := pkg.Cluster.SandboxClients()
	var total time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		// Wait for a full pool: we measure adoption, not cold starts.
		for {
			p, err := ext.ExtensionsV1beta1().SandboxWarmPools(f.NS.Name).Get(ctx(b), "dsh-pool", metav1.GetOptions{})
			if err == nil && p.Status.ReadyReplicas >= batch {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		b.StartTimer()
		start := time.Now()
		var wg sync.WaitGroup
		for j := 0; j < batch; j++ {
			user := fmt.Sprintf("c%d-%d", i, j)
			wg.Add(1)
			go func() {
				defer wg.Done()
				hash := tokenHash()
				if _, err := f.pub.Command(ctx(b), events.NewClaim(user, "req-"+user, hash, "")); err != nil {
					b.Error(err)
				}
			}()
		}
		wg.Wait()
		for j := 0; j < batch; j++ {
			f.waitPhase(fmt.Sprintf("c%d-%d", i, j), state.PhaseReady)
		}
		total += time.Since(start)
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N*batch)/total.Seconds(), "claims/s")
}
