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

// The markers around the scale section in the report file.
const (
	beginMark = "<!-- scale: written by hack/scale -->"
	endMark   = "<!-- /scale -->"
)

// The goals at the largest size (issue 28).
const (
	goalReady      = 2 * time.Second
	goalRSS        = 256 << 20
	goalCPURatio   = 1.10
	goalRevocation = time.Second
	goalAdmin      = 50 * time.Millisecond
)

func mib(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

func msd(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

func report(o options, rows []row) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s\n## Scale\n\n", beginMark)
	fmt.Fprintf(&b, "`go run ./hack/scale -sizes %s -active %d -requests %d`, on %s: a real JetStream server filled with the project's buckets and records (five sessions per account; a fifth of the sandboxes running, with a cached handshake), and at each size a real edge started against it, which then serves the first %d users once each (a status page: their session, account and sandbox). Sizes fill one server in turn. The first size is the baseline of a cached request's CPU.\n\n",
		joinInts(o.sizes), o.active, o.requests, time.Now().UTC().Format(time.DateOnly), o.active)
	b.WriteString("| accounts | edge ready | RSS ready | RSS serving | cached request CPU | ×baseline | revocation seen | admin page (first) | admin page after a write | store on disk | full copy of accounts and sandboxes: load | its heap |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	base := rows[0].cpuPerRequest
	for _, r := range rows {
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %d µs | %.2f× | %s | %s | %s | %s | %s | %s |\n", r.accounts, msd(r.ready), mib(r.rssReady), mib(r.rssServed),
			r.cpuPerRequest.Microseconds(), float64(r.cpuPerRequest)/float64(max(base, 1)), msd(r.revocation), msd(r.adminFirst), msd(r.adminAfterWrite), mib(r.storeBytes),
			msd(r.copyLoad), mib(r.copyHeap))
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
	b.WriteString("\nThe admin page's first load reads every account's and sandbox's name (headers only) once per edge; the pages after it merge changes in. The last two columns are what lifecycle's mirror and the sweeper hold of every account (full copies of the users and sandboxes buckets, loaded in the tool's own process): the cost that still grows with accounts (README, \"A million accounts\").\n")
	fmt.Fprintf(&b, "%s\n", endMark)
	return b.Bytes()
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ",")
}

// writeSection replaces the scale section of the file at path (or adds
// it at the end).
func writeSection(path string, section []byte) error {
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
