package main

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"
)

// marks are the markers around the scale section of a run on nodes
// NATS nodes in the report file: one server's section, and a cluster's
// apart from it.
func marks(nodes int) (begin, end string) {
	if nodes == 1 {
		return "<!-- scale: written by hack/scale -->", "<!-- /scale -->"
	}
	return fmt.Sprintf("<!-- scale nodes=%d: written by hack/scale -->", nodes), fmt.Sprintf("<!-- /scale nodes=%d -->", nodes)
}

// The goals at the largest size (issue 28).
const (
	goalReady      = 2 * time.Second
	goalRSS        = 256 << 20
	goalCPURatio   = 1.10
	goalRevocation = time.Second
	goalAdmin      = 50 * time.Millisecond
	goalSweep      = 100 * time.Millisecond
)

func mib(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

func msd(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

func report(o options, rows []row) []byte {
	var b bytes.Buffer
	begin, end := marks(o.nodes)
	if o.nodes == 1 {
		fmt.Fprintf(&b, "%s\n## Scale\n\n", begin)
		fmt.Fprintf(&b, "`go run ./hack/scale -sizes %s -active %d -requests %d`, on %s: a real JetStream server filled with the project's buckets and records (five sessions per account; a fifth of the sandboxes running, with a cached handshake), and at each size a real edge started against it, which then serves the first %d users once each (a status page: their session, account and sandbox). Sizes fill one server in turn. The first size is the baseline of a cached request's CPU, which is the least of %d rounds of %d requests (what else runs on the machine only adds to a round).\n\n",
			joinInts(o.sizes), o.active, o.requests, time.Now().UTC().Format(time.DateOnly), o.active, cpuRounds, o.requests)
	} else {
		fmt.Fprintf(&b, "%s\n### Scale on a %d-node cluster\n\n", begin, o.nodes)
		fmt.Fprintf(&b, "`go run ./hack/scale -nodes %d -sizes %s -active %d -requests %d`, on %s: the same measurements against %d JetStream servers in one cluster on this machine, every stream and bucket replicated on each (`STREAM_REPLICAS=%d`), the edge connected to all of them; \"store on disk\" is one node's. The nodes share this machine's two cores, so a write waits for its replicas on the same CPUs: the fill rate and the write-bound columns are this machine's, not a cluster's on its own hosts.\n\n",
			o.nodes, joinInts(o.sizes), o.active, o.requests, time.Now().UTC().Format(time.DateOnly), o.nodes, o.nodes)
	}
	b.WriteString("| accounts | filled at | edge ready | RSS ready | RSS serving | cached request CPU | ×baseline | revocation seen | admin page (first) | admin page after a write | store on disk |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	base := rows[0].cpuPerRequest
	for _, r := range rows {
		fmt.Fprintf(&b, "| %d | %.0f accounts/s | %s | %s | %s | %d µs | %.2f× | %s | %s | %s | %s |\n", r.accounts, r.fillRate, msd(r.ready), mib(r.rssReady), mib(r.rssServed),
			r.cpuPerRequest.Microseconds(), float64(r.cpuPerRequest)/float64(max(base, 1)), msd(r.revocation), msd(r.adminFirst), msd(r.adminAfterWrite), mib(r.storeBytes))
	}
	fmt.Fprintf(&b, "\nThe background workers at each size: the real sweeper (`IDLE_TIMEOUT=24h`, so nothing falls due, and `SWEEP_INTERVAL=%s`), its first sweep as the lease holder, then its sweeps while %d beacons a second of work just ended come for the active users for %s; lifecycle's mirror's full copies of accounts and sandboxes, loaded by a process of their own (so the heap is theirs alone), and the pruning pass a term of leadership starts with (every session key listed, each user's account looked up in that copy).\n\n", sweepEvery, churnRate, churnFor)
	b.WriteString("| accounts | sweeper ready | its RSS ready | RSS after the sweeps | live heap | first sweep | sweep while beacons come | decided per sweep | mirror's copies: load | their heap | pruning's listing of every session |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		sw := r.sweeper
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %.0f | %s | %s | %s |\n", r.accounts, msd(sw.ready), mib(sw.rss), mib(sw.rssSwept), mib(sw.live), msd(sw.first), msd(sw.tick), sw.decided,
			msd(r.copyLoad), mib(r.copyHeap), msd(r.pruneList))
	}
	last := rows[len(rows)-1]
	fmt.Fprintf(&b, "\nGoals at %d accounts (the issue's are at 1M):\n\n", last.accounts)
	goal := func(name string, ok bool, got, want string) {
		verdict := "met"
		if !ok {
			verdict = "**missed**"
		}
		fmt.Fprintf(&b, "- %s: %s (%s; goal %s)\n", name, verdict, got, want)
	}
	goal("edge ready", last.ready <= goalReady, msd(last.ready), msd(goalReady))
	goal("edge memory serving the active users", last.rssServed <= goalRSS, mib(last.rssServed), mib(goalRSS))
	ratio := float64(last.cpuPerRequest) / float64(max(base, 1))
	goal("cached request CPU against the baseline", ratio <= goalCPURatio, fmt.Sprintf("%.2f×", ratio), fmt.Sprintf("%.2f×", goalCPURatio))
	goal("revocation seen by the edge", last.revocation <= goalRevocation, msd(last.revocation), msd(goalRevocation))
	goal("admin page after a write", last.adminAfterWrite <= goalAdmin, msd(last.adminAfterWrite), msd(goalAdmin))
	goal("sweeper tick", last.sweeper.tick <= goalSweep, msd(last.sweeper.tick), msd(goalSweep))
	b.WriteString("\nThe admin page's first load reads every account's and sandbox's name (headers only) once per edge; every page after it is read from where it starts, the changes since the last fold merged in on read. A sweep decides for the sandboxes whose time came or that changed; the first of a term decides for every Ready one. What still grows with accounts is what the sweeper and lifecycle's mirror hold of every sandbox and account, and the pruning's one listing per term (README, \"A million accounts\").\n")
	fmt.Fprintf(&b, "%s\n", end)
	return b.Bytes()
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ",")
}

// writeSection replaces the scale section of a run on nodes NATS nodes
// in the file at path (or adds it at the end).
func writeSection(path string, nodes int, section []byte) error {
	beginMark, endMark := marks(nodes)
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	out := append(bytes.TrimRight(old, "\n"), "\n\n"...)
	if i := bytes.Index(old, []byte(beginMark)); i >= 0 {
		rest := old[i:]
		j := bytes.Index(rest, []byte(endMark))
		if j < 0 {
			return fmt.Errorf("%s: %q without %q", path, beginMark, endMark)
		}
		out = append(append(append([]byte{}, old[:i]...), section...), bytes.TrimLeft(rest[j+len(endMark):], "\n")...)
	} else {
		out = append(out, section...)
	}
	return os.WriteFile(path, out, 0o644)
}
