package testenv

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/aaas-project/aaas/internal/dev/embednats"
)

// Every flow runs under the production NATS permissions: the server that
// refuses a process a subject its identity is not granted
// (internal/natsauth) says so in its log ("Publish Violation", naming the
// connection), and the test that ran the server fails. The server, not
// the process, is the witness: a process need not notice, log or survive
// the refusal for the test to learn of it.

// violationLine matches the server's log of a refused publish or
// subscription; cid is the connection's id on that server.
var violationLine = regexp.MustCompile(`cid:(\d+) .*(Publish|Subscription) Violation`)

// natsWitness is an embedded server's logger that keeps its permission
// violations, each with the name of the connection that committed it
// (process kind and INSTANCE_ID: natsconn names every connection so).
type natsWitness struct {
	s  *embednats.Server
	wg sync.WaitGroup
	mu sync.Mutex
	// seen are the violation lines in order; names maps a connection id
	// to its name, looked up as each line arrives (a reconnected client's
	// lines carry only the id).
	seen  []string
	names map[uint64]string
	// done stops lookups once the report is being made.
	done bool
}

// WatchNATS fails t, when it ends, if s refused any client a subject.
// NewStack watches its server; a test running its own server watches it
// with this.
func WatchNATS(t testing.TB, s *embednats.Server) {
	w := &natsWitness{s: s, names: map[uint64]string{}}
	s.SetLoggerV2(w, false, false, false)
	t.Cleanup(func() {
		if v := w.report(); v != "" {
			t.Errorf("the NATS server refused subjects their identity is not granted (internal/natsauth):\n%s", v)
		}
	})
}

func (w *natsWitness) Errorf(format string, v ...any) {
	line := fmt.Sprintf(format, v...)
	m := violationLine.FindStringSubmatch(line)
	if m == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seen = append(w.seen, line)
	cid, _ := strconv.ParseUint(m[1], 10, 64)
	if _, ok := w.names[cid]; ok || w.done {
		return
	}
	w.names[cid] = ""
	// The server calls its logger holding the client's lock, which its
	// monitoring takes too: look the connection up from elsewhere.
	w.wg.Go(func() {
		name := "(gone)"
		if c, err := w.s.Connz(&server.ConnzOptions{CID: cid, Username: true}); err == nil && len(c.Conns) == 1 {
			name = fmt.Sprintf("%q as %s", c.Conns[0].Name, c.Conns[0].AuthorizedUser)
		}
		w.mu.Lock()
		w.names[cid] = name
		w.mu.Unlock()
	})
}

// report is every violation seen, each with its connection.
func (w *natsWitness) report() string {
	w.mu.Lock()
	w.done = true
	w.mu.Unlock()
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, l := range w.seen {
		cid, _ := strconv.ParseUint(violationLine.FindStringSubmatch(l)[1], 10, 64)
		out = append(out, fmt.Sprintf("%s (connection %d: %s)", l, cid, w.names[cid]))
	}
	return strings.Join(out, "\n")
}

func (*natsWitness) Noticef(string, ...any) {}
func (*natsWitness) Warnf(string, ...any)   {}
func (*natsWitness) Fatalf(string, ...any)  {}
func (*natsWitness) Debugf(string, ...any)  {}
func (*natsWitness) Tracef(string, ...any)  {}

// serverViolations are the permission violations in a nats-server
// process's log (NATSCluster's nodes).
func serverViolations(log string) string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		if violationLine.MatchString(l) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
