// Package hoststate turns what the machine reports about its packet
// filter into the part the real node can change, so that a comparison of
// before and after judges what the node added (chains, rules, policies)
// and not what the kernel does by itself: on a machine where nothing had
// used iptables yet, the first run loads the default tables, which then
// stay, empty, after the node removed everything it added.
package hoststate

import "strings"

// Iptables reduces iptables-save (or ip6tables-save) output to one line
// per thing a program can add: "<table> -N <chain>" for a chain of its
// own, "<table> -P <chain> <policy>" for a built-in chain whose policy is
// not the default ACCEPT, and "<table> -A …" for each rule. Table
// headers, COMMIT, counters and comments go, so a table that exists with
// only its built-in chains, empty and accepting, reads exactly like a
// table that was never loaded.
func Iptables(save string) string {
	var out []string
	table := ""
	for _, line := range strings.Split(save, "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "", strings.HasPrefix(line, "#"), line == "COMMIT":
		case strings.HasPrefix(line, "*"):
			table = strings.TrimPrefix(line, "*")
		case strings.HasPrefix(line, ":"):
			// ":CHAIN POLICY [packets:bytes]"; user chains have policy "-".
			f := strings.Fields(strings.TrimPrefix(line, ":"))
			switch {
			case len(f) < 2:
				out = append(out, table+" "+line)
			case f[1] == "-":
				out = append(out, table+" -N "+f[0])
			case f[1] != "ACCEPT":
				out = append(out, table+" -P "+f[0]+" "+f[1])
			}
		default:
			out = append(out, table+" "+line)
		}
	}
	return strings.Join(out, "\n")
}
