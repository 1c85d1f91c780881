package lifecycle

import (
	"context"
	"sync"
	"testing"
	"time"
)

// Two terms of pruning, running at once as they may for a moment when a
// lease is lost and won back, share nothing they write: under -race (as
// make test runs) a field both wrote fails this test. The fault suite
// found it in the binary: a lease stepped down and was won back within
// milliseconds, and the old term's pruner had not returned yet. (No pass
// runs: the interval is an hour, so the worker is never read.)
func TestPruningTermsShareNoState(t *testing.T) {
	p := &pruner{interval: time.Hour}
	ctx, cancel := context.WithCancel(t.Context())
	var terms sync.WaitGroup
	for range 2 {
		terms.Go(func() { p.run(ctx) })
	}
	cancel()
	terms.Wait()
}
