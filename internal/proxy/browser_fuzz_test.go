package proxy

import (
	"bufio"
	"encoding/json"
	"io"
	"os/exec"
	"strings"
	"sync"
	"testing"
)

// browserURL is a browser's reading of a URL: Node.js's URL class, which
// implements the WHATWG URL Standard that browsers follow (backslashes as
// slashes, tabs and newlines removed, "%2e" dot segments, default ports),
// and the HTML Standard's parsing of a Refresh header. The fuzz targets ask
// it where a browser goes, not our own reading of URLs.
type browserURL struct {
	Href     string `json:"href"`
	Protocol string `json:"protocol"`
	Hostname string `json:"hostname"`
	Pathname string `json:"pathname"`
	// None: the browser goes nowhere (a Refresh it does not follow, or a
	// URL it cannot parse).
	None bool `json:"none"`
}

// browserScript answers one JSON line {base, input, refresh} with one
// JSON line: the URL the browser resolves input to.
const browserScript = `
const rl = require('readline').createInterface({input: process.stdin});
const ws = c => c === ' ' || c === '\t' || c === '\n' || c === '\f' || c === '\r';
// The HTML Standard's "shared declarative refresh steps": the URL a
// Refresh value sends the browser to, null when it is not followed.
function refreshURL(input, base) {
  let p = 0;
  while (p < input.length && ws(input[p])) p++;
  const t0 = p;
  while (p < input.length && input[p] >= '0' && input[p] <= '9') p++;
  if (p === t0 && input[p] !== '.') return null;
  while (p < input.length && (input[p] >= '0' && input[p] <= '9' || input[p] === '.')) p++;
  if (p < input.length) {
    if (input[p] !== ';' && input[p] !== ',' && !ws(input[p])) return null;
    while (p < input.length && ws(input[p])) p++;
    if (input[p] === ';' || input[p] === ',') p++;
    while (p < input.length && ws(input[p])) p++;
  }
  if (p >= input.length) return base;
  let url = input.slice(p);
  parse: {
    if (input[p] === 'U' || input[p] === 'u') p++; else break parse;
    if (input[p] === 'R' || input[p] === 'r') p++; else { return url; }
    if (input[p] === 'L' || input[p] === 'l') p++; else { return url; }
    while (p < input.length && ws(input[p])) p++;
    if (input[p] === '=') p++; else { return url; }
    while (p < input.length && ws(input[p])) p++;
  }
  let quote = null;
  if (input[p] === '"' || input[p] === "'") { quote = input[p]; p++; }
  url = input.slice(p);
  if (quote !== null && url.indexOf(quote) >= 0) url = url.slice(0, url.indexOf(quote));
  return url;
}
rl.on('line', line => {
  const q = JSON.parse(line);
  let out;
  try {
    const input = q.refresh ? refreshURL(q.input, q.base) : q.input;
    if (input === null) {
      out = {none: true};
    } else {
      const u = new URL(input, q.base);
      out = {href: u.href, protocol: u.protocol, hostname: u.hostname, pathname: u.pathname};
    }
  } catch (e) {
    out = {none: true};
  }
  process.stdout.write(JSON.stringify(out) + '\n');
});
`

var browser struct {
	once sync.Once
	err  error
	mu   sync.Mutex
	in   io.Writer
	out  *bufio.Reader
}

// resolve is where a browser at base goes for input (a Location value, or
// with refresh a Refresh value). Header values are bytes: each is one
// character to the browser (isomorphic decoding), so no byte is lost or
// merged on the way to Node.
func resolve(t *testing.T, base, input string, refresh bool) browserURL {
	t.Helper()
	browser.once.Do(func() {
		cmd := exec.Command("node", "-e", browserScript)
		in, err := cmd.StdinPipe()
		if err != nil {
			browser.err = err
			return
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			browser.err = err
			return
		}
		if browser.err = cmd.Start(); browser.err == nil {
			browser.in, browser.out = in, bufio.NewReader(out)
		}
	})
	if browser.err != nil {
		t.Fatalf("node, the browser's URL parser: %v (Debian's nodejs; make tools installs it)", browser.err)
	}
	runes := make([]rune, len(input))
	for i := 0; i < len(input); i++ {
		runes[i] = rune(input[i])
	}
	q, _ := json.Marshal(map[string]any{"base": base, "input": string(runes), "refresh": refresh})
	browser.mu.Lock()
	defer browser.mu.Unlock()
	if _, err := browser.in.Write(append(q, '\n')); err != nil {
		t.Fatal(err)
	}
	line, err := browser.out.ReadBytes('\n')
	if err != nil {
		t.Fatal(err)
	}
	var u browserURL
	if err := json.Unmarshal(line, &u); err != nil {
		t.Fatalf("%v: %s", err, line)
	}
	return u
}

// inside reports whether the browser's URL stays off the gateway (another
// host, or a scheme other than http and https) or inside prefix on it.
func (u browserURL) inside(host, prefix string) bool {
	web := u.Protocol == "http:" || u.Protocol == "https:"
	return u.None || !web || !strings.EqualFold(u.Hostname, host) || u.Pathname == prefix || strings.HasPrefix(u.Pathname, prefix+"/")
}
