package devcluster

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// proc is a child process of the cluster (etcd, an API server, a pod's
// container). It runs in its own process group so that stopping it also
// stops anything it started, and it dies with us if we are killed.
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	err     error // exit status, valid after done is closed
}

func startProc(name, bin string, args, env []string, dir, logPath string) (*proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("%s log: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// exitCode is the exit status after the process ended (-1 if killed by a
// signal).
func (p *proc) exitCode() int { return p.cmd.ProcessState.ExitCode() }

// stop sends SIGTERM to the process group, waits up to grace, then kills
// the group. It returns once the process has been reaped.
func (p *proc) stop(grace time.Duration) {
	if p.exited() {
		return
	}
	_ = syscall.Kill(-p.pid(), syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-p.pid(), syscall.SIGKILL)
		<-p.done
	}
	// Reap stragglers the process left in its group.
	_ = syscall.Kill(-p.pid(), syscall.SIGKILL)
}

// signal delivers sig to the process (not its group).
func (p *proc) signal(sig syscall.Signal) error {
	if p.exited() {
		return fmt.Errorf("%s has exited", p.name)
	}
	return p.cmd.Process.Signal(sig)
}

// logTail returns the last n lines of the process log, for error messages.
func (p *proc) logTail(n int) string {
	b, _ := os.ReadFile(p.logPath)
	return string(tail(b, n))
}
