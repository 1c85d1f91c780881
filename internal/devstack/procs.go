package devstack

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"syscall"
	"time"
)

// child is one aaas process of the stack, logging to its own file.
type child struct {
	name    string
	cmd     *exec.Cmd
	done    chan struct{}
	log     string
	metrics string
}

func startChild(name, bin, logDir string, env map[string]string) (*child, error) {
	logPath := filepath.Join(logDir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("%s log: %w", name, err)
	}
	cmd := exec.Command(bin)
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	sort.Strings(cmd.Env)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() { _ = cmd.Wait(); f.Close(); close(c.done) }()
	return c, nil
}

// stop sends SIGTERM and waits for a graceful exit, killing after grace.
func (c *child) stop(grace time.Duration) {
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(grace):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// wait waits for a one-shot process to finish and fails unless it
// succeeded.
func (c *child) wait(ctx context.Context, timeout time.Duration) error {
	select {
	case <-c.done:
	case <-ctx.Done():
		c.stop(time.Second)
		return ctx.Err()
	case <-time.After(timeout):
		c.stop(time.Second)
		return fmt.Errorf("%s did not finish in %s; see %s", c.name, timeout, c.log)
	}
	if code := c.cmd.ProcessState.ExitCode(); code != 0 {
		return fmt.Errorf("%s exited with status %d; see %s", c.name, code, c.log)
	}
	return nil
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}
