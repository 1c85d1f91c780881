// Package backup copies what aaas keeps in NATS — every stream and every
// bucket (a bucket is the stream KV_<bucket>) — to a directory and back,
// through the JetStream stream snapshot API: each stream's copy is
// consistent in itself and is taken while the system runs; a restore
// recreates the streams (consumers and their acknowledged positions
// included) in a NATS that lost them.
//
// A backup directory holds <stream>.snap per stream (the server's snapshot
// archive, as it sent it) and manifest.json, written last: the streams'
// configurations and states as they were, each file's size and SHA-256.
// A directory without a manifest is not a backup; a file that does not
// match its checksum stops a restore before it touches anything.
package backup

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
)

// Format is the manifest's format version; Restore refuses others.
const Format = 1

// ManifestFile is the manifest's name in a backup directory.
const ManifestFile = "manifest.json"

// chunkSize is the size of the chunks a snapshot is sent and restored in:
// the server's default.
const chunkSize = 128 << 10

// Manifest describes a backup.
type Manifest struct {
	Format int `json:"format"`
	// Version is the aaas release that took it (a restore into another
	// release is allowed: records carry their own schema version).
	Version string    `json:"version"`
	Taken   time.Time `json:"taken"`
	Streams []Stream  `json:"streams"`
}

// Stream is one stream's copy.
type Stream struct {
	Name     string `json:"name"`
	Messages uint64 `json:"messages"`
	File     string `json:"file"`
	Size     int64  `json:"size"`
	SHA256   string `json:"sha256"`
	// Config and State are the server's, as the snapshot answered them;
	// a restore hands them back unchanged.
	Config json.RawMessage `json:"config"`
	State  json.RawMessage `json:"state"`
}

// Options name what to copy and how.
type Options struct {
	// Streams are the streams to copy, in order.
	Streams []string
	// Inbox is the prefix of subjects this identity may subscribe to
	// (natsauth.Role.InboxPrefix): the snapshot's chunks arrive there.
	Inbox string
	// Version goes into the manifest.
	Version string
	// Replace lets Restore delete a stream that exists (a NATS started
	// empty has them back as soon as setup ran, filling).
	Replace bool
	// Progress, if set, hears of each stream done.
	Progress func(s Stream)
}

// Backup copies every stream o names into dir, which must not exist or
// be empty, and writes the manifest last.
func Backup(ctx context.Context, nc *nats.Conn, dir string, o Options) (Manifest, error) {
	if err := emptyDir(dir); err != nil {
		return Manifest{}, err
	}
	m := Manifest{Format: Format, Version: o.Version, Taken: time.Now().UTC()}
	for _, name := range o.Streams {
		s, err := snapshot(ctx, nc, dir, name, o.Inbox)
		if err != nil {
			return m, fmt.Errorf("back up stream %s: %w", name, err)
		}
		m.Streams = append(m.Streams, s)
		if o.Progress != nil {
			o.Progress(s)
		}
	}
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return m, err
	}
	return m, writeFile(filepath.Join(dir, ManifestFile), append(data, '\n'))
}

// emptyDir makes dir, or accepts it empty: a backup never mixes with
// another's files.
func emptyDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) > 0 {
		return fmt.Errorf("%s is not empty: a backup goes into a new directory", dir)
	}
	return nil
}

// apiError is the error part of every JetStream API response.
type apiError struct {
	Error *struct {
		Code        int    `json:"code"`
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error,omitempty"`
}

func (e apiError) err() error {
	if e.Error == nil {
		return nil
	}
	return fmt.Errorf("%s (%d)", e.Error.Description, e.Error.ErrCode)
}

// snapshot asks the server for name's snapshot, delivered in chunks to a
// subject of the identity's inbox, each acknowledged (the server keeps a
// window of them in flight), and writes them to dir/<name>.snap.
func snapshot(ctx context.Context, nc *nats.Conn, dir, name, inbox string) (Stream, error) {
	deliver := inbox + "." + nuid.Next()
	sub, err := nc.SubscribeSync(deliver)
	if err != nil {
		return Stream{}, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	// The server's window (8 MiB) bounds what is pending here.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return Stream{}, err
	}
	req, _ := json.Marshal(map[string]any{"deliver_subject": deliver, "chunk_size": chunkSize, "jsck": true})
	msg, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.SNAPSHOT."+name, req)
	if err != nil {
		return Stream{}, err
	}
	var resp struct {
		apiError
		Config json.RawMessage `json:"config"`
		State  json.RawMessage `json:"state"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return Stream{}, fmt.Errorf("snapshot response: %w", err)
	}
	if err := resp.err(); err != nil {
		return Stream{}, err
	}
	var st struct {
		Msgs uint64 `json:"messages"`
	}
	_ = json.Unmarshal(resp.State, &st)

	s := Stream{Name: name, Messages: st.Msgs, File: name + ".snap", Config: resp.Config, State: resp.State}
	f, err := os.OpenFile(filepath.Join(dir, s.File), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return s, err
	}
	defer f.Close()
	sum := sha256.New()
	w := io.MultiWriter(f, sum)
	for {
		chunk, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return s, err
		}
		if len(chunk.Data) == 0 {
			// The end: a status of 204 (or none, for an empty stream)
			// says it is whole; anything else is why not.
			if code := chunk.Header.Get("Status"); code != "" && code != "204" {
				return s, fmt.Errorf("server ended the snapshot: %s %s", code, chunk.Header.Get("Description"))
			}
			break
		}
		if _, err := w.Write(chunk.Data); err != nil {
			return s, err
		}
		s.Size += int64(len(chunk.Data))
		if chunk.Reply != "" {
			if err := nc.Publish(chunk.Reply, nil); err != nil {
				return s, err
			}
		}
	}
	if err := f.Sync(); err != nil {
		return s, err
	}
	s.SHA256 = hex.EncodeToString(sum.Sum(nil))
	return s, f.Close()
}

func writeFile(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Read reads and checks a backup directory's manifest, and every file's
// size and checksum against it.
func Read(dir string) (Manifest, error) {
	data, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return Manifest{}, fmt.Errorf("%s holds no backup: %w", dir, err)
	}
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return m, fmt.Errorf("%s: %w", ManifestFile, err)
	}
	if m.Format != Format {
		return m, fmt.Errorf("%s: format %d, this release reads %d", ManifestFile, m.Format, Format)
	}
	for _, s := range m.Streams {
		// The name goes into API subjects: no token separators, no
		// wildcards, nothing but a stream name.
		if !streamName.MatchString(s.Name) {
			return m, fmt.Errorf("%s: %q is not a stream name", ManifestFile, s.Name)
		}
		if s.File != filepath.Base(s.File) || !strings.HasSuffix(s.File, ".snap") {
			return m, fmt.Errorf("%s: stream %s names file %q outside the backup", ManifestFile, s.Name, s.File)
		}
		size, sum, err := digest(filepath.Join(dir, s.File))
		if err != nil {
			return m, err
		}
		if size != s.Size || sum != s.SHA256 {
			return m, fmt.Errorf("%s does not match the manifest (size %d, sha256 %s; want %d, %s): the backup is damaged", s.File, size, sum, s.Size, s.SHA256)
		}
	}
	return m, nil
}

func digest(path string) (int64, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	var h hash.Hash = sha256.New()
	n, err := io.Copy(h, f)
	return n, hex.EncodeToString(h.Sum(nil)), err
}

var streamName = regexp.MustCompile(`^[A-Za-z0-9_-]{1,255}$`)

// ErrExists is Restore's refusal to replace a stream without Replace.
var ErrExists = errors.New("stream exists")

// Restore recreates every stream of the backup in dir that o.Streams
// names (all of them when o.Streams is empty), after checking the whole
// backup. A stream that exists is deleted first with o.Replace and is
// otherwise a refusal, before anything changed.
func Restore(ctx context.Context, nc *nats.Conn, dir string, o Options) (Manifest, error) {
	m, err := Read(dir)
	if err != nil {
		return m, err
	}
	var todo []Stream
	for _, s := range m.Streams {
		if len(o.Streams) == 0 || slices.Contains(o.Streams, s.Name) {
			todo = append(todo, s)
		}
	}
	var existing []string
	for _, s := range todo {
		ok, err := exists(ctx, nc, s.Name)
		if err != nil {
			return m, err
		}
		if ok {
			existing = append(existing, s.Name)
		}
	}
	if len(existing) > 0 && !o.Replace {
		return m, fmt.Errorf("%w: %s; a restore replaces them only when told to (-replace)", ErrExists, strings.Join(existing, ", "))
	}
	for _, s := range todo {
		if slices.Contains(existing, s.Name) {
			if err := request(ctx, nc, "$JS.API.STREAM.DELETE."+s.Name, nil, nil); err != nil {
				return m, fmt.Errorf("delete stream %s: %w", s.Name, err)
			}
		}
		n, err := restore(ctx, nc, dir, s)
		if err != nil {
			return m, fmt.Errorf("restore stream %s: %w", s.Name, err)
		}
		if o.Progress != nil {
			s.Messages = n
			o.Progress(s)
		}
	}
	return m, nil
}

func exists(ctx context.Context, nc *nats.Conn, name string) (bool, error) {
	err := request(ctx, nc, "$JS.API.STREAM.INFO."+name, nil, nil)
	var notFound *notFoundError
	switch {
	case errors.As(err, &notFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("stream %s: %w", name, err)
	}
	return true, nil
}

type notFoundError struct{ error }

// request sends a JetStream API request and decodes the response into
// out (nil: only its error).
func request(ctx context.Context, nc *nats.Conn, subject string, body []byte, out any) error {
	msg, err := nc.RequestWithContext(ctx, subject, body)
	if err != nil {
		return err
	}
	if len(msg.Data) == 0 && out == nil {
		return nil // a restore chunk taken
	}
	var e apiError
	if err := json.Unmarshal(msg.Data, &e); err != nil {
		return fmt.Errorf("response to %s: %w", subject, err)
	}
	if err := e.err(); err != nil {
		if e.Error.Code == 404 {
			return &notFoundError{err}
		}
		return err
	}
	if out != nil {
		return json.Unmarshal(msg.Data, out)
	}
	return nil
}

// restore asks the server to take a stream's snapshot and sends the file
// in chunks, each answered before the next; an empty message ends it,
// and its answer says whether the stream came back and with how many
// messages (fewer than the backup's when some outlived their stream's
// age limit meanwhile: the server drops those as it loads them).
func restore(ctx context.Context, nc *nats.Conn, dir string, s Stream) (uint64, error) {
	body, _ := json.Marshal(map[string]json.RawMessage{"config": s.Config, "state": s.State})
	var resp struct {
		DeliverSubject string `json:"deliver_subject"`
	}
	if err := request(ctx, nc, "$JS.API.STREAM.RESTORE."+s.Name, body, &resp); err != nil {
		return 0, err
	}
	f, err := os.Open(filepath.Join(dir, s.File))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, chunkSize)
	for {
		n, err := io.ReadFull(f, buf)
		if n > 0 {
			// An empty answer takes the chunk; one with a body refuses it.
			if err := request(ctx, nc, resp.DeliverSubject, buf[:n], nil); err != nil {
				return 0, err
			}
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if err != nil {
			return 0, err
		}
	}
	var done struct {
		State struct {
			Msgs uint64 `json:"messages"`
		} `json:"state"`
	}
	if err := request(ctx, nc, resp.DeliverSubject, nil, &done); err != nil {
		return 0, err
	}
	return done.State.Msgs, nil
}

// WriteTar writes the backup in dir to w as a tar archive of its files
// (setup backup -: the image has no shell or tar to pack it with).
func WriteTar(dir string, w io.Writer) error {
	m, err := Read(dir)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	files := []string{ManifestFile}
	for _, s := range m.Streams {
		files = append(files, s.File)
	}
	for _, name := range files {
		if err := addFile(tw, dir, name); err != nil {
			return err
		}
	}
	return tw.Close()
}

func addFile(tw *tar.Writer, dir, name string) error {
	f, err := os.Open(filepath.Join(dir, name))
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: st.Size(), ModTime: st.ModTime(), Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}

// ReadTar unpacks a tar archive WriteTar made into dir (new or empty):
// regular files with plain names only, so an archive cannot write
// outside dir. Read then checks what it holds.
func ReadTar(r io.Reader, dir string) error {
	if err := emptyDir(dir); err != nil {
		return err
	}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("backup archive: %w", err)
		}
		if h.Typeflag != tar.TypeReg || h.Name != filepath.Base(h.Name) || h.Name == "." || h.Name == ".." ||
			(h.Name != ManifestFile && !strings.HasSuffix(h.Name, ".snap")) {
			return fmt.Errorf("backup archive: %q is not a file of a backup", h.Name)
		}
		f, err := os.OpenFile(filepath.Join(dir, h.Name), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("backup archive: %w", err)
		}
		_, err = io.Copy(f, tr)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("backup archive: %s: %w", h.Name, err)
		}
	}
}
