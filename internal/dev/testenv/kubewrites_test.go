package testenv

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"
	"time"
)

// startEtcd runs Debian's etcd on free loopback ports until the test
// ends; restart stops it (SIGTERM) and starts it again on the same data.
func startEtcd(t *testing.T) (url string, restart func()) {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("etcd not on PATH (make tools installs Debian's etcd-server)")
	}
	dir := t.TempDir()
	url, peer := "http://"+FreeAddr(t), "http://"+FreeAddr(t)
	var cmd *exec.Cmd
	start := func() {
		cmd = exec.Command(bin, "--data-dir="+filepath.Join(dir, "data"), "--listen-client-urls="+url, "--advertise-client-urls="+url,
			"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer, "--initial-cluster=default="+peer, "--log-level=warn")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		k := &KubeWrites{t: t, etcd: url}
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			var out struct{}
			if k.call(context.Background(), "/v3/kv/range", map[string]string{"key": b64("/")}, &out) == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("etcd not up")
			}
		}
	}
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}
	start()
	t.Cleanup(stop)
	return url, func() { stop(); start() }
}

// The record holds every write to the namespace's claims and sandboxes,
// with creations, mode changes and deletions, and nothing of another
// namespace; an etcd restart in the middle loses none.
func TestKubeWritesRecordsEveryWriteAcrossAnEtcdRestart(t *testing.T) {
	url, restart := startEtcd(t)
	k := recordKube(t, url, "ns1")
	put := func(key, obj string) {
		t.Helper()
		var out struct{}
		if err := k.call(context.Background(), "/v3/kv/put", map[string]string{"key": b64(key), "value": b64(obj)}, &out); err != nil {
			t.Fatal(err)
		}
	}
	del := func(key string) {
		t.Helper()
		var out struct{}
		if err := k.call(context.Background(), "/v3/kv/deleterange", map[string]string{"key": b64(key)}, &out); err != nil {
			t.Fatal(err)
		}
	}
	sb := func(uid, mode string) string {
		return fmt.Sprintf(`{"kind":"Sandbox","metadata":{"uid":%q,"generation":1},"spec":{"operatingMode":%q}}`, uid, mode)
	}
	put(claimKeys+"ns1/dsh-a", `{"metadata":{"uid":"c1"}}`)
	put(sandboxKeys+"ns1/pool-x", sb("s1", "Running"))
	put(claimKeys+"ns2/dsh-a", `{"metadata":{"uid":"other"}}`)
	k.Sync()
	mark := k.Mark()
	put(sandboxKeys+"ns1/pool-x", sb("s1", "Suspended"))
	restart()
	// While etcd was away and after: the watch resumes where it stopped.
	put(sandboxKeys+"ns1/pool-x", sb("s1", "Running"))
	del(claimKeys + "ns1/dsh-a")
	put(claimKeys+"ns1/dsh-a", `{"metadata":{"uid":"c2"}}`)
	k.Sync()

	claims := k.Since(0, "SandboxClaim", "dsh-a")
	if got := UIDs(claims); !reflect.DeepEqual(got, []string{"c1", "c2"}) {
		t.Errorf("claim UIDs %v, want [c1 c2] (ns2's claim is another namespace's)", got)
	}
	if Created(claims) != 2 || Deleted(claims) != 1 {
		t.Errorf("claims: %d created, %d deleted, want 2 and 1: %+v", Created(claims), Deleted(claims), claims)
	}
	if got := ModeChanges(k.Since(mark, "Sandbox", "")); !reflect.DeepEqual(got, []string{"Running→Suspended", "Suspended→Running"}) {
		t.Errorf("mode changes since the mark %v", got)
	}
	if got := k.Since(mark, "SandboxClaim", ""); len(got) != 2 {
		t.Errorf("claim writes since the mark %+v, want the delete and the new create", got)
	}
}
