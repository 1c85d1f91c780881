package backup_test

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/backup"
	"github.com/aaas-project/aaas/internal/dev/embednats"
	"github.com/aaas-project/aaas/internal/dev/embednats/natstest"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/state"
)

// world is a NATS server with the production identities, its store in a
// directory the test can destroy.
type world struct {
	t   *testing.T
	ids *natsauth.Identities
	srv *embednats.Server
	dir string
}

func newWorld(t *testing.T) *world {
	ids, err := natsauth.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, ids: ids, dir: t.TempDir()}
	w.srv = natstest.StartWith(t, embednats.Options{Dir: w.dir, Users: ids.Users()})
	return w
}

// as connects with role's identity and inbox.
func (w *world) as(role natsauth.Role) (*nats.Conn, jetstream.JetStream) {
	return natstest.Connect(w.t, w.srv.URL(), natstest.As(w.t, w.ids, role), nats.CustomInboxPrefix(role.InboxPrefix()))
}

// provision is the setup step: every stream, bucket and the consumer.
func (w *world) provision() {
	_, js := w.as(natsauth.Setup)
	ctx := natstest.Context(w.t, time.Minute)
	if err := events.EnsureStreams(ctx, js, events.DefaultStreamsConfig()); err != nil {
		w.t.Fatal(err)
	}
	if err := state.EnsureBuckets(ctx, js, state.DefaultBucketsConfig()); err != nil {
		w.t.Fatal(err)
	}
	if _, err := events.EnsureConsumer(ctx, js, events.CommandConsumerConfig(1, 5, time.Minute)); err != nil {
		w.t.Fatal(err)
	}
}

// lose destroys NATS and its data and starts it again, empty.
func (w *world) lose() {
	w.srv.Stop()
	if err := os.RemoveAll(w.dir); err != nil {
		w.t.Fatal(err)
	}
	s, err := w.srv.Restart()
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(s.Stop)
	w.srv = s
}

// The drill: a running system's state is backed up with the backup
// identity, NATS loses everything, setup recreates the streams empty
// (and a process writes into them at once), and a restore with the setup
// identity brings back accounts, sessions, usage, audit and the command
// queue with its consumer's position: a command already taken is not
// delivered again, one still waiting is.
func TestBackupAndRestoreAfterNATSLostEverything(t *testing.T) {
	w := newWorld(t)
	w.provision()
	ctx := natstest.Context(t, 2*time.Minute)
	_, js := w.as(natsauth.Admin)
	users, _ := kv.Open[state.User](ctx, js, state.BucketUsers)
	sessions, _ := kv.Open[state.Session](ctx, js, state.BucketSessions)
	usage, _ := kv.Open[state.Usage](ctx, js, state.BucketUsage)
	for i := range 300 {
		u := fmt.Sprintf("user%03d", i)
		if _, err := users.Put(ctx, u, state.User{Name: u, TokenHash: strings.Repeat("a", 64)}); err != nil {
			t.Fatal(err)
		}
		if _, err := sessions.Put(ctx, state.SessionKey(u, fmt.Sprintf("%064x", i)), state.Session{User: u, Created: time.Now(), Expires: time.Now().Add(time.Hour)}); err != nil {
			t.Fatal(err)
		}
		if _, err := usage.Put(ctx, u+".2026-12", state.Usage{Calls: int64(i + 1)}); err != nil {
			t.Fatal(err)
		}
	}
	// A megabyte of audit, to span many snapshot chunks.
	for range 1000 {
		data, _ := json.Marshal(events.AuditEvent{Kind: events.AuditLogin, User: "user001", Detail: strings.Repeat("x", 1000), At: time.Now()})
		if _, err := js.Publish(ctx, events.AuditEvent{Kind: events.AuditLogin, User: "user001"}.Subject(), data); err != nil {
			t.Fatal(err)
		}
	}
	// Two commands: the first taken and acknowledged, the second waiting.
	for _, u := range []string{"taken", "waiting"} {
		data, _ := json.Marshal(events.Command{V: events.SchemaVersion, Verb: events.VerbWake, User: u})
		if _, err := js.Publish(ctx, events.CommandSubject(events.VerbWake, u), data); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := js.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
	if err != nil {
		t.Fatal(err)
	}
	first, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := first.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}

	// The backup identity may copy, and nothing else.
	// (A refused request goes unanswered: each waits out a short deadline.)
	bnc, bjs := w.as(natsauth.Backup)
	if _, err := bjs.Publish(natstest.Context(t, time.Second), events.AuditEvent{Kind: events.AuditLogin, User: "x"}.Subject(), []byte("{}")); err == nil {
		t.Fatal("the backup identity published an audit event")
	}
	if err := bjs.DeleteStream(natstest.Context(t, time.Second), events.StreamAudit); err == nil {
		t.Fatal("the backup identity deleted a stream")
	}
	if info, err := js.Stream(ctx, events.StreamAudit); err != nil || info.CachedInfo().State.Msgs != 1000 {
		t.Fatalf("the audit stream after the backup identity's attempts: %v", err)
	}
	dir := filepath.Join(t.TempDir(), "backup")
	m, err := backup.Backup(ctx, bnc, dir, backup.Options{Streams: natsauth.Streams(), Inbox: natsauth.Backup.InboxPrefix(), Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Streams) != len(natsauth.Streams()) {
		t.Fatalf("backed up %d streams, want %d", len(m.Streams), len(natsauth.Streams()))
	}
	if _, err := backup.Backup(ctx, bnc, dir, backup.Options{Streams: natsauth.Streams(), Inbox: natsauth.Backup.InboxPrefix()}); err == nil {
		t.Fatal("a second backup went into a directory holding one")
	}

	// NATS loses everything; setup recreates the streams; something writes.
	w.lose()
	w.provision()
	_, js = w.as(natsauth.Admin)
	users, _ = kv.Open[state.User](ctx, js, state.BucketUsers)
	if _, err := users.Get(ctx, "user001"); !errors.Is(err, kv.ErrNotFound) {
		t.Fatalf("the data survived its loss (%v): the drill proves nothing", err)
	}
	if _, err := users.Put(ctx, "newcomer", state.User{Name: "newcomer"}); err != nil {
		t.Fatal(err)
	}

	// The restore refuses to replace what exists unless told to, and
	// changes nothing then.
	rnc, _ := w.as(natsauth.Setup)
	if _, err := backup.Restore(ctx, rnc, dir, backup.Options{}); !errors.Is(err, backup.ErrExists) {
		t.Fatalf("restore over existing streams: %v", err)
	}
	if _, err := users.Get(ctx, "newcomer"); err != nil {
		t.Fatalf("a refused restore changed the bucket: %v", err)
	}
	restored := map[string]uint64{}
	if _, err := backup.Restore(ctx, rnc, dir, backup.Options{Replace: true, Progress: func(s backup.Stream) { restored[s.Name] = s.Messages }}); err != nil {
		t.Fatal(err)
	}
	for _, s := range m.Streams {
		if restored[s.Name] != s.Messages {
			t.Errorf("%s: %d messages restored, %d backed up", s.Name, restored[s.Name], s.Messages)
		}
	}

	users, _ = kv.Open[state.User](ctx, js, state.BucketUsers)
	sessions, _ = kv.Open[state.Session](ctx, js, state.BucketSessions)
	usage, _ = kv.Open[state.Usage](ctx, js, state.BucketUsage)
	for _, i := range []int{0, 150, 299} {
		u := fmt.Sprintf("user%03d", i)
		if e, err := users.Get(ctx, u); err != nil || e.Value.Name != u {
			t.Errorf("user %s: %+v %v", u, e, err)
		}
		if e, err := sessions.Get(ctx, state.SessionKey(u, fmt.Sprintf("%064x", i))); err != nil || e.Value.User != u {
			t.Errorf("session of %s: %+v %v", u, e, err)
		}
		if e, err := usage.Get(ctx, u+".2026-12"); err != nil || e.Value.Calls != int64(i+1) {
			t.Errorf("usage of %s: %+v %v", u, e, err)
		}
	}
	audit, err := js.Stream(ctx, events.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	if info, err := audit.Info(ctx); err != nil || info.State.Msgs != 1000 {
		t.Errorf("audit: %+v %v, want 1000 events", info, err)
	}
	cons, err = js.Consumer(ctx, events.StreamCommands, events.CommandConsumer)
	if err != nil {
		t.Fatal(err)
	}
	next, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if c, err := events.Decode[events.Command](next.Data()); err != nil || c.User != "waiting" {
		t.Fatalf("the restored queue delivered %+v %v, want the waiting command only", c, err)
	}
}

// A damaged backup is refused before anything is touched: a changed
// byte, a missing file, a manifest naming a file outside the directory.
func TestRestoreRefusesADamagedBackup(t *testing.T) {
	w := newWorld(t)
	w.provision()
	ctx := natstest.Context(t, time.Minute)
	bnc, _ := w.as(natsauth.Backup)
	dir := filepath.Join(t.TempDir(), "b")
	if _, err := backup.Backup(ctx, bnc, dir, backup.Options{Streams: []string{events.StreamAudit, "KV_" + state.BucketUsers}, Inbox: natsauth.Backup.InboxPrefix()}); err != nil {
		t.Fatal(err)
	}
	if _, err := backup.Read(dir); err != nil {
		t.Fatalf("the intact backup: %v", err)
	}
	snap := filepath.Join(dir, events.StreamAudit+".snap")
	data, _ := os.ReadFile(snap)
	data[len(data)/2] ^= 1
	if err := os.WriteFile(snap, data, 0o600); err != nil {
		t.Fatal(err)
	}
	rnc, _ := w.as(natsauth.Setup)
	if _, err := backup.Restore(ctx, rnc, dir, backup.Options{Replace: true}); err == nil || !strings.Contains(err.Error(), "damaged") {
		t.Fatalf("a changed byte: %v", err)
	}
	_, js := w.as(natsauth.Admin)
	if _, err := js.Stream(ctx, events.StreamAudit); err != nil {
		t.Fatalf("a refused restore removed the stream: %v", err)
	}
	data[len(data)/2] ^= 1
	if err := os.WriteFile(snap, data, 0o600); err != nil {
		t.Fatal(err)
	}

	m, _ := os.ReadFile(filepath.Join(dir, backup.ManifestFile))
	escaped := strings.Replace(string(m), `"file": "KV_users.snap"`, `"file": "../KV_users.snap"`, 1)
	if escaped == string(m) {
		t.Fatal("the manifest does not name KV_users.snap: the test proves nothing")
	}
	if err := os.WriteFile(filepath.Join(dir, backup.ManifestFile), []byte(escaped), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := backup.Read(dir); err == nil || !strings.Contains(err.Error(), "outside the backup") {
		t.Fatalf("a file outside the backup: %v", err)
	}
	// A name that would be a wildcard in the API's subjects.
	wild := strings.Replace(string(m), `"name": "AAAS_AUDIT"`, `"name": "*"`, 1)
	if wild == string(m) {
		t.Fatal("the manifest does not name AAAS_AUDIT: the test proves nothing")
	}
	if err := os.WriteFile(filepath.Join(dir, backup.ManifestFile), []byte(wild), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := backup.Read(dir); err == nil || !strings.Contains(err.Error(), "is not a stream name") {
		t.Fatalf("a wildcard stream name: %v", err)
	}
	if _, err := backup.Read(t.TempDir()); err == nil {
		t.Fatal("an empty directory read as a backup")
	}
}

// A backup travels as a tar archive (setup backup -, from an image with
// no shell) and comes back whole; an archive holding anything but a
// backup's plain files is refused before it writes outside its directory.
func TestTarRoundTripAndHostileArchives(t *testing.T) {
	w := newWorld(t)
	w.provision()
	ctx := natstest.Context(t, time.Minute)
	bnc, _ := w.as(natsauth.Backup)
	dir := filepath.Join(t.TempDir(), "b")
	if _, err := backup.Backup(ctx, bnc, dir, backup.Options{Streams: []string{events.StreamAudit, "KV_" + state.BucketUsers}, Inbox: natsauth.Backup.InboxPrefix()}); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := backup.WriteTar(dir, &buf); err != nil {
		t.Fatal(err)
	}
	back := filepath.Join(t.TempDir(), "back")
	if err := backup.ReadTar(bytes.NewReader(buf.Bytes()), back); err != nil {
		t.Fatal(err)
	}
	if m, err := backup.Read(back); err != nil || len(m.Streams) != 2 {
		t.Fatalf("the unpacked backup: %+v %v", m, err)
	}

	parent := t.TempDir()
	for name, h := range map[string]tar.Header{
		"a path out":   {Name: "../escaped.snap", Typeflag: tar.TypeReg, Size: 1, Mode: 0o600},
		"a directory":  {Name: "sub/x.snap", Typeflag: tar.TypeReg, Size: 1, Mode: 0o600},
		"a symlink":    {Name: "link.snap", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"},
		"another file": {Name: "run.sh", Typeflag: tar.TypeReg, Size: 1, Mode: 0o700},
	} {
		var a bytes.Buffer
		tw := tar.NewWriter(&a)
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			_, _ = tw.Write([]byte("x"))
		}
		_ = tw.Close()
		into := filepath.Join(parent, strings.ReplaceAll(name, " ", "-"))
		if err := backup.ReadTar(&a, into); err == nil || !strings.Contains(err.Error(), "is not a file of a backup") {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(parent, "escaped.snap")); err == nil {
		t.Error("an archive wrote outside its directory")
	}
}
