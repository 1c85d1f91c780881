package handshake_test

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/handshake"
)

// FuzzTokensFromLog feeds any bytes (a tenant writes its pod's log) to
// TokensFromLog and checks it against a reading of the log written out by
// hand, without regular expressions: the same tokens in the same order
// (newest line first, each once, at most MaxCandidates), each one a line
// "dsh web: http(s)://host/?token=…" of the log as the terminal shows it
// (colour codes removed), no other line's and nothing made up; ErrNoToken
// exactly when there is none.
func FuzzTokensFromLog(f *testing.F) {
	real := "dsh web: http://0.0.0.0:3080/?token=REALREALREALREALREALREAL"
	for _, s := range []string{
		real,
		real + "\r\n",
		"\x1b[1m\x1b[32m" + real + "\x1b[0m\r\nmodel: ?token=not-a-real-one\n",
		"dsh web: https://h/?token=FIFTEENFIFTEEN1\n", "dsh web: https://h/?token=SIXTEENSIXTEEN16\n",
		"dsh web: http://h/?token=AAAAAAAAAAAAAAAA dsh web: http://h/?token=BBBBBBBBBBBBBBBB\n",
		"dsh web: http://h/?token=AAAAAAAA\x1b[0mAAAAAAAA\n",
		"dsh web: http://h/?token=AAAAAAAAAAAAAAAA\x1b[31\n",
		"dsh web: http://h/p/?token=AAAAAAAAAAAAAAAA\n",
		"dsh web: http://h/?token=AAAAAAAAAAAAAAAA!\n",
		"dsh web: http://h\xff/?token=AAAAAAAAAAAAAAAA\tthen\n",
		strings.Repeat(real+"\ndsh web: http://h/?token=CCCCCCCCCCCCCCCCCCCC\n", 3),
		func() string {
			var b strings.Builder
			for i := range 12 {
				b.WriteString("dsh web: http://h/?token=FAKEFAKEFAKEFAKE" + string(rune('a'+i)) + "\n")
			}
			return b.String()
		}(),
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, log []byte) {
		tokens, err := handshake.TokensFromLog(log)
		want := tokenLines(log)
		switch {
		case len(want) == 0:
			if !errors.Is(err, handshake.ErrNoToken) || tokens != nil {
				t.Fatalf("no token line, got %q, %v", tokens, err)
			}
		case err != nil:
			t.Fatalf("%v; the log has %q", err, want)
		case !slices.Equal(tokens, want):
			t.Fatalf("got %q, the log has %q", tokens, want)
		}
		shown := stripColour(log)
		for _, tok := range tokens {
			if !bytes.Contains(shown, []byte("/?token="+tok)) {
				t.Fatalf("%q is not in the log", tok)
			}
		}
	})
}

// tokenLines reads the log by hand: each line without its colour codes
// and trailing CRs, newest first; the first "dsh web: " on it followed by
// "http://" or "https://", a host (no space or slash), "/?token=", at
// least 16 of [A-Za-z0-9_-], and a space or the line's end; each token
// once, MaxCandidates at most.
func tokenLines(log []byte) []string {
	lines := bytes.Split(stripColour(log), []byte("\n"))
	var tokens []string
	for i := len(lines) - 1; i >= 0 && len(tokens) < handshake.MaxCandidates; i-- {
		tok, ok := lineToken(bytes.TrimRight(lines[i], "\r"))
		if ok && !slices.Contains(tokens, tok) {
			tokens = append(tokens, tok)
		}
	}
	return tokens
}

func lineToken(line []byte) (string, bool) {
	space := func(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\f' || c == '\r' }
	for at := 0; ; at++ {
		i := bytes.Index(line[at:], []byte("dsh web: http"))
		if i < 0 {
			return "", false
		}
		at += i
		rest := line[at+len("dsh web: http"):]
		rest = bytes.TrimPrefix(rest, []byte("s"))
		if !bytes.HasPrefix(rest, []byte("://")) {
			continue
		}
		rest = rest[3:]
		host := 0
		for host < len(rest) && !space(rest[host]) && rest[host] != '/' {
			host++
		}
		if host == 0 || !bytes.HasPrefix(rest[host:], []byte("/?token=")) {
			continue
		}
		rest = rest[host+len("/?token="):]
		n := 0
		for n < len(rest) && (rest[n] >= 'A' && rest[n] <= 'Z' || rest[n] >= 'a' && rest[n] <= 'z' || rest[n] >= '0' && rest[n] <= '9' || rest[n] == '_' || rest[n] == '-') {
			n++
		}
		if n >= 16 && (n == len(rest) || space(rest[n])) {
			return string(rest[:n]), true
		}
	}
}

// stripColour removes terminal escape sequences: ESC "[", parameter
// bytes (digits, ";", "?"), intermediate bytes (" " to "/"), one final
// byte ("@" to "~").
func stripColour(log []byte) []byte {
	var out []byte
	for i := 0; i < len(log); i++ {
		if log[i] == 0x1b && i+1 < len(log) && log[i+1] == '[' {
			j := i + 2
			for j < len(log) && (log[j] >= '0' && log[j] <= '9' || log[j] == ';' || log[j] == '?') {
				j++
			}
			for j < len(log) && log[j] >= ' ' && log[j] <= '/' {
				j++
			}
			if j < len(log) && log[j] >= '@' && log[j] <= '~' {
				i = j
				continue
			}
		}
		out = append(out, log[i])
	}
	return out
}
