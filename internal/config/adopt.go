package config

import "time"

// Adopt is the configuration of `lifecycle adopt`, the one-off migration of
// the seed gateway's claims. It reads the worker's own Kubernetes
// variables, with the same defaults and checks, and nothing else: it
// reaches no NATS and seals nothing, so it runs in the worker's container
// (kubectl exec) and in a Job that carries no NATS identity or handshake
// keys alike.
type Adopt struct {
	// Kubeconfig, Namespace, ManagedKey and ManagedValue are as in
	// Lifecycle: the claims adopted are the ones the worker will manage.
	Kubeconfig               string
	Namespace                string
	ManagedKey, ManagedValue string
	// KubeQPS, KubeBurst and KubeCallTimeout are as in Lifecycle.
	KubeQPS         float32
	KubeBurst       int
	KubeCallTimeout time.Duration
}

// LoadAdopt reads and validates what `lifecycle adopt` needs.
func LoadAdopt(e *Env) (Adopt, error) {
	c := Adopt{
		Kubeconfig:      e.String("KUBECONFIG", ""),
		Namespace:       e.String("NAMESPACE", "dsh-demo"),
		KubeQPS:         float32(e.Int("KUBE_API_QPS", 50, 1, 10_000)),
		KubeBurst:       e.Int("KUBE_API_BURST", 100, 1, 20_000),
		KubeCallTimeout: e.Duration("KUBE_API_TIMEOUT", 30*time.Second, time.Second, 10*time.Minute),
	}
	c.ManagedKey, c.ManagedValue = managedLabel(e)
	if !dns1123.MatchString(c.Namespace) {
		e.Fail("NAMESPACE", "%q is not a valid namespace name", c.Namespace)
	}
	return c, e.Err()
}
