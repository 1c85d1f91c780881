package testenv

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// KubeWrites is every write the API server made to the SandboxClaims and
// Sandboxes of one namespace, read from etcd's own history (a watch on its
// keys, resumed at the next revision whenever etcd restarts): creations,
// updates and deletions, each with the object's UID. It is the side effect
// in Kubernetes a test counts to show a command took effect once, whoever
// carried it out and however often it was delivered; an API server restart
// loses none of it, as a watch through the API server would.
type KubeWrites struct {
	t      testing.TB
	etcd   string
	prefix map[string]string // etcd key prefix → kind
	mu     sync.Mutex
	cond   *sync.Cond
	writes []KubeWrite
	// next is the revision the watch resumes at; synced the sentinel keys
	// seen, err what ended the record.
	next   int64
	synced map[string]bool
	err    error
	syncs  int
}

// KubeWrite is one write to a claim or sandbox.
type KubeWrite struct {
	// Rev is etcd's revision of the write.
	Rev int64
	// Kind is "SandboxClaim" or "Sandbox".
	Kind, Name, UID string
	// Created: the first version of the key; Deleted: its removal (UID is
	// then the deleted object's).
	Created, Deleted bool
	// Generation counts changes to the object's spec.
	Generation int64
	// Mode is a Sandbox's spec.operatingMode, PrevMode what it was before
	// this write (empty on a creation).
	Mode, PrevMode string
	// Deleting: the object has a deletionTimestamp.
	Deleting bool
}

// The etcd keys of the two kinds (the API server stores custom resources
// as JSON under /registry/<group>/<resource>/<namespace>/<name>), and the
// sentinel keys Sync writes: no API server reads them. One watch covers the
// range from the sentinels to the claims, so the sentinel's arrival orders
// it after every write before it.
const (
	sandboxKeys  = "/registry/agents.x-k8s.io/sandboxes/"
	claimKeys    = "/registry/extensions.agents.x-k8s.io/sandboxclaims/"
	sentinelKeys = "/aaas-testenv-sync/"
)

// RecordKube starts recording the namespace's claim and sandbox writes
// from now until the test ends.
func (s *Stack) RecordKube() *KubeWrites {
	s.t.Helper()
	return recordKube(s.t, s.pkg.Cluster.EtcdURL, s.NS.Name)
}

func recordKube(t testing.TB, etcd, ns string) *KubeWrites {
	t.Helper()
	k := &KubeWrites{t: t, etcd: etcd, synced: map[string]bool{},
		prefix: map[string]string{sandboxKeys + ns + "/": "Sandbox", claimKeys + ns + "/": "SandboxClaim"}}
	k.cond = sync.NewCond(&k.mu)
	if k.etcd == "" {
		t.Fatal("testenv: the cluster has no etcd URL to record Kubernetes writes from")
	}
	var rev struct {
		Header struct {
			Revision int64 `json:"revision,string"`
		} `json:"header"`
	}
	if err := k.call(context.Background(), "/v3/kv/range", map[string]string{"key": b64(sentinelKeys)}, &rev); err != nil {
		t.Fatal(err)
	}
	k.next = rev.Header.Revision + 1
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); k.follow(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return k
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func (k *KubeWrites) call(ctx context.Context, path string, req, into any) error {
	body, _ := json.Marshal(req)
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, k.etcd+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		return fmt.Errorf("etcd %s: %w", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("etcd %s: %s %s", path, resp.Status, b)
	}
	return json.Unmarshal(b, into)
}

// follow keeps a watch open from k.next, reopening it at the next revision
// not yet seen whenever etcd goes away (RestartControlPlane stops it).
func (k *KubeWrites) follow(ctx context.Context) {
	for ctx.Err() == nil {
		err := k.watch(ctx)
		if ctx.Err() != nil {
			return
		}
		var fatal *historyLost
		if errors.As(err, &fatal) {
			k.mu.Lock()
			k.err = err
			k.cond.Broadcast()
			k.mu.Unlock()
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

type historyLost struct{ compacted int64 }

func (e *historyLost) Error() string {
	return fmt.Sprintf("etcd compacted its history to revision %d before the record read it", e.compacted)
}

type etcdKV struct {
	Key            []byte `json:"key"`
	Value          []byte `json:"value"`
	ModRevision    int64  `json:"mod_revision,string"`
	CreateRevision int64  `json:"create_revision,string"`
	Version        int64  `json:"version,string"`
}

func (k *KubeWrites) watch(ctx context.Context) error {
	k.mu.Lock()
	from := k.next
	k.mu.Unlock()
	req := map[string]any{"create_request": map[string]any{
		"key": b64(sentinelKeys), "range_end": b64(claimKeys + "\xff"), "start_revision": from, "prev_kv": true,
	}}
	body, _ := json.Marshal(req)
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, k.etcd+"/v3/watch", bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("etcd watch: %s", resp.Status)
	}
	dec := json.NewDecoder(resp.Body)
	for {
		var m struct {
			Result struct {
				CompactRevision int64 `json:"compact_revision,string"`
				Canceled        bool  `json:"canceled"`
				Events          []struct {
					Type   string  `json:"type"`
					KV     etcdKV  `json:"kv"`
					PrevKV *etcdKV `json:"prev_kv"`
				} `json:"events"`
			} `json:"result"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := dec.Decode(&m); err != nil {
			return err
		}
		if m.Error != nil {
			return errors.New(m.Error.Message)
		}
		if m.Result.CompactRevision != 0 {
			return &historyLost{m.Result.CompactRevision}
		}
		if m.Result.Canceled {
			return errors.New("etcd cancelled the watch")
		}
		k.mu.Lock()
		for _, e := range m.Result.Events {
			k.next = max(k.next, e.KV.ModRevision+1)
			if name, ok := strings.CutPrefix(string(e.KV.Key), sentinelKeys); ok {
				k.synced[name] = true
				continue
			}
			if w, ok := k.decode(e.Type == "DELETE", e.KV, e.PrevKV); ok {
				k.writes = append(k.writes, w)
			}
		}
		k.cond.Broadcast()
		k.mu.Unlock()
	}
}

// decode reads one event on a key of the namespace's claims or sandboxes.
func (k *KubeWrites) decode(deleted bool, kv etcdKV, prev *etcdKV) (KubeWrite, bool) {
	for p, kind := range k.prefix {
		name, ok := strings.CutPrefix(string(kv.Key), p)
		if !ok {
			continue
		}
		w := KubeWrite{Rev: kv.ModRevision, Kind: kind, Name: name, Deleted: deleted, Created: !deleted && kv.Version == 1}
		cur := kv
		if deleted && prev != nil {
			cur = *prev
		}
		o := k.object(cur)
		w.UID, w.Generation, w.Mode, w.Deleting = o.Metadata.UID, o.Metadata.Generation, o.Spec.OperatingMode, o.Metadata.DeletionTimestamp != nil
		if !deleted && prev != nil {
			w.PrevMode = k.object(*prev).Spec.OperatingMode
		}
		return w, true
	}
	return KubeWrite{}, false
}

// stored is what KubeWrite reads of a stored object.
type stored struct {
	Metadata struct {
		UID               string  `json:"uid"`
		Generation        int64   `json:"generation"`
		DeletionTimestamp *string `json:"deletionTimestamp"`
	} `json:"metadata"`
	Spec struct {
		OperatingMode string `json:"operatingMode"`
	} `json:"spec"`
}

func (k *KubeWrites) object(kv etcdKV) stored {
	var o stored
	if err := json.Unmarshal(kv.Value, &o); err != nil {
		k.t.Errorf("testenv: %s in etcd is not JSON: %v", kv.Key, err)
	}
	return o
}

// Sync waits until the record holds every write made before it was
// called: it writes a sentinel key into the watched range and waits for
// the watch to bring it.
func (k *KubeWrites) Sync() {
	k.t.Helper()
	k.mu.Lock()
	k.syncs++
	name := strconv.Itoa(k.syncs) + "." + strconv.FormatInt(time.Now().UnixNano(), 10)
	k.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var put struct{}
	// etcd may be restarting: ask until it answers.
	for {
		err := k.call(ctx, "/v3/kv/put", map[string]string{"key": b64(sentinelKeys + name), "value": b64("sync")}, &put)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			k.t.Fatalf("testenv: the Kubernetes record cannot sync: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop := context.AfterFunc(ctx, func() { k.mu.Lock(); k.cond.Broadcast(); k.mu.Unlock() })
	defer stop()
	k.mu.Lock()
	defer k.mu.Unlock()
	for !k.synced[name] && k.err == nil && ctx.Err() == nil {
		k.cond.Wait()
	}
	if k.err != nil {
		k.t.Fatalf("testenv: the Kubernetes record is incomplete: %v", k.err)
	}
	if !k.synced[name] {
		k.t.Fatal("testenv: the Kubernetes record did not catch up with etcd within 2 minutes")
	}
	// The sentinel has served its purpose.
	_ = k.call(context.Background(), "/v3/kv/deleterange", map[string]string{"key": b64(sentinelKeys + name)}, &put)
}

// Mark is a point in the record (after Sync: every write so far) that
// Since counts from.
func (k *KubeWrites) Mark() int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.next
}

// Since is the writes of kind and name at or after mark, oldest first;
// an empty name is every object of the kind.
func (k *KubeWrites) Since(mark int64, kind, name string) []KubeWrite {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []KubeWrite
	for _, w := range k.writes {
		if w.Rev >= mark && w.Kind == kind && (name == "" || w.Name == name) {
			out = append(out, w)
		}
	}
	return out
}

// Created counts creations among writes.
func Created(writes []KubeWrite) int {
	n := 0
	for _, w := range writes {
		if w.Created {
			n++
		}
	}
	return n
}

// Deleted counts deletions among writes.
func Deleted(writes []KubeWrite) int {
	n := 0
	for _, w := range writes {
		if w.Deleted {
			n++
		}
	}
	return n
}

// ModeChanges are the changes of a Sandbox's operating mode among writes,
// in order, as "Suspended→Running" (a write that kept the mode is none).
func ModeChanges(writes []KubeWrite) []string {
	var out []string
	for _, w := range writes {
		if !w.Created && !w.Deleted && w.Mode != w.PrevMode {
			out = append(out, w.PrevMode+"→"+w.Mode)
		}
	}
	return out
}

// UIDs are the distinct object UIDs among writes, in order of appearance.
func UIDs(writes []KubeWrite) []string {
	var out []string
	seen := map[string]bool{}
	for _, w := range writes {
		if !seen[w.UID] {
			seen[w.UID] = true
			out = append(out, w.UID)
		}
	}
	return out
}
