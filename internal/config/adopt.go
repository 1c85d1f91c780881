package config

// Adopt is the configuration of `lifecycle adopt`, the one-off migration of
// the seed gateway's claims: the worker's own Kubernetes settings and
// nothing else. It reaches no NATS and seals nothing, so it runs in the
// worker's container (kubectl exec) and in a Job that carries no NATS
// identity or handshake keys alike.
type Adopt = Kube

// LoadAdopt reads and validates what `lifecycle adopt` needs.
func LoadAdopt(e *Env) (Adopt, error) {
	c := loadKube(e)
	return c, e.Err()
}
