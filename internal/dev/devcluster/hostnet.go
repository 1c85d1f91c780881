package devcluster

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/aaas-project/aaas/internal/dev/devcluster/hoststate"
)

// The real node's network. Pods live in podCIDR on a bridge whose gateway
// address is also the node's and the API server's address, so nothing of
// the test bed listens on the machine's external interfaces. Services live
// in serviceCIDR. Network safety: whatever a pod sends is routed by its own
// table, in which only pod and service addresses exist (and the host's own
// addresses, from the local table); everything else is unreachable, so no
// pod traffic ever leaves the machine.
const (
	podCIDR      = "10.244.0.0/16"
	nodePodCIDR  = "10.244.0.0/24"
	gatewayIP    = "10.244.0.1"
	serviceCIDR  = "10.96.0.0/16"
	apiServiceIP = "10.96.0.1"
	dnsServiceIP = "10.96.0.10"
	bridgeName   = "aaas0"
	// podRouteTable is the policy-routing table for traffic from pods.
	podRouteTable = "4244"
	// The rules' priorities; cleanup deletes by priority.
	rulePriorityFromPods   = "4244"
	rulePriorityFromBridge = "4245"
	// stateDir survives a killed run (tmpfs, gone on reboot): the lock, the
	// last cluster directory and the sysctls to restore.
	stateDir = "/run/aaas-devcluster"
)

// NodeDNSCIDR is where the real node's cluster DNS answers: CoreDNS runs
// as a host process on the bridge, so no pod carries kube-dns's labels
// and a NetworkPolicy that limits egress admits DNS by this address.
const NodeDNSCIDR = gatewayIP + "/32"

// sysctls the node needs: forwarding between the bridge and its ports, and
// bridged traffic through iptables so NetworkPolicy and Services apply.
var nodeSysctls = map[string]string{
	"net.ipv4.ip_forward":                "1",
	"net.bridge.bridge-nf-call-iptables": "1",
}

// hostCommands are the programs the real node runs besides its own
// binaries; all come from Debian packages `make tools` installs.
var hostCommands = []string{"ip", "iptables", "iptables-save", "ip6tables", "ip6tables-save", "ipset", "conntrack", "containerd", "containerd-shim-runc-v2", "ctr", "runc"}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func output(name string, args ...string) string {
	out, _ := exec.Command(name, args...).Output()
	return string(out)
}

// setupHostNetwork installs the network safety routes first, then the
// bridge and the sysctls (remembering their old values).
func setupHostNetwork() error {
	steps := [][]string{
		{"ip", "route", "replace", "unreachable", podCIDR},
		// The host reaches Services through the bridge, where kube-proxy's
		// DNAT turns them into pod addresses (an unreachable route would
		// fail before the DNAT runs).
		{"ip", "link", "add", bridgeName, "type", "bridge"},
		{"ip", "addr", "replace", gatewayIP + "/24", "dev", bridgeName},
		{"ip", "link", "set", bridgeName, "up"},
		{"ip", "route", "replace", serviceCIDR, "dev", bridgeName},
		{"ip", "route", "replace", "throw", podCIDR, "table", podRouteTable},
		{"ip", "route", "replace", "throw", serviceCIDR, "table", podRouteTable},
		{"ip", "route", "replace", "unreachable", "default", "table", podRouteTable},
		{"ip", "rule", "add", "from", podCIDR, "lookup", podRouteTable, "priority", rulePriorityFromPods},
		{"ip", "rule", "add", "iif", bridgeName, "lookup", podRouteTable, "priority", rulePriorityFromBridge},
	}
	for _, s := range steps {
		if err := run(s[0], s[1:]...); err != nil {
			return fmt.Errorf("network setup: %w", err)
		}
	}
	var saved []string
	for k, v := range nodeSysctls {
		old, err := os.ReadFile(sysctlPath(k))
		if err != nil {
			return fmt.Errorf("sysctl %s: %w", k, err)
		}
		saved = append(saved, k+" "+strings.TrimSpace(string(old)))
		if err := os.WriteFile(sysctlPath(k), []byte(v), 0o644); err != nil {
			return fmt.Errorf("sysctl %s=%s: %w", k, v, err)
		}
	}
	return os.WriteFile(filepath.Join(stateDir, "sysctl"), []byte(strings.Join(saved, "\n")), 0o600)
}

func sysctlPath(k string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(k, ".", "/"))
}

// cleanupHost removes everything a real node adds to the machine, whether
// the last run stopped cleanly or was killed: container processes and their
// shims, network namespaces, mounts under dirs, iptables chains and ipsets
// of kube-proxy, the kubelet and kube-router, routes, rules, the bridge, and
// the sysctls it changed. Each step is idempotent; errors are collected.
func cleanupHost(containerdSocket string, dirs ...string) error {
	var errs []error
	killContainerProcesses(containerdSocket)
	for _, ns := range strings.Fields(output("ip", "netns", "list")) {
		if strings.HasPrefix(ns, "cni-") {
			if err := run("ip", "netns", "delete", ns); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, d := range dirs {
		if d != "" {
			errs = append(errs, unmountUnder(d))
		}
	}
	errs = append(errs, removeCgroups(), cleanupIptables())
	for _, s := range strings.Fields(output("ipset", "list", "-n")) {
		if strings.HasPrefix(s, "KUBE-") {
			if err := run("ipset", "destroy", s); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, prio := range []string{rulePriorityFromPods, rulePriorityFromBridge} {
		for run("ip", "rule", "del", "priority", prio) == nil {
		}
	}
	_ = run("ip", "route", "flush", "table", podRouteTable)
	_ = run("ip", "route", "del", "unreachable", podCIDR)
	_ = run("ip", "route", "del", serviceCIDR, "dev", bridgeName)
	if _, err := net.InterfaceByName(bridgeName); err == nil {
		// A deleted pod namespace lives on while orphaned sockets in it
		// still retransmit to peers that are gone (kept-alive connections
		// between the edge and sandboxes, up to two minutes), and with it
		// its veth pair: delete the bridge's ports by their host ends.
		for _, line := range strings.Split(output("ip", "-o", "link", "show", "master", bridgeName), "\n") {
			if _, rest, ok := strings.Cut(line, ": "); ok {
				name, _, _ := strings.Cut(rest, ":")
				name, _, _ = strings.Cut(name, "@")
				errs = append(errs, run("ip", "link", "del", name))
			}
		}
		errs = append(errs, run("ip", "link", "del", bridgeName))
	}
	if b, err := os.ReadFile(filepath.Join(stateDir, "sysctl")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, " "); ok {
				if err := os.WriteFile(sysctlPath(k), []byte(v), 0o644); err != nil {
					errs = append(errs, fmt.Errorf("restore %s: %w", k, err))
				}
			}
		}
		_ = os.Remove(filepath.Join(stateDir, "sysctl"))
	}
	// kubelet links each container's log here even with its own pod log
	// directory; only links into our directories are ours.
	if entries, err := os.ReadDir("/var/log/containers"); err == nil {
		for _, e := range entries {
			p := filepath.Join("/var/log/containers", e.Name())
			if target, err := os.Readlink(p); err == nil {
				for _, d := range dirs {
					if d != "" && strings.HasPrefix(target, d) {
						_ = os.Remove(p)
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

// killContainerProcesses kills every process in the kubelet's pod cgroups
// (the containers outlive containerd and the kubelet by design) and then
// the shims of our containerd, found by the socket address on their
// command line, never by name alone.
func killContainerProcesses(containerdSocket string) {
	for range 20 {
		pids := cgroupPIDs()
		if containerdSocket != "" {
			pids = append(pids, shimPIDs(containerdSocket)...)
		}
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// kubepodsRoots are the kubelet's pod cgroups in every hierarchy mounted
// (cgroup v1 mounts one per controller).
func kubepodsRoots() []string {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods")
	if _, err := os.Stat("/sys/fs/cgroup/kubepods"); err == nil {
		roots = append(roots, "/sys/fs/cgroup/kubepods")
	}
	return roots
}

func cgroupPIDs() []int {
	var pids []int
	for _, root := range kubepodsRoots() {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}

func shimPIDs(containerdSocket string) []int {
	var pids []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if !strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for i, a := range args {
			if a == "-address" && i+1 < len(args) && args[i+1] == containerdSocket {
				if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
					pids = append(pids, pid)
				}
			}
		}
	}
	return pids
}

// removeCgroups removes the kubelet's cgroup trees, leaves first.
func removeCgroups() error {
	var errs []error
	for _, root := range kubepodsRoots() {
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		sort.Sort(sort.Reverse(sort.StringSlice(dirs)))
		for _, d := range dirs {
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
			}
		}
	}
	return errors.Join(errs...)
}

// unmountUnder detaches every mount point below dir, deepest first.
func unmountUnder(dir string) error {
	var errs []error
	for _, m := range mountsUnder(dir) {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	return errors.Join(errs...)
}

func mountsUnder(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			out = append(out, fields[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(out)))
	return out
}

// ourChain says whether an iptables chain belongs to the node: kube-proxy,
// the kubelet and kube-router all prefix theirs with KUBE-.
func ourChain(name string) bool { return strings.HasPrefix(name, "KUBE-") }

// cleanupIptables removes every jump into our chains from the built-in
// chains, then flushes and deletes our chains, in both address families.
func cleanupIptables() error {
	var errs []error
	for _, ipt := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"filter", "nat", "mangle", "raw"} {
			rules := output(ipt, "-t", table, "-S")
			var chains []string
			for _, line := range strings.Split(rules, "\n") {
				f := strings.Fields(line)
				switch {
				case len(f) >= 2 && f[0] == "-N" && ourChain(f[1]):
					chains = append(chains, f[1])
				case len(f) >= 2 && f[0] == "-A" && !ourChain(f[1]) && strings.Contains(line, " -j KUBE-"):
					// Rules print in a form iptables reads back.
					args := append([]string{"-t", table, "-D"}, splitRule(line)[1:]...)
					if err := run(ipt, args...); err != nil {
						errs = append(errs, err)
					}
				}
			}
			for _, c := range chains {
				_ = run(ipt, "-t", table, "-F", c)
			}
			for _, c := range chains {
				if err := run(ipt, "-t", table, "-X", c); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	return errors.Join(errs...)
}

// splitRule splits an iptables -S line into arguments, honouring the
// double quotes iptables puts around comments.
func splitRule(line string) []string {
	var args []string
	var cur strings.Builder
	quoted, have := false, false
	for i := 0; i < len(line); i++ {
		ch := line[i]
		switch {
		case ch == '\\' && quoted && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case ch == '"':
			quoted, have = !quoted, true
		case ch == ' ' && !quoted:
			if have {
				args = append(args, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteByte(ch)
			have = true
		}
	}
	if have {
		args = append(args, cur.String())
	}
	return args
}

// HostState describes what the real node may change on this machine:
// iptables chains, rules and policies (hoststate.Iptables), ipsets, routes, rules, links, network
// namespaces, mounts, the sysctls it sets, the kubelet's cgroups and
// container log links, and shim processes. Equal states before Start and
// after Stop mean the node left nothing behind.
func HostState() string {
	var b strings.Builder
	section := func(name, text string) {
		fmt.Fprintf(&b, "## %s\n%s\n", name, strings.TrimSpace(text))
	}
	filterLines := func(text string, keep func(string) bool) string {
		var out []string
		for _, l := range strings.Split(text, "\n") {
			if keep(l) {
				out = append(out, l)
			}
		}
		return strings.Join(out, "\n")
	}
	// What the node adds to the packet filter, not the default tables a
	// first run on a fresh machine makes the kernel load.
	section("iptables", hoststate.Iptables(output("iptables-save")))
	section("ip6tables", hoststate.Iptables(output("ip6tables-save")))
	section("ipsets", output("ipset", "list", "-n"))
	section("rules", output("ip", "rule", "show"))
	section("routes", output("ip", "route", "show", "table", "all"))
	section("rules6", output("ip", "-6", "rule", "show"))
	section("routes6", output("ip", "-6", "route", "show", "table", "all"))
	section("links", filterLines(output("ip", "-o", "link", "show"), func(l string) bool {
		f := strings.Fields(l)
		return len(f) > 1
	}))
	section("netns", output("ip", "netns", "list"))
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	section("mounts", filterLines(string(mounts), func(l string) bool {
		f := strings.Fields(l)
		return len(f) > 4 && (strings.Contains(f[4], "kubelet") || strings.Contains(f[4], "containerd") || strings.Contains(f[4], "netns") || strings.Contains(f[4], "devcluster"))
	}))
	var sysctls []string
	for k := range nodeSysctls {
		v, _ := os.ReadFile(sysctlPath(k))
		sysctls = append(sysctls, k+"="+strings.TrimSpace(string(v)))
	}
	sort.Strings(sysctls)
	section("sysctls", strings.Join(sysctls, "\n"))
	section("cgroups", strings.Join(kubepodsRoots(), "\n"))
	links, _ := filepath.Glob("/var/log/containers/*")
	section("container logs", strings.Join(links, "\n"))
	var shims []string
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.HasPrefix(filepath.Base(strings.Split(string(b), "\x00")[0]), "containerd-shim") {
			shims = append(shims, strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
	section("shims", strings.Join(shims, "\n"))
	return b.String()
}

// ListenForPods listens on addr (ip:port), an address that is not this
// machine's, for the real node's pods only: a local route in the pods' own
// routing table delivers their packets for ip here, while the machine's
// routing of ip stays as it was. Tests use it to stand in for addresses
// such as the cloud metadata service, so that whether pods reach them is
// decided by NetworkPolicy rather than by the test bed's routes. Closing
// the listener removes the route.
func ListenForPods(addr string) (net.Listener, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	route := []string{"route", "replace", "local", host + "/32", "dev", "lo", "table", podRouteTable}
	if err := run("ip", route...); err != nil {
		return nil, err
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			// The address is not the machine's: IP_TRANSPARENT lets the
			// socket bind it and, unlike IP_FREEBIND, answer from it.
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_IP, syscall.IP_TRANSPARENT, 1)
		})
		return errors.Join(err, serr)
	}}
	ln, err := lc.Listen(context.Background(), "tcp4", addr)
	if err != nil {
		_ = run("ip", "route", "del", "local", host+"/32", "dev", "lo", "table", podRouteTable)
		return nil, err
	}
	return &podListener{Listener: ln, host: host}, nil
}

type podListener struct {
	net.Listener
	host string
}

func (l *podListener) Close() error {
	err := l.Listener.Close()
	_ = run("ip", "route", "del", "local", l.host+"/32", "dev", "lo", "table", podRouteTable)
	return err
}
