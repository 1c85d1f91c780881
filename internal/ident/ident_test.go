package ident

import (
	"strings"
	"testing"
)

// bobToken is a well-formed bearer token of bob's.
const bobToken = "bob.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"

func TestValidateUser(t *testing.T) {
	good := []string{"bob", "al", "x9", "a-b", "carol-2", strings.Repeat("a", 32)}
	bad := []string{
		"", "a", strings.Repeat("a", 33), "Bob", "BOB", "..", "a..b", "a.b", "a/b", "a b", "-ab", "ab-", "a--b", "9ab",
		"bоb",       // Cyrillic о
		"bob\u200b", // zero-width space
		"dsh-bob", "dsh", "dshbob", "admin", "pool", "bob\n",
	}
	for _, n := range good {
		if err := ValidateUser(n); err != nil {
			t.Errorf("%q refused: %v", n, err)
		}
	}
	for _, n := range bad {
		if ValidateUser(n) == nil {
			t.Errorf("%q accepted", n)
		}
	}
}

func TestTokens(t *testing.T) {
	tok := NewToken("bob")
	if u, ok := TokenUser(tok); !ok || u != "bob" {
		t.Fatalf("TokenUser(%q) = %q %v", tok, u, ok)
	}
	h := HashHex(tok)
	if !TokenMatches(tok, h) || TokenMatches(NewToken("bob"), h) || TokenMatches(tok, "") {
		t.Fatal("token matching is wrong")
	}
	sid := NewSecret()
	if _, ok := TokenUser(sid); ok {
		t.Fatal("a session id passes as a token")
	}
	for _, bad := range []string{"", "bob", "bob.", "Bob." + strings.Repeat("a", 43), "bob.short"} {
		if _, ok := TokenUser(bad); ok {
			t.Errorf("%q parsed as a token", bad)
		}
	}
}

func TestSSOName(t *testing.T) {
	for _, tt := range []struct{ login, want string }{
		{"alice", "alice"},
		{"AliceSmith", "alicesmith"},
		{" Bob ", "bob"},
		{"alice.smith", "alice-smith-"},
		{"alice_smith", "alice-smith-"},
		{"admin", "admin-"},
		{"dshuser", "u-dshuser-"},
		{"9lives", "u-9lives-"},
		{"x", "x-"},
		{"ünïcode", "n-code-"},
		{"---", "u-"},
		{strings.Repeat("long", 20), "longlonglonglonglonglongl-"},
	} {
		got := SSOName(tt.login)
		if err := ValidateUser(got); err != nil {
			t.Errorf("SSOName(%q) = %q, not an account name: %v", tt.login, got, err)
		}
		if got != tt.want && !(strings.HasSuffix(tt.want, "-") && strings.HasPrefix(got, tt.want) && len(got) == len(tt.want)+6) {
			t.Errorf("SSOName(%q) = %q, want %q", tt.login, got, tt.want)
		}
		if again := SSOName(tt.login); again != got {
			t.Errorf("SSOName(%q) is not deterministic: %q then %q", tt.login, got, again)
		}
	}
	if SSOName("alice.smith") == SSOName("alice_smith") {
		t.Error("two logins that differ in a dropped character share an account name")
	}
	if SSOName("AliceSmith") != SSOName("alicesmith") {
		t.Error("logins that differ only in case got different accounts")
	}
}

// An ADMIN_USERS entry names an account and the identity it is bound to;
// a name alone, or an identity that is not a SHA-256, is refused.
func TestParseAdmin(t *testing.T) {
	h := HashHex(NewToken("ops"))
	if a, err := ParseAdmin(" ops:" + strings.ToUpper(h) + " "); err != nil || a.Name != "ops" || a.Identity != h {
		t.Fatalf("ParseAdmin = %+v %v", a, err)
	}
	for _, bad := range []string{"ops", "ops:", ":" + h, "ops:" + h[:63], "ops:" + h + "0", "ops:" + strings.Repeat("g", 64), "Ops:" + h, "root:" + h, "ops:" + h + ":x"} {
		if a, err := ParseAdmin(bad); err == nil {
			t.Errorf("%q accepted as %+v", bad, a)
		}
	}
}

// FuzzTokenAndSSONames checks the parsing of bearer tokens and the
// mapping of sign-in logins to account names on any string: TokenUser
// accepts exactly "<valid account name>.<43 characters>" and names the
// part before the first dot; SSOName always gives a valid account name,
// the same for an ASCII login in any case, and a token minted for it
// names it again.
func FuzzTokenAndSSONames(f *testing.F) {
	for _, s := range []string{bobToken, "alice.x", "Bob.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "a.b." + strings.Repeat("A", 43),
		"dsh-x." + strings.Repeat("A", 43), "Alice", "alice.smith@example.com", "  ", "admin", "--", "ДМИТРИЙ", strings.Repeat("ab", 40)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		user, ok := TokenUser(s)
		name, secret, dot := strings.Cut(s, ".")
		want := dot && len(secret) == 43 && ValidateUser(name) == nil
		if ok != want || ok && user != name {
			t.Fatalf("TokenUser(%q) = %q, %v", s, user, ok)
		}
		sso := SSOName(s)
		if err := ValidateUser(sso); err != nil {
			t.Fatalf("SSOName(%q) = %q, not an account name: %v", s, sso, err)
		}
		if ascii(s) && SSOName(strings.ToUpper(s)) != sso {
			t.Fatalf("SSOName(%q) = %q but SSOName(%q) = %q", s, sso, strings.ToUpper(s), SSOName(strings.ToUpper(s)))
		}
		if u, ok := TokenUser(NewToken(sso)); !ok || u != sso {
			t.Fatalf("a token minted for %q names %q, %v", sso, u, ok)
		}
	})
}

func ascii(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// FuzzAPITokens checks the parsing of named API tokens on any string:
// ParseAPIToken accepts exactly "<valid account name>.<valid token
// name>.<43 characters>", no string is both an account token and an API
// token, and a token minted for a valid name parses back to it.
func FuzzAPITokens(f *testing.F) {
	for _, s := range []string{"ann.ci." + strings.Repeat("A", 43), bobToken, "ann..x", "ann.CI." + strings.Repeat("A", 43),
		"ann.ci." + strings.Repeat("A", 44), "ann.-x." + strings.Repeat("A", 43), "a.b.c.d", "ann.ci.with.dots.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		user, name, ok := ParseAPIToken(s)
		parts := strings.SplitN(s, ".", 3)
		want := len(parts) == 3 && len(parts[2]) == 43 && ValidateUser(parts[0]) == nil && ValidateTokenName(parts[1]) == nil
		if ok != want || ok && (user != parts[0] || name != parts[1]) {
			t.Fatalf("ParseAPIToken(%q) = %q, %q, %v", s, user, name, ok)
		}
		if _, account := TokenUser(s); account && ok {
			t.Fatalf("%q is both an account token and an API token", s)
		}
		sso := SSOName(s)
		if u, n, ok := ParseAPIToken(NewAPIToken(sso, "ci")); !ok || u != sso || n != "ci" {
			t.Fatalf("an API token minted for %q parses as %q, %q, %v", sso, u, n, ok)
		}
	})
}

// FuzzRequestID: whatever a client sends as X-Request-Id through a
// trusted ingress, the id the edge uses is short and made of the safe
// characters only.
func FuzzRequestID(f *testing.F) {
	for _, s := range []string{"4f2d3c1b0a9e8d7c6b5a49382716aabb", "a\nb", "", strings.Repeat("z", 70), "ü", "a b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		got := AdoptRequestID(id)
		if got == "" || len(got) > 64 {
			t.Fatalf("id %q from %q", got, id)
		}
		for _, r := range got {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
				t.Fatalf("id %q from %q has %q", got, id, r)
			}
		}
	})
}

func TestConfigEntries(t *testing.T) {
	for _, bad := range []string{"http://gw.example", "gw.example:0", "a b", ""} {
		if _, err := ParsePublicHost(bad); err == nil {
			t.Errorf("PUBLIC_HOSTS entry %q accepted", bad)
		}
	}
	if c, err := ParsePublicHost("GW.example:443"); err != nil || c != "gw.example" {
		t.Errorf("gw.example:443 → %q %v", c, err)
	}
	for _, bad := range []string{"10.0.0.0/33", "example.com", ""} {
		if _, err := ParseTrustedProxy(bad); err == nil {
			t.Errorf("TRUSTED_PROXIES entry %q accepted", bad)
		}
	}
	if p, err := ParseTrustedProxy("10.1.2.3/8"); err != nil || p.String() != "10.0.0.0/8" {
		t.Errorf("10.1.2.3/8 → %v %v", p, err)
	}
}

func TestValidateProfile(t *testing.T) {
	for _, name := range []string{"gpu", "small", "a1", "large-2", strings.Repeat("p", MaxProfileLen)} {
		if err := ValidateProfile(name); err != nil {
			t.Errorf("%q refused: %v", name, err)
		}
	}
	// A profile's name is written on claims and into command subjects'
	// payloads and pages: nothing outside the narrow alphabet, and no
	// "--", which named sandboxes' hosts keep as their separator.
	for _, name := range []string{"", "g", "GPU", "2gpu", "gpu-", "-gpu", "a--b", "gpu.x", "gpu>", "gp u", "gpu\n", "ǵpu", strings.Repeat("p", MaxProfileLen+1)} {
		if ValidateProfile(name) == nil {
			t.Errorf("%q accepted", name)
		}
	}
}

func TestSandboxKeys(t *testing.T) {
	long := strings.Repeat("s", MaxSandboxNameLen)
	for _, c := range []struct{ key, user, name string }{
		{"alice", "alice", ""},
		{"alice--work", "alice", "work"},
		{"alice--w", "alice", "w"},
		{"bo-b--gpu-2", "bo-b", "gpu-2"},
		{"alice--" + long, "alice", long},
	} {
		user, name, ok := SplitSandboxKey(c.key)
		if !ok || user != c.user || name != c.name || SandboxKey(user, name) != c.key || OwnerOf(c.key) != c.user {
			t.Errorf("%q: %q %q %v", c.key, user, name, ok)
		}
	}
	// Nothing else reads as a key, so nothing else owns anything: not an
	// empty or bad name on either side, not a third part, not a preview's
	// "<port>-<user>", not a name longer than the claim's label allows.
	for _, key := range []string{"", "--work", "alice--", "alice---work", "alice--work--x", "alice--work-", "alice--2work",
		"alice--Work", "alice--wo.rk", "admin", "dshalice--w", "8080-alice", "8080-alice--work", "alice--" + long + "s", "alice--w\x00"} {
		if user, name, ok := SplitSandboxKey(key); ok || OwnerOf(key) != "" {
			t.Errorf("%q read as %q %q", key, user, name)
		}
	}
	for _, name := range []string{"", "-w", "w-", "a--b", "W", "1w", "w_x", long + "s"} {
		if ValidateSandboxName(name) == nil {
			t.Errorf("name %q accepted", name)
		}
	}
	// The longest key's claim is a DNS label, and so is its longest
	// preview origin.
	longest := SandboxKey(strings.Repeat("u", MaxUserLen), long)
	if n := len("dsh-" + longest); n > 63 {
		t.Errorf("claim name of %d characters", n)
	}
	if n := len("65535-" + longest); n > 63 {
		t.Errorf("preview label of %d characters", n)
	}
}

func FuzzSplitSandboxKey(f *testing.F) {
	for _, s := range []string{"alice", "alice--work", "alice---w", "8080-alice--w", "a--b--c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		user, name, ok := SplitSandboxKey(key)
		if !ok {
			return
		}
		// A key reads back as itself, its owner is an account, and it is
		// an account's name only when it names no sandbox.
		if SandboxKey(user, name) != key || ValidateUser(user) != nil || ValidUser(key) != (name == "") {
			t.Fatalf("%q: %q %q", key, user, name)
		}
	})
}
