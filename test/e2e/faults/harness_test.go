// Package faults runs the whole system under steady traffic and breaks
// it the ways operators see it break: rolling restarts, NATS nodes
// killed, an edge cut off from NATS, lifecycle killed mid-command, the API
// server restarted, the sweeper failing over. Each scenario logs a table of
// figures (go test -v; docs/RELIABILITY.md holds a full run's) and fails
// on any loss the design promises not to have.
package faults

import (
	"fmt"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/testenv"
	"github.com/aaas-project/aaas/internal/dev/testutil"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

var pkg testenv.Package

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &pkg)) }

// size is a scenario's scale: small in `make test`, FAULTS_SCALE=full
// (make reliability) for the figures in docs/RELIABILITY.md.
func size(ci, full int) int {
	if os.Getenv("FAULTS_SCALE") == "full" {
		return full
	}
	return ci
}

// system is the production shape on one machine: a 3-node NATS cluster
// (R3 streams and buckets) with a fault proxy between every process and
// every node, two lifecycle workers, three edges behind the pooling nginx
// front, two sweepers, and signed-in users.
type system struct {
	*testenv.Stack
	t          *testing.T
	front      *testenv.Front
	edges      []*testenv.Edge
	lifecycles []*testenv.Proc
	sweepers   []*testenv.Proc
	// users are signed in through the front, by name.
	users map[string]*testenv.Client
}

type systemOptions struct {
	users int
	env   map[string]string
	// noSweepers leaves the sweepers out (their suspends would interfere;
	// startSweepers starts them later).
	noSweepers bool
	// edgeEnv adds to the environment of the edge with that INSTANCE_ID.
	edgeEnv map[string]map[string]string
	// pkg is the control plane to run on (nil: the package's, which may be
	// shared with other packages' tests).
	pkg *testenv.Package
}

func newSystem(t *testing.T, o systemOptions) *system {
	// Every user signs up from this one address, through the front.
	env := map[string]string{"SWEEP_INTERVAL": "1s", "IDLE_TIMEOUT": "1h", "WAKE_TIMEOUT": "60s", "AUTH_RATE_LIMIT": "10000"}
	for k, v := range o.env {
		env[k] = v
	}
	p := o.pkg
	if p == nil {
		p = &pkg
	}
	st := p.NewStack(t, testenv.StackOptions{NATSNodes: 3, Faults: true, Env: env})
	s := &system{Stack: st, t: t, users: map[string]*testenv.Client{}}
	addr := st.FrontAddr()
	for _, id := range []string{"lc-a", "lc-b"} {
		s.lifecycles = append(s.lifecycles, st.Lifecycle(id))
	}
	var backends []string
	for _, id := range []string{"edge-a", "edge-b", "edge-c"} {
		e := st.Edge(id, o.edgeEnv[id])
		s.edges = append(s.edges, e)
		backends = append(backends, strings.TrimPrefix(e.URL, "http://"))
	}
	s.front = testenv.NewFrontAt(t, addr, backends...)
	if !o.noSweepers {
		s.startSweepers()
	}
	s.signup(userNames("u", o.users)...)
	return s
}

// startSweepers starts the two sweepers.
func (s *system) startSweepers() {
	for _, id := range []string{"sw-a", "sw-b"} {
		s.sweepers = append(s.sweepers, s.Sweeper(id, nil))
	}
}

func userNames(prefix string, n int) []string {
	var names []string
	for i := range n {
		names = append(names, fmt.Sprintf("%s%d", prefix, i))
	}
	return names
}

// signup signs users up through the front, concurrently, and waits until
// every sandbox is Ready.
func (s *system) signup(names ...string) {
	s.t.Helper()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, u := range names {
		c := testenv.NewClient(s.t, s.front.URL())
		wg.Go(func() {
			c.Signup(u, "")
			mu.Lock()
			s.users[u] = c
			mu.Unlock()
		})
	}
	wg.Wait()
	for _, u := range names {
		s.waitPhase(u, state.PhaseReady, 3*time.Minute)
	}
}

func (s *system) waitPhase(user string, phase state.Phase, within time.Duration) {
	s.t.Helper()
	ctx := testenv.Context(s.t, within)
	if _, _, err := s.Sandboxes().Wait(ctx, user, func(e kv.Entry[state.Sandbox], ok bool) bool { return ok && e.Value.Phase == phase }); err != nil {
		s.t.Fatalf("%s not %s within %s: %+v", user, phase, within, s.Box(user))
	}
}

// load starts traffic through the front from o.Users, or every
// signed-in user.
func (s *system) load(o testenv.LoadOptions) *testenv.Load {
	if o.Users == nil {
		o.Users = s.users
	}
	return testenv.StartLoad(s.t, s.front.URL(), o)
}

// sessionsLost counts users whose session cookie no longer gets them
// their sandbox through the front: one refusal of the cookie (401) is a
// lost session, whichever edge answered; any other failure (a sandbox
// still waking) is asked again for up to 30 s before it counts.
func (s *system) sessionsLost() int {
	lost := 0
	for u, c := range s.users {
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
			r := c.Do(http.MethodGet, "/u/"+u+"/api/files", nil, "Accept", "application/json")
			if r.StatusCode == http.StatusOK {
				break
			}
			s.t.Logf("session of %s: %d %.200s", u, r.StatusCode, r.Body)
			if r.StatusCode == http.StatusUnauthorized || time.Now().After(deadline) {
				lost++
				break
			}
		}
	}
	return lost
}

// metric is the sum of p's samples of metric name with labels (name,
// value pairs); 0 while p serves no metrics (killed, restarting).
func (s *system) metric(p *testenv.Proc, name string, labels ...string) float64 {
	v, err := p.MetricSum(name, labels...)
	if err != nil {
		return 0
	}
	return v
}

// handled counts the commands the lifecycle workers finished, by
// outcome, from their metrics (a worker's count restarts with it).
func (s *system) handled() map[string]int {
	out := map[string]int{}
	for _, p := range s.lifecycles {
		m, err := p.Metric("aaas_lifecycle_command_duration_seconds_count")
		if err != nil {
			continue
		}
		for _, l := range strings.Split(m, "\n") {
			series, v, _ := strings.Cut(l, " ")
			_, labels, _ := strings.Cut(series, "outcome=\"")
			outcome, _, _ := strings.Cut(labels, "\"")
			n, _ := strconv.ParseFloat(v, 64)
			out[outcome] += int(n)
		}
	}
	return out
}

// report logs a scenario's table.
func report(t *testing.T, title string, rows ...[][2]string) {
	var all [][2]string
	for _, r := range rows {
		all = append(all, r...)
	}
	t.Log(testenv.Table(title, all))
}

func row(name string, v any) [2]string { return [2]string{name, fmt.Sprint(v)} }

func seconds(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + " s" }

// eventually polls fn until it succeeds and returns how long it took.
func eventually(t *testing.T, within time.Duration, fn func() error) time.Duration {
	t.Helper()
	start := time.Now()
	testutil.Eventually(t, within, fn)
	return time.Since(start)
}

func sortedKeys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func mustURL(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// stream is the activity stream, read as the harness's Admin.
func stream(t *testing.T, s *system) jetstream.Stream {
	t.Helper()
	st, err := s.JS.Stream(testenv.Context(t, 10*time.Second), events.StreamActivity)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
