//go:build race

package proxy

// raceEnabled: the race detector changes what allocates (sync.Pool drops
// some of what it is given), so allocation budgets are checked without it
// (make test runs them separately).
const raceEnabled = true
