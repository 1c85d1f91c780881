package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/aaas-project/aaas/internal/dev/procstat"
)

// wrkArgs are the settings of every closed-loop run, whatever the target.
var wrkArgs = []string{"-t1", "-c32", "--latency"}

type wrkResult struct {
	rps      float64
	p99      time.Duration
	requests float64
	cpu      time.Duration // CPU time the target's process used during the run
	socket   string        // wrk's "Socket errors" line, if any
	other    float64       // cores other processes used during the run
}

var (
	rpsRE    = regexp.MustCompile(`Requests/sec:\s+([\d.]+)`)
	p99RE    = regexp.MustCompile(`\s99%\s+([\d.]+)(us|ms|s)`)
	reqRE    = regexp.MustCompile(`(\d+) requests in`)
	socketRE = regexp.MustCompile(`Socket errors:[^\n]*`)
)

// wrk runs wrk against t for d and counts the CPU time t's process used.
func wrk(t *target, path string, d time.Duration) (wrkResult, error) {
	args := append(slices.Clone(wrkArgs), "-d"+d.String())
	for _, h := range t.headers() {
		args = append(args, "-H", h)
	}
	cpu := procstat.CPUTime(t.pid)
	outb, err := exec.Command("wrk", append(args, t.url(path))...).CombinedOutput()
	if err != nil {
		return wrkResult{}, fmt.Errorf("wrk: %v\n%s", err, outb)
	}
	r := wrkResult{cpu: procstat.CPUTime(t.pid) - cpu}
	out := string(outb)
	if strings.Contains(out, "Non-2xx") {
		return r, fmt.Errorf("wrk saw errors through %s:\n%s", t.name, out)
	}
	if m := rpsRE.FindStringSubmatch(out); m != nil {
		r.rps, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reqRE.FindStringSubmatch(out); m != nil {
		r.requests, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := p99RE.FindStringSubmatch(out); m != nil {
		v, _ := strconv.ParseFloat(m[1], 64)
		unit := map[string]time.Duration{"us": time.Microsecond, "ms": time.Millisecond, "s": time.Second}[m[2]]
		r.p99 = time.Duration(v * float64(unit))
	}
	r.socket = socketRE.FindString(out)
	if r.rps == 0 {
		return r, fmt.Errorf("wrk output not understood:\n%s", out)
	}
	return r, nil
}

type rateResult struct {
	offered, achieved float64
	p50, p99          time.Duration
	lag99             time.Duration // how late the generator sent, p99
	errors, sent      int
	clientCPU         time.Duration // of the whole bench process, per request sent
	other             float64       // cores other processes used during the run
}

// maxOpenLoopConns caps the open-loop client's connections.
const maxOpenLoopConns = 64

// generator is the open-loop client of one target: up to
// maxOpenLoopConns kept-alive connections, one request at a time on each
// (no pipelining). The pacing thread writes each request itself, and one
// goroutine per connection reads the responses, so a request costs the
// client two or three system calls and no goroutine (the client shares
// the machine's two cores with the proxy under test).
type generator struct {
	t        *target
	req      []byte // the request, serialized once
	inflight sync.WaitGroup

	mu       sync.Mutex
	idle     []*loopConn
	open     map[*loopConn]bool
	pending  []arrival // requests waiting for a connection, oldest first
	closed   bool
	lat, lag []time.Duration
	errs     int
	firstErr error
}

// arrival is one request: when it was due, and when the generator handed
// it to a connection or to the queue of requests waiting for one.
type arrival struct{ due, handed time.Time }

type loopConn struct {
	net.Conn
	br   *bufio.Reader
	req  arrival // the request in flight, if busy
	busy bool
}

func newGenerator(t *target, path string) *generator {
	req := fasthttp.AcquireRequest()
	defer fasthttp.ReleaseRequest(req)
	req.SetRequestURI("http://" + t.host + t.prefix + path)
	req.Header.Set("Cookie", t.cookie)
	var b bytes.Buffer
	w := bufio.NewWriter(&b)
	_ = req.Write(w)
	_ = w.Flush()
	return &generator{t: t, req: b.Bytes(), open: map[*loopConn]bool{}}
}

// run sends GET path at rate requests per second for d, open loop:
// arrivals are a Poisson process (the same seeded sequence for every
// target and run) and never wait for earlier responses. A request that
// finds every connection busy waits for the first one free, and that wait
// counts in its latency, which runs from the moment the generator handles
// the arrival until the whole response is read. The connections stay
// open from one run to the next (warm-up, then the measured run).
func (g *generator) run(rate float64, d time.Duration) (rateResult, error) {
	g.mu.Lock()
	g.lat, g.lag, g.errs, g.firstErr, g.closed = nil, nil, 0, nil, false
	g.mu.Unlock()
	rng := rand.New(rand.NewPCG(1, 2))
	sent := 0
	restore := precisePacing()
	start := time.Now()
	end := start.Add(d)
	for next := start; next.Before(end); next = next.Add(time.Duration(rng.ExpFloat64() / rate * float64(time.Second))) {
		sleepUntil(next)
		g.send(arrival{due: next, handed: time.Now()})
		sent++
	}
	restore()
	done := make(chan struct{})
	go func() { g.inflight.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		g.close()
		<-done
	}
	elapsed := time.Since(start)
	g.mu.Lock()
	defer g.mu.Unlock()
	r := rateResult{offered: rate, achieved: float64(len(g.lat)) / elapsed.Seconds(), errors: g.errs, sent: sent}
	if len(g.lat) == 0 {
		return r, fmt.Errorf("no request through %s succeeded: %v", g.t.name, g.firstErr)
	}
	r.p50, r.p99 = percentile(g.lat, 50), percentile(g.lat, 99)
	r.lag99 = percentile(g.lag, 99)
	return r, nil
}

// send writes a on an idle connection, else on a new one, else queues it.
func (g *generator) send(a arrival) {
	g.inflight.Add(1)
	g.mu.Lock()
	if n := len(g.idle); n > 0 {
		c := g.idle[n-1]
		g.idle = g.idle[:n-1]
		c.req, c.busy = a, true
		g.mu.Unlock()
		g.write(c)
		return
	}
	if len(g.open) >= maxOpenLoopConns {
		g.pending = append(g.pending, a)
		g.mu.Unlock()
		return
	}
	g.mu.Unlock()
	g.dial(nil, a)
}

// dial opens a connection in place of old (nil: a new one, where the
// caller found room) and writes a on it.
func (g *generator) dial(old *loopConn, a arrival) {
	nc, err := net.Dial("tcp", g.t.addr)
	g.mu.Lock()
	delete(g.open, old)
	var c *loopConn
	if err == nil {
		c = &loopConn{Conn: nc, br: bufio.NewReaderSize(nc, 16<<10), req: a, busy: true}
		g.open[c] = true
	}
	g.mu.Unlock()
	if err != nil {
		g.fail(err)
		return
	}
	go g.read(c)
	g.write(c)
}

func (g *generator) write(c *loopConn) {
	if _, err := c.Write(g.req); err != nil {
		c.Close() // the reader fails the request
	}
}

// read reads c's responses, one per request written, then hands c the
// oldest waiting request or returns it to the idle list.
func (g *generator) read(c *loopConn) {
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseResponse(resp)
	for {
		err := resp.Read(c.br)
		now := time.Now()
		if err == nil && resp.StatusCode() != fasthttp.StatusOK {
			err = fmt.Errorf("status %d", resp.StatusCode())
		}
		g.mu.Lock()
		if err != nil {
			busy := c.busy
			delete(g.open, c)
			g.idle = slices.DeleteFunc(g.idle, func(i *loopConn) bool { return i == c })
			g.mu.Unlock()
			c.Close()
			if busy {
				g.fail(err)
			}
			return
		}
		g.lat = append(g.lat, now.Sub(c.req.handed))
		g.lag = append(g.lag, c.req.handed.Sub(c.req.due))
		keep := !resp.ConnectionClose() && !g.closed
		next, waiting := arrival{}, len(g.pending) > 0
		if waiting {
			next, g.pending = g.pending[0], g.pending[1:]
		}
		switch {
		case !keep && !waiting:
			delete(g.open, c)
		case !keep: // its replacement takes over its place in g.open
		case waiting:
			c.req = next
		default:
			c.busy = false
			g.idle = append(g.idle, c)
		}
		g.mu.Unlock()
		g.inflight.Done()
		if !keep {
			c.Close()
			if waiting {
				g.dial(c, next)
			}
			return
		}
		if waiting {
			g.write(c)
		}
	}
}

func (g *generator) fail(err error) {
	g.mu.Lock()
	g.errs++
	if g.firstErr == nil {
		g.firstErr = err
	}
	g.mu.Unlock()
	g.inflight.Done()
}

// close ends every connection and fails the requests still waiting.
func (g *generator) close() {
	g.mu.Lock()
	g.closed = true
	pending := len(g.pending)
	g.pending = nil
	conns := slices.Collect(maps.Keys(g.open))
	g.mu.Unlock()
	for range pending {
		g.fail(errors.New("no connection became free"))
	}
	for _, c := range conns {
		c.Close()
	}
}

// Go's timers wake about a millisecond late here (the runtime waits in
// epoll with millisecond timeouts), which would send a fixed rate in
// millisecond bursts. The generator's goroutine instead holds its own
// thread, with no timer slack, and sleeps in nanosleep (tens of µs late).
func precisePacing() (restore func()) {
	runtime.LockOSThread()
	old, _, _ := syscall.RawSyscall(syscall.SYS_PRCTL, prGetTimerSlack, 0, 0)
	_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetTimerSlack, 1, 0)
	return func() {
		_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetTimerSlack, old, 0)
		runtime.UnlockOSThread()
	}
}

const prSetTimerSlack, prGetTimerSlack = 29, 30 // prctl(2)

// sleepUntil blocks the calling thread until t.
func sleepUntil(t time.Time) {
	for d := time.Until(t); d > 0; d = time.Until(t) {
		ts := syscall.NsecToTimespec(int64(d))
		_ = syscall.Nanosleep(&ts, nil)
	}
}

// percentile sorts ds and returns its p-th percentile.
func percentile(ds []time.Duration, p int) time.Duration {
	slices.Sort(ds)
	return ds[(len(ds)-1)*p/100]
}
