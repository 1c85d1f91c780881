// Command scale is the scale benchmark (issue 28): it fills a real
// JetStream server with the project's own buckets and records, as many
// accounts as each size asks (five sessions each, a fifth of the
// sandboxes running with a cached handshake), and at each size starts a
// real edge against it and measures what grows with accounts: how long
// the edge takes to be ready and its memory, then, once it has served
// the active users, its memory again, a cached proxied request's CPU, how
// long a revocation takes to reach it, the admin list's first page and a
// page right after a write, and the store's size on disk. The sizes fill
// one server in turn (each adds to the last), and the first, a handful of
// accounts, is the baseline the cached request's CPU is compared with.
//
// It writes its section of docs/BENCHMARKS.md (between the scale
// markers, after `make bench` has written the rest).
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/dev/bulk"
	"github.com/aaas-project/aaas/internal/dev/child"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/procstat"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/state"
)

type options struct {
	bin, out string
	sizes    []int
	active   int
	requests int
	// nodes is the NATS cluster's size, every stream and bucket
	// replicated on each node.
	nodes int
	// profiles, when set, is where the sweeper's heap profile at each
	// size is kept.
	profiles string
}

func main() {
	var o options
	sizes := flag.String("sizes", "10,10000,100000,1000000", "account counts to measure, ascending; the first is the baseline")
	flag.StringVar(&o.bin, "bin", "bin", "directory of the aaas binaries")
	flag.StringVar(&o.out, "out", "docs/BENCHMARKS.md", "report file (its scale section is replaced)")
	flag.IntVar(&o.active, "active", 10000, "users the edge serves at each size (at most the size)")
	flag.IntVar(&o.requests, "requests", 20000, "cached proxied requests whose CPU is measured")
	copies := flag.String("load-copies", "", "(internal) load the full copies from this NATS URL and print the time and heap they took")
	flag.StringVar(&o.profiles, "profiles", "", "keep the sweeper's heap profile at each size in this directory")
	flag.IntVar(&o.nodes, "nodes", 1, "NATS nodes (1, 3 or 5), every stream and bucket on each; more than one writes a section of its own")
	flag.Parse()
	if *copies != "" {
		if err := loadCopies(*copies); err != nil {
			fmt.Fprintln(os.Stderr, "scale:", err)
			os.Exit(1)
		}
		return
	}
	for _, s := range strings.Split(*sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || len(o.sizes) > 0 && n <= o.sizes[len(o.sizes)-1] {
			fmt.Fprintf(os.Stderr, "scale: -sizes must be ascending positive counts, got %q\n", *sizes)
			os.Exit(2)
		}
		o.sizes = append(o.sizes, n)
	}
	if o.nodes != 1 && o.nodes != 3 && o.nodes != 5 {
		fmt.Fprintf(os.Stderr, "scale: -nodes is 1, 3 or 5, got %d\n", o.nodes)
		os.Exit(2)
	}
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(1)
	}
}

// world is the filled server and what the measurements need of it.
type world struct {
	o   options
	dir string
	// url reaches every node; storeDir is one node's store (each holds
	// every stream and bucket).
	url, storeDir string
	js            jetstream.JetStream
	key           []byte
	sealer        *handshake.Sealer
	upstream      string // the stand-in pods' address
	// The first users' credentials, kept for the requests.
	tokens   []string
	sessions []string
	filled   int
}

// row is one size's figures.
type row struct {
	accounts                    int
	ready                       time.Duration
	rssReady, rssServed         int64
	cpuPerRequest               time.Duration
	revocation                  time.Duration
	adminFirst, adminAfterWrite time.Duration
	storeBytes                  int64
	// copyLoad and copyHeap: the full copies of accounts and sandboxes
	// lifecycle's mirror and the sweeper hold.
	copyLoad time.Duration
	copyHeap int64
	// pruneList is lifecycle's pruning pass at a term's start: every
	// session key listed, each user's account looked up in the copy.
	pruneList time.Duration
	sweeper   sweeperFigures
	fillRate  float64
}

func run(o options) error {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "aaas-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// The buckets are sized for the largest size (README, Sizing), and
	// the store reserves what that takes.
	sizing := state.DefaultBucketsConfig()
	sizing.Accounts = max(sizing.Accounts, o.sizes[len(o.sizes)-1])
	reserve := events.DefaultStreamsConfig().StoreBytes() + sizing.StoreBytes()
	url, storeDir, stop, err := startNATS(filepath.Join(dir, "nats"), o.nodes, reserve+1<<30)
	if err != nil {
		return err
	}
	defer stop()
	nc, js, err := connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	setup, err := child.Start(child.Options{Name: "setup", Path: filepath.Join(o.bin, "setup"), Env: child.Environ(map[string]string{
		"NATS_URL": url, "NATS_ALLOW_ANONYMOUS": "true", "PATH": os.Getenv("PATH"),
		"EXPECTED_ACCOUNTS": strconv.Itoa(sizing.Accounts), "STREAM_REPLICAS": strconv.Itoa(o.nodes),
	}), Output: os.Stderr})
	if err != nil {
		return err
	}
	if err := setup.Wait(ctx, time.Minute); err != nil {
		return err
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	sealer, err := handshake.NewSealer(key)
	if err != nil {
		return err
	}
	up, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	page := bytes.Repeat([]byte("x"), 1024)
	go func() {
		_ = http.Serve(up, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(page) }))
	}()
	w := &world{o: o, dir: dir, url: url, storeDir: storeDir, js: js, key: key, sealer: sealer, upstream: up.Addr().String()}
	if err := w.admin(ctx); err != nil {
		return err
	}
	var rows []row
	for _, n := range o.sizes {
		start, before := time.Now(), w.filled
		if err := w.fill(ctx, n); err != nil {
			return err
		}
		took := time.Since(start)
		fmt.Fprintf(os.Stderr, "scale: %d accounts filled in %s\n", n, took.Round(time.Millisecond))
		r, err := w.measure(ctx, n)
		if err != nil {
			return fmt.Errorf("at %d accounts: %w", n, err)
		}
		// The accounts this size added, each with its sessions and
		// sandbox, by the time that took.
		r.fillRate = float64(n-before) / took.Seconds()
		rows = append(rows, r)
		fmt.Fprintf(os.Stderr, "scale: %+v\n", r)
	}
	return writeSection(o.out, o.nodes, report(o, rows))
}

// startNATS starts one server, or a cluster of nodes, each with a store
// of maxStore bytes: the URL reaching it, one node's store and the stop.
func startNATS(dir string, nodes int, maxStore int64) (url, storeDir string, stop func(), err error) {
	if nodes == 1 {
		ns, err := embednats.Start(embednats.Options{Dir: dir, MaxStore: maxStore})
		if err != nil {
			return "", "", nil, err
		}
		return ns.URL(), ns.Dir(), ns.Stop, nil
	}
	c, err := embednats.StartCluster(dir, nodes, embednats.Options{MaxStore: maxStore})
	if err != nil {
		return "", "", nil, err
	}
	return c.URLs(), c.Nodes[0].Dir(), c.Shutdown, nil
}

// user is the i-th account's name.
func user(i int) string { return fmt.Sprintf("u%07d", i) }

// running says whether the i-th account's sandbox is running (one in
// five).
func running(i int) bool { return i%5 == 0 }

// cpuRounds is how many times the cached requests' CPU is measured.
const cpuRounds = 5

// edgeHost is the Host the requests carry, the one the handshakes are
// sealed for (path mode: the browser's host).
const edgeHost = "scale.test"

// adminHost serves the admin view (path mode needs one apart).
const adminHost = "admin.scale.test"

// adminName is the administrator the admin list is read as.
const adminName = "scale-admin"

var adminToken = ident.NewToken(adminName)

func (w *world) admin(ctx context.Context) error {
	v, err := kv.Encode(state.User{Name: adminName, TokenHash: ident.HashHex(adminToken), Managed: true, Created: time.Now()})
	if err != nil {
		return err
	}
	_, err = w.js.Publish(ctx, "$KV."+state.BucketUsers+"."+adminName, v)
	return err
}

// fill adds accounts up to n: their account, sandbox, five sessions and,
// running, a handshake; published in flight, a few thousand at a time.
func (w *world) fill(ctx context.Context, n int) error {
	bw := bulk.New(w.js)
	put := func(bucket, key string, v []byte) { bw.Put("$KV."+bucket+"."+key, v) }
	now := time.Now()
	for i := w.filled; i < n; i++ {
		name := user(i)
		token := ident.NewToken(name)
		u, _ := kv.Encode(state.User{Name: name, TokenHash: ident.HashHex(token), Managed: true, Created: now})
		put(state.BucketUsers, name, u)
		box := state.Sandbox{User: name, Phase: state.PhaseSuspended, Managed: true}
		if running(i) {
			box.Phase, box.Address, box.PodUID, box.PodName, box.ReadySince = state.PhaseReady, w.upstream, "pod-"+name, "dsh-"+name, now
			hk := state.HandshakeKey(name, box.PodUID, edgeHost)
			h, _ := kv.Encode(state.Handshake{User: name, PodUID: box.PodUID, Host: edgeHost, Sealed: w.sealer.Seal([]byte("dsh-auth=scale"), []byte(hk)), At: now})
			put(state.BucketHandshakes, hk, h)
		}
		b, _ := kv.Encode(box)
		put(state.BucketSandboxes, name, b)
		for s := range 5 {
			sid := ident.NewSecret()
			v, _ := kv.Encode(state.Session{User: name, Created: now, Expires: now.Add(7 * 24 * time.Hour), Via: "login"})
			put(state.BucketSessions, state.SessionKey(name, ident.HashHex(sid)), v)
			if s == 0 && i < w.o.active {
				w.sessions = append(w.sessions, sid)
			}
		}
		if i < w.o.active {
			w.tokens = append(w.tokens, token)
		}
	}
	if err := bw.Wait(ctx); err != nil {
		return err
	}
	w.filled = n
	return nil
}

// edge is a started edge process.
type edge struct {
	p             *child.Process
	addr, metrics string
}

func (w *world) startEdge() (*edge, error) {
	ports := make([]int, 2)
	for i := range ports {
		p, err := embednats.FreePort()
		if err != nil {
			return nil, err
		}
		ports[i] = p
	}
	e := &edge{addr: fmt.Sprintf("127.0.0.1:%d", ports[0]), metrics: fmt.Sprintf("127.0.0.1:%d", ports[1])}
	env := map[string]string{
		"PATH": os.Getenv("PATH"), "NATS_URL": w.url, "NATS_ALLOW_ANONYMOUS": "true",
		"LISTEN_ADDR": e.addr, "METRICS_ADDR": e.metrics, "INSTANCE_ID": "edge-scale",
		"PUBLIC_HOSTS": edgeHost, "OPEN_SIGNUP": "true", "COOKIE_SECURE": "false", "ALLOW_INSECURE_COOKIES": "1",
		"HANDSHAKE_KEYS": base64.StdEncoding.EncodeToString(w.key), "LOG_LEVEL": "debug",
		"ADMIN_USERS": adminName + ":" + ident.HashHex(adminToken), "ADMIN_HOSTS": adminHost,
	}
	p, err := child.Start(child.Options{Name: "edge", Path: filepath.Join(w.o.bin, "edge"), Env: child.Environ(env), Log: filepath.Join(w.dir, "edge.log")})
	if err != nil {
		return nil, err
	}
	e.p = p
	return e, nil
}

var client = &http.Client{Timeout: time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}

// get asks the edge for path as Host edgeHost with header pairs; it
// returns the status.
func (e *edge) get(path string, header ...string) (int, error) {
	return e.getAt(edgeHost, path, header...)
}

// getAt is get with Host host.
func (e *edge) getAt(host, path string, header ...string) (int, error) {
	req, err := http.NewRequest(http.MethodGet, "http://"+e.addr+path, nil)
	if err != nil {
		return 0, err
	}
	req.Host = host
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return resp.StatusCode, fmt.Errorf("%d: %s", resp.StatusCode, b)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

func (w *world) measure(ctx context.Context, n int) (row, error) {
	r := row{accounts: n}
	start := time.Now()
	e, err := w.startEdge()
	if err != nil {
		return r, err
	}
	defer e.p.Stop(10 * time.Second)
	if err := waitReady(e.p, e.metrics, start); err != nil {
		return r, fmt.Errorf("edge: %w", err)
	}
	r.ready = time.Since(start)
	if r.rssReady, err = procstat.RSS(e.p.PID()); err != nil {
		return r, err
	}
	// The active users, each once: a page that reads their session,
	// account and sandbox.
	active := min(w.o.active, n)
	if err := parallel(active, func(i int) error {
		if code, err := e.get("/_/status", "Cookie", "dsh_gw_session="+w.sessions[i]+"; dsh_gw_session_user="+user(i)); err != nil || code != http.StatusOK {
			return fmt.Errorf("%s's status: %d %v\n%s", user(i), code, err, e.p.LogTail(10))
		}
		return nil
	}); err != nil {
		return r, err
	}
	if r.rssServed, err = procstat.RSS(e.p.PID()); err != nil {
		return r, err
	}
	// Cached proxied requests of the running among them.
	var runners []int
	for i := 0; i < active && len(runners) < 100; i++ {
		if running(i) {
			runners = append(runners, i)
		}
	}
	warm := func(i int) error {
		u := runners[i%len(runners)]
		if code, err := e.get("/u/"+user(u)+"/x", "Authorization", "Bearer "+w.tokens[u]); err != nil || code != http.StatusOK {
			return fmt.Errorf("%s's sandbox: %d %v", user(u), code, err)
		}
		return nil
	}
	if err := parallel(len(runners), warm); err != nil {
		return r, err
	}
	// The least of a few rounds: what else runs on the machine (the NATS
	// servers among them) only ever adds to a round's CPU.
	for round := range cpuRounds {
		before := procstat.CPUTime(e.p.PID())
		if err := parallel(w.o.requests, warm); err != nil {
			return r, err
		}
		if per := (procstat.CPUTime(e.p.PID()) - before) / time.Duration(w.o.requests); round == 0 || per < r.cpuPerRequest {
			r.cpuPerRequest = per
		}
	}
	// A revocation elsewhere: the session of a user this edge served.
	sessions, err := kv.Open[state.Session](ctx, w.js, state.BucketSessions)
	if err != nil {
		return r, err
	}
	victim := active - 1
	cookie := "dsh_gw_session=" + w.sessions[victim] + "; dsh_gw_session_user=" + user(victim)
	revoked := time.Now()
	if err := sessions.Purge(ctx, state.SessionKey(user(victim), ident.HashHex(w.sessions[victim]))); err != nil {
		return r, err
	}
	for {
		code, err := e.get("/_/status", "Cookie", cookie)
		if err != nil {
			return r, err
		}
		if code == http.StatusUnauthorized {
			break
		}
		if time.Since(revoked) > time.Minute {
			return r, errors.New("the revocation never reached the edge")
		}
	}
	r.revocation = time.Since(revoked)
	// The victim signs in again, for the next size.
	w.sessions[victim] = ident.NewSecret()
	if _, err := sessions.Put(ctx, state.SessionKey(user(victim), ident.HashHex(w.sessions[victim])), state.Session{User: user(victim), Created: time.Now(), Expires: time.Now().Add(time.Hour), Via: "login"}); err != nil {
		return r, err
	}
	// The admin list: its first page (the names load) and one right
	// after a write.
	admin := func() (time.Duration, error) {
		t := time.Now()
		code, err := e.getAt(adminHost, "/_/admin/users?limit=50&after="+user(n/2), "Authorization", "Bearer "+adminToken)
		if err == nil && code != http.StatusOK {
			err = fmt.Errorf("admin list: %d", code)
		}
		return time.Since(t), err
	}
	if r.adminFirst, err = admin(); err != nil {
		return r, err
	}
	users, err := kv.Open[state.User](ctx, w.js, state.BucketUsers)
	if err != nil {
		return r, err
	}
	if _, err := users.Put(ctx, "written-"+strconv.Itoa(n), state.User{Name: "written-" + strconv.Itoa(n), Created: time.Now()}); err != nil {
		return r, err
	}
	time.Sleep(100 * time.Millisecond) // the write reaches the edge's key set
	if r.adminAfterWrite, err = admin(); err != nil {
		return r, err
	}
	e.p.Stop(10 * time.Second) // its beacons end before the sweeper's are counted
	if r.sweeper, err = w.sweeper(ctx, n); err != nil {
		return r, fmt.Errorf("sweeper: %w", err)
	}
	if r.copyLoad, r.copyHeap, r.pruneList, err = w.fullCopies(ctx); err != nil {
		return r, err
	}
	r.storeBytes, err = dirSize(w.storeDir)
	return r, err
}

// fullCopies loads what lifecycle's mirror and the sweeper hold of every
// account: full copies of the users and sandboxes buckets (kv caches, as
// they build them), in a process of their own (this command again, with
// -load-copies), so the heap measured is theirs alone and not the
// in-process NATS servers'. It returns how long they take to load, the
// heap they hold, and how long lifecycle's pruning pass at a term's start
// takes with them (every session key listed, each user looked up).
func (w *world) fullCopies(ctx context.Context) (load time.Duration, heap int64, prune time.Duration, err error) {
	self, err := os.Executable()
	if err != nil {
		return 0, 0, 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, 11*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, self, "-load-copies", w.url).Output()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("load the full copies: %w", err)
	}
	if _, err := fmt.Sscan(string(out), &load, &heap, &prune); err != nil {
		return 0, 0, 0, fmt.Errorf("load the full copies: %q: %w", out, err)
	}
	return load, heap, prune, nil
}

// connect is a connection to url and its JetStream.
func connect(url string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(url)
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// loadCopies is -load-copies: it loads the full copies from url and
// prints how long that took, the heap they hold and how long a pruning
// pass's listing of every session key takes against them, as three
// numbers.
func loadCopies(url string) error {
	ctx := context.Background()
	nc, js, err := connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	users, err := kv.Open[state.User](ctx, js, state.BucketUsers)
	if err != nil {
		return err
	}
	boxes, err := kv.Open[state.Sandbox](ctx, js, state.BucketSandboxes)
	if err != nil {
		return err
	}
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	start := time.Now()
	log := slog.New(slog.DiscardHandler)
	uc, err := kv.NewCache(ctx, users, ">", log)
	if err != nil {
		return err
	}
	bc, err := kv.NewCache(ctx, boxes, ">", log)
	if err != nil {
		return err
	}
	for !uc.IsSynced() || !bc.IsSynced() {
		if time.Since(start) > 10*time.Minute {
			return errors.New("the full copies did not load in 10 minutes")
		}
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Since(start)
	runtime.GC()
	runtime.ReadMemStats(&m1)
	runtime.KeepAlive(bc)
	sessions, err := kv.Open[state.Session](ctx, js, state.BucketSessions)
	if err != nil {
		return err
	}
	// What the pruner does at a term's start (lifecycle, markGone): the
	// users whose keys it lists without an account here.
	start, orphans := time.Now(), 0
	if err := sessions.EachKey(ctx, ">", func(k string) {
		user, _, _ := strings.Cut(k, ".")
		if _, ok := uc.Get(user); !ok {
			orphans++
		}
	}); err != nil {
		return err
	}
	prune := time.Since(start)
	if orphans != 0 {
		return fmt.Errorf("%d sessions without an account", orphans)
	}
	fmt.Println(int64(took), int64(m1.HeapAlloc)-int64(m0.HeapAlloc), int64(prune))
	return nil
}

// parallel runs fn(0..n-1) on 8 workers, stopping at the first error.
func parallel(n int, fn func(i int) error) error {
	var next, failed sync.Mutex
	var first error
	i := 0
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				next.Lock()
				j := i
				i++
				next.Unlock()
				failed.Lock()
				stop := first != nil
				failed.Unlock()
				if j >= n || stop {
					return
				}
				if err := fn(j); err != nil {
					failed.Lock()
					if first == nil {
						first = err
					}
					failed.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return first
}

func dirSize(dir string) (int64, error) {
	var total int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err == nil {
			total += info.Size()
		}
		return err
	})
	return total, err
}
