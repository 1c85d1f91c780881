// Package child runs the processes the dev and test tooling starts: the
// dev control plane's etcd, API servers and simulated containers
// (devcluster), make run's aaas processes (devstack), and the integration
// tests' aaas processes, nginx and Node.js upstream (testenv). Each runs in
// its own process group, so stopping it stops anything it started, and
// dies with us if we are killed; its output goes to a log file or to a
// writer of the caller's.
package child

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"syscall"
	"time"
)

// Options describe a process to start.
type Options struct {
	// Name is what errors call the process.
	Name string
	// Path is the binary (looked up in PATH when it has no slash).
	Path string
	Args []string
	// Env is the whole environment (see Environ); nil inherits ours.
	Env []string
	Dir string
	// Log, when set, is the file stdout and stderr are appended to
	// (created 0600). Otherwise they go to Output (nil discards them).
	Log    string
	Output io.Writer
}

// Process is a started child.
type Process struct {
	name string
	log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // what Wait returned, valid once done is closed
}

// Start starts the process; a goroutine reaps it when it exits.
func Start(o Options) (*Process, error) {
	out := o.Output
	var logf *os.File
	if o.Log != "" {
		f, err := os.OpenFile(o.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			return nil, fmt.Errorf("%s log: %w", o.Name, err)
		}
		logf, out = f, f
	}
	cmd := exec.Command(o.Path, o.Args...)
	cmd.Env, cmd.Dir = o.Env, o.Dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		if logf != nil {
			logf.Close()
		}
		return nil, fmt.Errorf("start %s: %w", o.Name, err)
	}
	p := &Process{name: o.Name, log: o.Log, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		if logf != nil {
			logf.Close()
		}
		close(p.done)
	}()
	return p, nil
}

// Environ turns env into a sorted KEY=value list for Options.Env.
func Environ(env map[string]string) []string {
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// Name is Options.Name.
func (p *Process) Name() string { return p.name }

// LogPath is Options.Log.
func (p *Process) LogPath() string { return p.log }

// PID is the process id (and the id of its process group).
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Done is closed once the process has ended and been reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Err is how the process ended (nil for status 0), once Exited.
func (p *Process) Err() error { return p.err }

// ExitCode is the exit status once Exited (-1 if a signal ended it).
func (p *Process) ExitCode() int { return p.cmd.ProcessState.ExitCode() }

// Signal delivers sig to the process (not its group).
func (p *Process) Signal(sig syscall.Signal) error {
	if p.Exited() {
		return fmt.Errorf("%s has exited", p.name)
	}
	return p.cmd.Process.Signal(sig)
}

// Stop sends SIGTERM to the process group, waits up to grace, then kills
// the group. It returns once the process has been reaped.
func (p *Process) Stop(grace time.Duration) {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(-p.PID(), syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
		<-p.done
	}
	// Reap stragglers the process left in its group.
	_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
}

// Kill ends the process group with SIGKILL (no shutdown code runs) and
// returns once the process has been reaped.
func (p *Process) Kill() {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
	<-p.done
}

// Wait waits for a one-shot process to finish and fails unless it exited
// with status 0; one still running when ctx ends or timeout passes is
// stopped.
func (p *Process) Wait(ctx context.Context, timeout time.Duration) error {
	select {
	case <-p.done:
	case <-ctx.Done():
		p.Stop(time.Second)
		return ctx.Err()
	case <-time.After(timeout):
		p.Stop(time.Second)
		return fmt.Errorf("%s did not finish in %s", p.name, timeout)
	}
	if code := p.ExitCode(); code != 0 {
		return fmt.Errorf("%s exited with status %d", p.name, code)
	}
	return nil
}

// LogTail returns the last n lines of the log file, for error messages.
func (p *Process) LogTail(n int) string {
	b, _ := os.ReadFile(p.log)
	return string(Tail(b, n))
}

// Tail returns the last n lines of b.
func Tail(b []byte, n int) []byte {
	if n == 0 {
		return nil
	}
	end := len(b)
	if end > 0 && b[end-1] == '\n' {
		end--
	}
	for i := end - 1; i >= 0; i-- {
		if b[i] == '\n' {
			n--
			if n == 0 {
				return b[i+1:]
			}
		}
	}
	return b
}
