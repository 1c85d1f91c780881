package dshsim

import (
	"bufio"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/fasthttp/websocket"
)

var (
	//go:embed web/index.html
	indexHTML []byte
	//go:embed web/app.js
	appJS []byte
	//go:embed web/style.css
	styleCSS []byte
	//go:embed web/settings.html
	settingsHTML []byte
	//go:embed web/favicon.svg
	faviconSVG []byte
)

const (
	wsReadLimit = 64 << 20
	// maxBig caps big:<n> so a typo cannot make the simulator exhaust memory
	// on the client side.
	maxBig = 1 << 30
	// uploadTempPrefix marks uploads in flight; the file list hides them.
	uploadTempPrefix = ".dshsim-upload-"
)

// upgrader accepts any Origin: the gateway in front of DSH owns that check.
var upgrader = websocket.Upgrader{CheckOrigin: func(*http.Request) bool { return true }}

// serveWS echoes every frame; the text message big:<n> is answered with one
// binary message of n bytes instead, to test message size limits.
func (s *Server) serveWS(w http.ResponseWriter, r *http.Request) {
	conn, err := upgrader.Upgrade(w, r, nil)
	if err != nil {
		return // Upgrade has already answered the client
	}
	defer conn.Close()
	conn.SetReadLimit(wsReadLimit)
	for {
		kind, data, err := conn.ReadMessage()
		if err != nil {
			return
		}
		if n, ok := bigRequest(kind, data); ok {
			err = writeBig(conn, n)
		} else {
			err = conn.WriteMessage(kind, data)
		}
		if err != nil {
			return
		}
	}
}

func bigRequest(kind int, data []byte) (int64, bool) {
	rest, ok := strings.CutPrefix(string(data), "big:")
	if kind != websocket.TextMessage || !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(rest, 10, 64)
	if err != nil || n < 0 || n > maxBig {
		return 0, false
	}
	return n, true
}

// writeBig streams the message in chunks rather than allocating n bytes.
func writeBig(conn *websocket.Conn, n int64) error {
	mw, err := conn.NextWriter(websocket.BinaryMessage)
	if err != nil {
		return fmt.Errorf("start big message: %w", err)
	}
	chunk := make([]byte, 64<<10)
	for i := range chunk {
		chunk[i] = byte('a' + i%26)
	}
	for n > 0 {
		part := chunk[:min(n, int64(len(chunk)))]
		if _, err := mw.Write(part); err != nil {
			return fmt.Errorf("write big message: %w", err)
		}
		n -= int64(len(part))
	}
	if err := mw.Close(); err != nil {
		return fmt.Errorf("finish big message: %w", err)
	}
	return nil
}

// serveEvents streams count "tick" events, the first at once and then one
// every interval milliseconds.
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	interval, err := queryInt(r, "interval", 1000)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	count, err := queryInt(r, "count", 10)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	startSSE(w)
	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil {
		return
	}
	ticker := time.NewTicker(time.Duration(max(interval, 1)) * time.Millisecond)
	defer ticker.Stop()
	for i := 1; i <= count; i++ {
		if i > 1 {
			select {
			case <-ticker.C:
			case <-r.Context().Done():
				return
			case <-s.streamsDone:
				return
			}
		}
		if _, err := fmt.Fprintf(w, "id: %d\nevent: tick\ndata: {\"i\":%d,\"at\":%q}\n\n", i, i, time.Now().UTC().Format(time.RFC3339Nano)); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
	}
}

func queryInt(r *http.Request, name string, def int) (int, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s must be a non-negative integer", name)
	}
	return n, nil
}

func startSSE(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
}

var sessionName = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

type chatMessage struct {
	Role string `json:"role"`
	Text string `json:"text"`
}

// postChat answers a chat message with a reply streamed as server-sent
// events and records both turns in the session file. Without a provider the
// reply is "You said: <message>", one word per unnamed event; with one, it
// is the provider's, relayed as "delta" events as the text arrives (data: a
// JSON string) and, if the provider refused or failed, an "error" event
// (data: {"status","message"}). A "done" event ends the stream either way.
func (s *Server) postChat(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Message string `json:"message"`
		Session string `json:"session"`
		// Model, when given, is asked of the provider instead of DSHSIM_MODEL.
		Model string `json:"model"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil {
		http.Error(w, fmt.Sprintf("decode chat request: %v", err), http.StatusBadRequest)
		return
	}
	session, ok := validSession(req.Session)
	if !ok {
		http.Error(w, "session must match [a-zA-Z0-9_-]{1,64}", http.StatusBadRequest)
		return
	}
	if req.Model != "" && !validModel(req.Model) {
		http.Error(w, "model must match "+modelName.String(), http.StatusBadRequest)
		return
	}
	if s.model != nil {
		model := req.Model
		if model == "" {
			model = s.opts.Model
		}
		s.chatWithModel(w, r, session, req.Message, model)
		return
	}
	reply := "You said: " + req.Message
	// The reply is known up front, so both turns are recorded before
	// streaming: history stays whole even if the client leaves mid-reply.
	if err := s.appendHistory(session, chatMessage{"user", req.Message}, chatMessage{"assistant", reply}); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}

	startSSE(w)
	rc := http.NewResponseController(w)
	for i, word := range strings.Fields(reply) {
		if i > 0 {
			select {
			case <-time.After(20 * time.Millisecond):
			case <-r.Context().Done():
				return
			}
		}
		if _, err := fmt.Fprintf(w, "data: %s\n\n", word); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
	}
	_, _ = io.WriteString(w, "event: done\ndata: done\n\n")
}

// chatWithModel relays the provider's reply as it arrives. The call is the
// agent's work, as in DSH: it goes on when the browser leaves (the reply
// is kept in the history, and the gateway sees the model call as the
// agent working) and ends when the provider finishes, or on shutdown; the
// history gets the user's turn and whatever reply arrived.
func (s *Server) chatWithModel(w http.ResponseWriter, r *http.Request, session, message, model string) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(r.Context()))
	defer cancel()
	go func() {
		select {
		case <-s.streamsDone:
			cancel()
		case <-ctx.Done():
		}
	}()
	startSSE(w)
	rc := http.NewResponseController(w)
	_ = rc.Flush() // the page shows the turn as started before the first token
	var reply strings.Builder
	// gone: the browser left; the reply is no longer written to it.
	gone := false
	err := s.model.stream(ctx, model, message, func(text string) error {
		reply.WriteString(text)
		if !gone && (r.Context().Err() != nil || writeEvent(w, "delta", text) != nil || rc.Flush() != nil) {
			gone = true
		}
		return nil
	})
	turns := []chatMessage{{"user", message}}
	if reply.Len() > 0 {
		turns = append(turns, chatMessage{"assistant", reply.String()})
	}
	if herr := s.appendHistory(session, turns...); herr != nil && err == nil {
		err = herr
	}
	if err != nil {
		s.out.printf("dsh: model call: %v", err)
	}
	if gone || ctx.Err() != nil || r.Context().Err() != nil {
		return // nobody is left to tell
	}
	if err != nil {
		status := 0
		var pe *providerError
		if errors.As(err, &pe) {
			status = pe.Status
		}
		_ = writeEvent(w, "error", map[string]any{"status": status, "message": chatErrorMessage(err)})
	}
	_, _ = io.WriteString(w, "event: done\ndata: done\n\n")
}

// chatErrorMessage is what the user reads: a provider's own message as it
// gave it (the broker's "your model budget … is spent", say), else what
// broke.
func chatErrorMessage(err error) string {
	var pe *providerError
	if errors.As(err, &pe) {
		return pe.Message
	}
	return err.Error()
}

// writeEvent writes one named event whose data is v as JSON, on one line.
func writeEvent(w io.Writer, name string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode %s event: %w", name, err)
	}
	_, err = fmt.Fprintf(w, "event: %s\ndata: %s\n\n", name, b)
	return err
}

func (s *Server) getChat(w http.ResponseWriter, r *http.Request) {
	session, ok := validSession(r.URL.Query().Get("session"))
	if !ok {
		http.Error(w, "session must match [a-zA-Z0-9_-]{1,64}", http.StatusBadRequest)
		return
	}
	history, err := s.readHistory(session)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusOK, history)
}

func validSession(name string) (string, bool) {
	if name == "" {
		name = "default"
	}
	return name, sessionName.MatchString(name)
}

func (s *Server) sessionPath(session string) string {
	return filepath.Join(s.opts.DSHHome, "sessions", session+".jsonl")
}

// appendHistory writes all lines in one O_APPEND write so concurrent chats
// on the same session never interleave within a turn.
func (s *Server) appendHistory(session string, msgs ...chatMessage) error {
	var buf []byte
	for _, m := range msgs {
		line, err := json.Marshal(m)
		if err != nil {
			return fmt.Errorf("encode chat history: %w", err)
		}
		buf = append(append(buf, line...), '\n')
	}
	f, err := os.OpenFile(s.sessionPath(session), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("open chat history: %w", err)
	}
	_, err = f.Write(buf)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("append chat history: %w", err)
	}
	return nil
}

func (s *Server) readHistory(session string) ([]chatMessage, error) {
	history := []chatMessage{}
	f, err := os.Open(s.sessionPath(session))
	if errors.Is(err, os.ErrNotExist) {
		return history, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open chat history: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		var m chatMessage
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			return nil, fmt.Errorf("decode chat history: %w", err)
		}
		history = append(history, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read chat history: %w", err)
	}
	return history, nil
}

type fileEntry struct {
	Name string `json:"name"`
	Size int64  `json:"size"`
	Dir  bool   `json:"dir"`
}

func (s *Server) listFiles(w http.ResponseWriter, _ *http.Request) {
	entries, err := os.ReadDir(s.opts.Workspace)
	if err != nil {
		http.Error(w, fmt.Sprintf("list workspace: %v", err), http.StatusInternalServerError)
		return
	}
	files := []fileEntry{}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), uploadTempPrefix) {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue // removed since ReadDir
		}
		files = append(files, fileEntry{Name: e.Name(), Size: info.Size(), Dir: e.IsDir()})
	}
	sort.Slice(files, func(i, j int) bool { return files[i].Name < files[j].Name })
	writeJSON(w, http.StatusOK, files)
}

func validFileName(name string) bool {
	return name != "" && name != "." && name != ".." && !strings.ContainsAny(name, "/\x00")
}

// putFile streams the body to a temporary file while hashing it and renames
// it into place only once the body has been read completely, so an aborted
// upload leaves nothing behind.
func (s *Server) putFile(w http.ResponseWriter, r *http.Request, name string) {
	if !validFileName(name) {
		http.Error(w, "file name must be a single path element", http.StatusBadRequest)
		return
	}
	tmp, err := os.CreateTemp(s.opts.Workspace, uploadTempPrefix+"*")
	if err != nil {
		http.Error(w, fmt.Sprintf("create upload: %v", err), http.StatusInternalServerError)
		return
	}
	hash := sha256.New()
	size, copyErr := io.Copy(io.MultiWriter(tmp, hash), r.Body)
	err = tmp.Close()
	if err == nil && copyErr == nil {
		err = os.Rename(tmp.Name(), filepath.Join(s.opts.Workspace, name))
	}
	switch {
	case copyErr != nil:
		// Almost always the client going away mid-body.
		_ = os.Remove(tmp.Name())
		http.Error(w, fmt.Sprintf("read upload %s: %v", name, copyErr), http.StatusBadRequest)
		return
	case err != nil:
		_ = os.Remove(tmp.Name())
		http.Error(w, fmt.Sprintf("store upload %s: %v", name, err), http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusCreated, map[string]any{"name": name, "size": size, "sha256": hex.EncodeToString(hash.Sum(nil))})
}

func (s *Server) getFile(w http.ResponseWriter, r *http.Request, name string) {
	if !validFileName(name) {
		http.Error(w, "file name must be a single path element", http.StatusBadRequest)
		return
	}
	f, err := os.Open(filepath.Join(s.opts.Workspace, name))
	if err != nil {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil || info.IsDir() {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", contentType(name))
	http.ServeContent(w, r, name, info.ModTime(), f)
}

// fileTypes maps an extension to the Content-Type a tenant's static server
// would send. The table is fixed rather than mime.TypeByExtension, which
// reads the host's mime.types: the simulator answers the same everywhere.
var fileTypes = map[string]string{
	".html": "text/html; charset=utf-8",
	".htm":  "text/html; charset=utf-8",
	".js":   "text/javascript; charset=utf-8",
	".mjs":  "text/javascript; charset=utf-8",
	".css":  "text/css; charset=utf-8",
	".json": "application/json",
	".txt":  "text/plain; charset=utf-8",
	".svg":  "image/svg+xml",
	".png":  "image/png",
	".jpg":  "image/jpeg",
	".jpeg": "image/jpeg",
	".gif":  "image/gif",
	".webp": "image/webp",
	".wasm": "application/wasm",
	".xml":  "text/xml; charset=utf-8",
	".pdf":  "application/pdf",
}

// contentType is the workspace file's type from its extension (any case);
// anything else is application/octet-stream, never sniffed from the bytes,
// so a file is HTML only when its name says so.
func contentType(name string) string {
	if t, ok := fileTypes[strings.ToLower(filepath.Ext(name))]; ok {
		return t
	}
	return "application/octet-stream"
}

// serveEcho reports what arrived so tests can check the gateway's header
// hygiene. Only the values of dsh-auth-* cookies are hidden.
func (s *Server) serveEcho(w http.ResponseWriter, r *http.Request) {
	headers := r.Header.Clone()
	for i, v := range headers["Cookie"] {
		headers["Cookie"][i] = redactAuthCookies(v)
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"method":      r.Method,
		"path":        r.URL.Path,
		"query":       r.URL.RawQuery,
		"host":        r.Host,
		"remote_addr": r.RemoteAddr,
		"headers":     headers,
		"version":     s.opts.Version,
	})
}

// redactAuthCookies keeps the Cookie header byte for byte except for the
// values of dsh-auth-* cookies.
func redactAuthCookies(header string) string {
	parts := strings.Split(header, ";")
	for i, part := range parts {
		name, _, ok := strings.Cut(part, "=")
		trimmed := strings.TrimSpace(name)
		if ok && strings.HasPrefix(trimmed, authCookiePrefix) {
			parts[i] = name + "=REDACTED"
		}
	}
	return strings.Join(parts, ";")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
