package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The real binary, run as a child process: it names the port it bound,
// serves, refuses to start without keys and exits 0 on SIGTERM, cutting
// the streams still open.

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "providersim-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "providersim")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build providersim: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func TestServesAndStopsOnSIGTERM(t *testing.T) {
	cmd := exec.Command(binary)
	cmd.Env = []string{"PROVIDERSIM_LISTEN=127.0.0.1:0", "PROVIDERSIM_KEYS=sk-bin-test-5678"}
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "providersim: listening on ")
	if err != nil || !ok {
		t.Fatalf("first line %q, %v", line, err)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer sk-bin-test-5678")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	err = json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || err != nil || answer.Usage.PromptTokens != 1 {
		t.Fatalf("chat = %d %+v %v", resp.StatusCode, answer, err)
	}
	// A -long stream never ends by itself; shutting down ends it.
	req, _ = http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions", strings.NewReader(`{"model":"m-long","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer sk-bin-test-5678")
	long, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Body.Close()
	if line, err := bufio.NewReader(long.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("-long stream began with %q, %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("still running 30s after SIGTERM")
	}
}

func TestRefusesToStartWithoutKeys(t *testing.T) {
	cmd := exec.Command(binary)
	cmd.Env = []string{"PROVIDERSIM_LISTEN=127.0.0.1:0"}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), "PROVIDERSIM_KEYS is required") {
		t.Fatalf("without keys: %v %q", err, out)
	}
}
