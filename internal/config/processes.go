package config

// Edge is the configuration of cmd/edge.
type Edge struct {
	Common
}

// LoadEdge reads and validates the edge's variables.
func LoadEdge(e *Env) (Edge, error) {
	c := Edge{Common: LoadCommon(e, ":9090")}
	return c, e.Err()
}

// Lifecycle is the configuration of cmd/lifecycle.
type Lifecycle struct {
	Common
}

// LoadLifecycle reads and validates the lifecycle worker's variables.
func LoadLifecycle(e *Env) (Lifecycle, error) {
	c := Lifecycle{Common: LoadCommon(e, ":9091")}
	return c, e.Err()
}

// Sweeper is the configuration of cmd/sweeper.
type Sweeper struct {
	Common
}

// LoadSweeper reads and validates the sweeper's variables.
func LoadSweeper(e *Env) (Sweeper, error) {
	c := Sweeper{Common: LoadCommon(e, ":9092")}
	return c, e.Err()
}
