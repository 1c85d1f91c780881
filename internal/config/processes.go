package config

import (
	"net"
	"net/netip"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/handshake"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/idle"
	"github.com/aaas-project/aaas/internal/state"
)

// Edge is the configuration of cmd/edge.
type Edge struct {
	Common
	// ListenAddr is LISTEN_ADDR.
	ListenAddr string
	// CookieSecure is COOKIE_SECURE: the session cookie is Secure and,
	// without COOKIE_NAME, named __Host-dsh_gw_session.
	CookieSecure bool
	// CookieName is COOKIE_NAME; by default __Host-dsh_gw_session when
	// secure, dsh_gw_session otherwise.
	CookieName string
	// AuthRateLimit is AUTH_RATE_LIMIT, attempts per client per
	// AUTH_RATE_WINDOW (Buckets.RateWindow), shared by all edges. The
	// session lifetime, COOKIE_MAX_AGE, is Buckets.SessionTTL.
	AuthRateLimit int
	// RecreateRateLimit is RECREATE_RATE_LIMIT: recreates and deletions
	// per user in any AUTH_RATE_WINDOW.
	RecreateRateLimit int
	// RefusalAuditLimit is REFUSAL_AUDIT_LIMIT: refusals all edges
	// together audit per AUTH_RATE_WINDOW; the rest are counted.
	RefusalAuditLimit int
	// InviteCode is SIGNUP_INVITE_CODE; empty means open signup, which
	// OPEN_SIGNUP must confirm (a missing Secret key must not open it).
	InviteCode string
	// AuthProxyHeader is AUTH_PROXY_HEADER: when set, that header names
	// the user (SSO behind oauth2-proxy) and is trusted.
	AuthProxyHeader string
	// AuthProxyIDHeader is AUTH_PROXY_ID_HEADER: the header carrying the
	// provider's stable id of the user, to which an SSO account is bound.
	AuthProxyIDHeader string
	// AuthProxyGroupsHeader is AUTH_PROXY_GROUPS_HEADER: the user's groups
	// (comma separated), for AUTH_PROXY_ALLOW's group: entries.
	AuthProxyGroupsHeader string
	// AuthProxyAllow is AUTH_PROXY_ALLOW: who SSO admits (logins, group:
	// entries, or * for everyone the SSO proxy admits); required with SSO.
	AuthProxyAllow []string
	// AuthProxySignOutURL is AUTH_PROXY_SIGN_OUT_URL: where an SSO user's
	// "Sign out" goes once the edge has ended their sandbox sessions (the
	// SSO proxy's own sign-out, /oauth2/sign_out for oauth2-proxy); a path
	// on the gateway's host or an https URL. Empty: back to the home page,
	// where the SSO proxy's cookie still signs them in.
	AuthProxySignOutURL string
	// PublicHosts is PUBLIC_HOSTS, canonical: the hosts browsers use to
	// reach the gateway ("*" for any); other Hosts get 421.
	PublicHosts []string
	// SandboxDomain is SANDBOX_DOMAIN, canonical: with it set (subdomain
	// mode), user ann's sandbox is served at ann.<SandboxDomain> and
	// nowhere else, each sandbox on an origin of its own; empty is path
	// mode (/u/<user>/ on the gateway's own origin).
	SandboxDomain string
	// TrustedProxies is TRUSTED_PROXIES: the peers (our ingress) whose
	// X-Forwarded-For and X-Forwarded-Proto are believed.
	TrustedProxies []netip.Prefix
	// MaxSessionsPerUser is MAX_SESSIONS_PER_USER: a new sign-in beyond it
	// ends the user's oldest session.
	MaxSessionsPerUser int
	// MaxAPITokensPerUser is MAX_API_TOKENS_PER_USER: how many named API
	// tokens one user may hold.
	MaxAPITokensPerUser int
	// CacheUsers is EDGE_CACHE_USERS: how many users' records (account,
	// sandbox, sessions, handshakes, API tokens) an edge holds at most; a user beyond
	// it costs a read of the bus when next served. The edge's memory is
	// bounded by it, not by how many accounts exist (CacheLimits).
	CacheUsers int
	// ReadTimeout is HTTP_READ_TIMEOUT: the longest the edge waits for a
	// client's next bytes (request headers, or a chunk of a body).
	ReadTimeout time.Duration
	// WriteTimeout is HTTP_WRITE_TIMEOUT: the longest one write to a client
	// may block; streams get it afresh for every chunk.
	WriteTimeout time.Duration
	// IdleTimeout is HTTP_IDLE_TIMEOUT, for keep-alive connections.
	IdleTimeout time.Duration
	// Revalidate is how often long-lived streams re-check that their
	// session is still valid (a revocation ends them within it).
	Revalidate time.Duration
	// MaxInFlightPerUser is MAX_IN_FLIGHT_PER_USER (HTTP plus WebSockets,
	// per edge).
	MaxInFlightPerUser int
	// MaxBodyBytes is MAX_BODY_MB in bytes.
	MaxBodyBytes int64
	// WSMaxMessageBytes is WS_MAX_MESSAGE_BYTES, for messages from DSH.
	WSMaxMessageBytes int64
	// WakeTimeout is WAKE_TIMEOUT: how long a request waits for a sandbox.
	WakeTimeout time.Duration
	// HandshakeTimeout is HANDSHAKE_TIMEOUT: how long a request waits for
	// a handshake (lifecycle ends every handshake command within it).
	HandshakeTimeout time.Duration
	// HeaderAllowlist is UPSTREAM_HEADER_ALLOWLIST; when set, only these
	// request headers reach DSH.
	HeaderAllowlist []string
	// HandshakeKeys is HANDSHAKE_KEYS, the key ring shared with lifecycle
	// (newest first).
	HandshakeKeys [][]byte
	// MaxUsers is MAX_USERS: the most accounts the gateway creates (0: no
	// limit); signups beyond it answer 403.
	MaxUsers int
	// AdminUsers is ADMIN_USERS: the accounts that may use /_/admin, each
	// "<name>:<identity>" (ident.ParseAdmin), so the rights stay with the
	// account and never pass to whoever takes its name.
	AdminUsers []ident.Admin
	// AdminGroups is ADMIN_GROUPS: with SSO, the groups (from
	// AUTH_PROXY_GROUPS_HEADER) whose members may use /_/admin.
	AdminGroups []string
	// MaxSandboxes is MAX_SANDBOXES_PER_USER (maxSandboxes).
	MaxSandboxes int
	// Profiles is PROFILES: what a user may choose their sandbox's kind
	// from (the one default profile when unset).
	Profiles Profiles
	// Idle is IDLE_TIMEOUT and MAX_RUNTIME, read as the sweeper reads them:
	// the user's page shows when the sandbox will be suspended.
	Idle idle.Policy
	// IdleConnectedTimeout is IDLE_CONNECTED_TIMEOUT: a stream (WebSocket,
	// streamed response) with no browser input for this long stops
	// counting as activity, so a forgotten tab does not pin its sandbox.
	IdleConnectedTimeout time.Duration
	// MaxKeepAwake is MAX_KEEPAWAKE: the longest keep-awake a user may ask
	// for (POST /_/keepawake).
	MaxKeepAwake time.Duration
	// BeaconInterval is BEACON_INTERVAL: heartbeat period while busy.
	BeaconInterval time.Duration
	// BeaconTTL is BEACON_TTL: how long a beacon reporting work in flight
	// keeps the user's sandbox awake. It is how long an edge cut off from
	// NATS (still serving its users from its caches) can go unheard before
	// the sweeper reads its silence as idleness, and how long a crashed
	// edge's last beacon pins its users' sandboxes.
	BeaconTTL time.Duration
	// ShutdownTimeout is SHUTDOWN_TIMEOUT, the drain deadline on SIGTERM.
	ShutdownTimeout time.Duration
	// RouteMaxStaleness is ROUTE_MAX_STALENESS: the longest the edge routes
	// requests from its copy of the sandboxes bucket without confirming
	// that copy current (NATS unreachable, its watch stalled). A pod's
	// address may meanwhile have gone to another tenant's pod, which would
	// receive the request, its body and DSH's cookie; past the bound the
	// edge sends nothing and answers 503.
	RouteMaxStaleness time.Duration
	// HSTSMaxAge is HSTS_MAX_AGE: the max-age of the
	// Strict-Transport-Security header on every answer to a request that
	// came over HTTPS (0: none).
	HSTSMaxAge time.Duration
	// AdminPlacement is ADMIN_HOSTS and ADMIN_ON_SANDBOX_HOSTS.
	AdminPlacement
	// Preview is PREVIEW_PORTS and PREVIEW_ACCESS.
	Preview Preview
	// Budget is BROKER_BUDGET_DEFAULT, read as the brokers read it: the
	// default the user's page and the admin view show.
	Budget
	// BYOK is BROKER_BYOK: users may store their own provider keys on
	// their page, sealed to CredentialsPublicKey for the providers of
	// Providers (BROKER_PROVIDERS, read only with BYOK: a key is stored
	// per provider name).
	BYOK      bool
	Providers []Provider
	// CredentialsPublicKey is CREDENTIALS_PUBLIC_KEY, needed with BYOK:
	// the X25519 public key of the brokers' newest CREDENTIALS_KEYS
	// (`setup credentials-keygen` prints both). The edge can seal a key
	// with it and never open one.
	CredentialsPublicKey []byte
}

// LoadEdge reads and validates the edge's variables.
func LoadEdge(e *Env) (Edge, error) {
	c := Edge{
		Common:              LoadCommon(e, ":9090"),
		ListenAddr:          e.String("LISTEN_ADDR", ":8080"),
		CookieSecure:        e.Bool("COOKIE_SECURE", true),
		CookieName:          e.String("COOKIE_NAME", ""),
		AuthRateLimit:       e.Int("AUTH_RATE_LIMIT", 30, 1, 10_000),
		RecreateRateLimit:   e.Int("RECREATE_RATE_LIMIT", 5, 1, 1000),
		RefusalAuditLimit:   e.Int("REFUSAL_AUDIT_LIMIT", 60, 1, 100_000),
		InviteCode:          e.Secret("SIGNUP_INVITE_CODE"),
		AuthProxyHeader:     e.String("AUTH_PROXY_HEADER", ""),
		AuthProxyIDHeader:   e.String("AUTH_PROXY_ID_HEADER", "X-Forwarded-Email"),
		AuthProxyAllow:      e.List("AUTH_PROXY_ALLOW", nil),
		MaxSessionsPerUser:  e.Int("MAX_SESSIONS_PER_USER", 20, 1, 10_000),
		MaxAPITokensPerUser: e.Int("MAX_API_TOKENS_PER_USER", 10, 1, 1_000),
		CacheUsers:          e.Int("EDGE_CACHE_USERS", 50_000, 100, 10_000_000),
		ReadTimeout:         e.Duration("HTTP_READ_TIMEOUT", time.Minute, time.Second, time.Hour),
		WriteTimeout:        e.Duration("HTTP_WRITE_TIMEOUT", time.Minute, time.Second, time.Hour),
		IdleTimeout:         e.Duration("HTTP_IDLE_TIMEOUT", 90*time.Second, time.Second, time.Hour),
		Revalidate:          500 * time.Millisecond,
		MaxInFlightPerUser:  e.Int("MAX_IN_FLIGHT_PER_USER", 32, 1, 100_000),
		MaxBodyBytes:        int64(e.Int("MAX_BODY_MB", 2048, 1, 1<<20)) << 20,
		WSMaxMessageBytes:   int64(e.Int("WS_MAX_MESSAGE_BYTES", 16<<20, 1024, 1<<30)),
		WakeTimeout:         e.Duration("WAKE_TIMEOUT", 90*time.Second, time.Second, time.Hour),
		HandshakeTimeout:    handshakeTimeout(e),
		HeaderAllowlist:     e.List("UPSTREAM_HEADER_ALLOWLIST", nil),
		HandshakeKeys:       handshakeKeys(e),
		BeaconInterval:      beaconInterval(e),
		Idle:                idlePolicy(e),
		// Long enough for reading a long answer or watching an agent work
		// without typing; short enough that a tab forgotten overnight
		// frees its pod.
		IdleConnectedTimeout: e.Duration("IDLE_CONNECTED_TIMEOUT", time.Hour, 10*time.Second, 30*24*time.Hour),
		MaxKeepAwake:         e.Duration("MAX_KEEPAWAKE", 8*time.Hour, 10*time.Second, 30*24*time.Hour),
		MaxUsers:             e.Int("MAX_USERS", 0, 0, 10_000_000),
		AdminGroups:          e.List("ADMIN_GROUPS", nil),
		ShutdownTimeout:      shutdownTimeout(e),
		// Above a NATS leader election and a stalled watch's replacement
		// (4-20 s), so neither trips it; as long as BEACON_TTL's default,
		// after which the rest of the gateway may act on this edge's
		// silence (its users' sandboxes count as idle). The floor is two
		// of the cache's confirming looks (2 s apart) and one's timeout.
		RouteMaxStaleness: routeMaxStaleness(e),
		// A year, as browsers' preload lists ask; the edge serves the
		// gateway's own hosts only, so includeSubDomains is not its call.
		HSTSMaxAge: e.Duration("HSTS_MAX_AGE", 365*24*time.Hour, 0, 2*365*24*time.Hour),
		Preview:    loadPreview(e),
		Budget:     loadBudget(e),
		BYOK:       e.Bool("BROKER_BYOK", false),
	}
	if c.BYOK {
		c.Providers = loadProviders(e)
		c.CredentialsPublicKey = publicKey(e, "CREDENTIALS_PUBLIC_KEY")
	}
	c.BeaconTTL = beaconTTL(e, c.BeaconInterval)
	if open := e.Bool("OPEN_SIGNUP", false); c.InviteCode == "" && c.AuthProxyHeader == "" && !open {
		e.Fail("SIGNUP_INVITE_CODE", "empty, so anyone could sign up; set it, or OPEN_SIGNUP=true to mean that")
	}
	if allowInsecure := e.Bool("ALLOW_INSECURE_COOKIES", false); !c.CookieSecure && !allowInsecure {
		e.Fail("COOKIE_SECURE", "false sends the session cookie over plain HTTP; set ALLOW_INSECURE_COOKIES=1 as well, for a local plain-HTTP demo only")
	}
	switch {
	case c.CookieName == "" && c.CookieSecure:
		// The __Host- prefix pins the cookie to this host and path /.
		c.CookieName = "__Host-dsh_gw_session"
	case c.CookieName == "":
		c.CookieName = "dsh_gw_session"
	case !cookieNameRE.MatchString(c.CookieName):
		e.Fail("COOKIE_NAME", "%q is not a valid cookie name", c.CookieName)
	}
	c.AuthProxyGroupsHeader = e.String("AUTH_PROXY_GROUPS_HEADER", "X-Forwarded-Groups")
	for name, h := range map[string]string{"AUTH_PROXY_HEADER": c.AuthProxyHeader, "AUTH_PROXY_ID_HEADER": c.AuthProxyIDHeader, "AUTH_PROXY_GROUPS_HEADER": c.AuthProxyGroupsHeader} {
		if h != "" && !cookieNameRE.MatchString(h) {
			e.Fail(name, "%q is not a valid header name", h)
		}
	}
	c.AuthProxySignOutURL = signOutURL(e, c.AuthProxyHeader != "")
	c.Profiles = loadProfiles(e, c.AuthProxyHeader != "")
	c.MaxSandboxes = maxSandboxes(e)
	checkPolicies(e, c.Profiles, c.Idle)
	if c.AuthProxyHeader != "" && len(c.AuthProxyAllow) == 0 {
		e.Fail("AUTH_PROXY_ALLOW", "required with AUTH_PROXY_HEADER: the logins and group:<name> entries SSO admits (or * for everyone the SSO proxy admits)")
	}
	for _, entry := range e.List("ADMIN_USERS", nil) {
		a, err := ident.ParseAdmin(entry)
		if err != nil {
			e.Fail("ADMIN_USERS", "%q: %v", entry, err)
			continue
		}
		c.AdminUsers = append(c.AdminUsers, a)
	}
	if len(c.AdminGroups) > 0 && c.AuthProxyHeader == "" {
		e.Fail("ADMIN_GROUPS", "needs SSO (AUTH_PROXY_HEADER): groups come from the SSO proxy")
	}
	c.PublicHosts = publicHosts(e)
	c.SandboxDomain = sandboxDomain(e, c.PublicHosts)
	if len(c.Preview.Ports) > 0 && c.SandboxDomain == "" && !e.Set("SANDBOX_DOMAIN") {
		e.Fail("PREVIEW_PORTS", "needs SANDBOX_DOMAIN: each preview is an origin of its own, <port>-<user>.<SANDBOX_DOMAIN>")
	}
	for _, s := range e.List("TRUSTED_PROXIES", nil) {
		p, err := ident.ParseTrustedProxy(s)
		if err != nil {
			e.Fail("TRUSTED_PROXIES", "%v", err)
			continue
		}
		c.TrustedProxies = append(c.TrustedProxies, p)
	}
	c.AdminPlacement = loadAdminPlacement(e, &c)
	return c, e.Err()
}

func publicHosts(e *Env) []string {
	raw := e.List("PUBLIC_HOSTS", nil)
	if len(raw) == 0 {
		e.Fail("PUBLIC_HOSTS", "required: the host names browsers use to reach the gateway, with the port unless 80 or 443 (e.g. gateway.example.com); * accepts any Host (development only: every distinct Host costs a DSH handshake)")
	}
	out := make([]string, 0, len(raw))
	for _, h := range raw {
		if h == "*" {
			out = append(out, h)
			continue
		}
		c, err := ident.ParsePublicHost(h)
		if err != nil {
			e.Fail("PUBLIC_HOSTS", "%v", err)
			continue
		}
		out = append(out, c)
	}
	return out
}

// sandboxDomain reads SANDBOX_DOMAIN: a DNS name (with a port for local
// use) whose one-label subdomains are the sandboxes' origins. No gateway
// host may lie under it: that host would be a sandbox's name too, and
// same-site with every sandbox. "*" in PUBLIC_HOSTS would make every
// host the gateway's, and sign-in needs one gateway host to send
// browsers to.
func sandboxDomain(e *Env, public []string) string {
	raw := e.String("SANDBOX_DOMAIN", "")
	if raw == "" {
		return ""
	}
	d, err := ident.ParsePublicHost(raw)
	if err != nil {
		e.Fail("SANDBOX_DOMAIN", "%v (give the domain only, e.g. sandboxes.example.com or localhost:8080)", err)
		return ""
	}
	name := d
	if i := strings.LastIndexByte(name, ':'); i >= 0 {
		name = name[:i]
	}
	if strings.HasPrefix(name, "[") || net.ParseIP(name) != nil {
		e.Fail("SANDBOX_DOMAIN", "%q is an IP address, which has no subdomains", raw)
		return ""
	}
	for _, h := range public {
		switch {
		case h == "*":
			e.Fail("SANDBOX_DOMAIN", "needs named PUBLIC_HOSTS, not *: sign-in on a sandbox origin sends the browser to the first of them")
		case strings.HasSuffix(h, "."+d):
			e.Fail("SANDBOX_DOMAIN", "PUBLIC_HOSTS entry %q lies under %q: the gateway would share a site with every sandbox and a name with one", h, d)
		}
	}
	return d
}

// signOutURL reads AUTH_PROXY_SIGN_OUT_URL: a path on the gateway's own
// host ("/oauth2/sign_out") or an absolute https URL (the provider's end
// of session). Anything else would make "Sign out" an open redirect or a
// downgrade; without SSO there is no proxy to sign out of.
func signOutURL(e *Env, sso bool) string {
	raw := e.String("AUTH_PROXY_SIGN_OUT_URL", "")
	if raw == "" {
		return ""
	}
	if !sso {
		e.Fail("AUTH_PROXY_SIGN_OUT_URL", "needs SSO (AUTH_PROXY_HEADER): it is the SSO proxy's sign-out")
		return ""
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil || strings.ContainsAny(raw, "\\ \t\r\n"):
		e.Fail("AUTH_PROXY_SIGN_OUT_URL", "%q is not a URL", raw)
	case u.Scheme == "" && u.Host == "" && strings.HasPrefix(raw, "/") && !strings.HasPrefix(raw, "//"):
		return raw
	case u.Scheme == "https" && u.Host != "" && u.User == nil:
		return raw
	default:
		e.Fail("AUTH_PROXY_SIGN_OUT_URL", "%q: give a path on the gateway's host (/oauth2/sign_out) or an https URL", raw)
	}
	return ""
}

var cookieNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// Lifecycle is the configuration of cmd/lifecycle.
type Lifecycle struct {
	Common
	Kube
	// Notify is the webhook (loadNotify).
	Notify Notify
	// Profiles is PROFILES (or WARM_POOL's one default profile): the warm
	// pool each claim draws from.
	Profiles Profiles
	// MaxSandboxes is MAX_SANDBOXES_PER_USER (maxSandboxes): lifecycle
	// holds each account to it.
	MaxSandboxes int
	// Rollout is ROLLOUT: "manual" (a sandbox keeps the pod template it
	// was made with) or "next-wake" (a sleeping sandbox whose profile's
	// SandboxTemplate changed takes the new pod template as it wakes).
	// RolloutPercent is ROLLOUT_PERCENT, the share of sandboxes (by a hash
	// of their key) next-wake updates: a canary below 100. RolloutGroups
	// is ROLLOUT_GROUPS: the SSO groups whose members' sandboxes it
	// updates besides (state.GroupName each), a canary of people.
	Rollout        string
	RolloutPercent int
	RolloutGroups  []string
	// RolloutProbation is ROLLOUT_PROBATION: a rolled sandbox whose pod of
	// the new revision fails (ends, or as sandbox.PodFailing says) within
	// it is rolled back, and the revision halted for all.
	RolloutProbation time.Duration
	// LogTailLines is DSH_LOG_TAIL_LINES, how much of the pod log is
	// searched for the launch token.
	LogTailLines int
	// Container is DSH_CONTAINER; empty means the pod's first container.
	Container string
	// Port is DSH_PORT.
	Port int
	// UpstreamAddress is UPSTREAM_ADDRESS: pod-ip or service.
	UpstreamAddress string
	// HandshakeKeys is HANDSHAKE_KEYS, the key ring shared with lifecycle
	// (newest first).
	HandshakeKeys [][]byte
	Commands
	// HandshakeTimeout is HANDSHAKE_TIMEOUT, the edge's wait for a
	// handshake: one handshake command, every log read, candidate token and
	// retry included, ends within it, however a tenant's pod answers.
	HandshakeTimeout time.Duration
	// HandshakeWorkers is HANDSHAKE_WORKERS: the most of COMMAND_WORKERS
	// that handshakes may hold at once (a handshake talks to a tenant's
	// pod), so claims, wakes and the rest always find a worker.
	HandshakeWorkers int
	// LeaseTTL is LEASE_TTL, for the one replica that mirrors Kubernetes.
	LeaseTTL time.Duration
	// RecreateTimeout is RECREATE_TIMEOUT, how long /recreate waits for
	// the old sandbox to be gone.
	RecreateTimeout time.Duration
	// LogLimitBytes is DSH_LOG_LIMIT_BYTES: how much of the pod log one
	// handshake reads at most (the tenant writes the log).
	LogLimitBytes int64
	// MaxRunning is MAX_RUNNING_SANDBOXES and MaxStarts is
	// MAX_CONCURRENT_STARTS (0: no cap); wakes beyond them queue.
	MaxRunning, MaxStarts int
	// PruneInterval is PRUNE_INTERVAL: how often the mirroring replica
	// removes the sessions of accounts that are gone.
	PruneInterval time.Duration
}

// rolloutGroups is ROLLOUT_GROUPS, each as the edges keep a user's groups
// (state.GroupName), so that they compare equal.
func rolloutGroups(e *Env) []string {
	var out []string
	for _, g := range e.List("ROLLOUT_GROUPS", nil) {
		n := state.GroupName(g)
		if n == "" {
			e.Fail("ROLLOUT_GROUPS", "%q is no group name (at most %d bytes, no control characters)", g, state.MaxGroupLen)
			continue
		}
		out = append(out, n)
	}
	return out
}

// LoadLifecycle reads and validates the lifecycle worker's variables.
func LoadLifecycle(e *Env) (Lifecycle, error) {
	c := Lifecycle{
		Common:           LoadCommon(e, ":9091"),
		Kube:             loadKube(e),
		Notify:           loadNotify(e),
		Profiles:         loadProfiles(e, true),
		MaxSandboxes:     maxSandboxes(e),
		Rollout:          e.OneOf("ROLLOUT", "manual", "manual", "next-wake"),
		RolloutPercent:   e.Int("ROLLOUT_PERCENT", 100, 0, 100),
		RolloutGroups:    rolloutGroups(e),
		RolloutProbation: e.Duration("ROLLOUT_PROBATION", 10*time.Minute, time.Minute, 24*time.Hour),
		LogTailLines:     e.Int("DSH_LOG_TAIL_LINES", 1000, 1, 100000),
		Container:        e.String("DSH_CONTAINER", ""),
		Port:             dshPort(e),
		UpstreamAddress:  e.OneOf("UPSTREAM_ADDRESS", "pod-ip", "pod-ip", "service"),
		HandshakeKeys:    handshakeKeys(e),
		Commands:         loadCommands(e),
		HandshakeTimeout: handshakeTimeout(e),
		LeaseTTL:         e.Duration("LEASE_TTL", 10*time.Second, time.Second, 5*time.Minute),
		RecreateTimeout:  e.Duration("RECREATE_TIMEOUT", 2*time.Minute, 5*time.Second, time.Hour),
		LogLimitBytes:    int64(e.Int("DSH_LOG_LIMIT_BYTES", 256<<10, 4<<10, 1<<20)),
		MaxRunning:       maxRunning(e),
		MaxStarts:        e.Int("MAX_CONCURRENT_STARTS", 0, 0, 100_000),
		PruneInterval:    e.Duration("PRUNE_INTERVAL", time.Minute, time.Second, 24*time.Hour),
	}
	c.HandshakeWorkers = handshakeWorkers(e, c.Workers)
	return c, e.Err()
}

// handshakeTimeout reads HANDSHAKE_TIMEOUT, which the edge waits for and
// lifecycle keeps to.
func handshakeTimeout(e *Env) time.Duration {
	return e.Duration("HANDSHAKE_TIMEOUT", 15*time.Second, time.Second, 10*time.Minute)
}

// handshakeWorkers reads HANDSHAKE_WORKERS: by default half the workers.
// It must leave at least one worker to the other commands, unless there is
// only one.
func handshakeWorkers(e *Env, workers int) int {
	n := e.Int("HANDSHAKE_WORKERS", max(workers/2, 1), 1, 1024)
	if workers > 1 && n >= workers {
		e.Fail("HANDSHAKE_WORKERS", "%d leaves none of the %d COMMAND_WORKERS to claims and wakes: a tenant whose pod stalls handshakes could hold them all; set it below COMMAND_WORKERS", n, workers)
	}
	if workers == 1 && n > 1 {
		e.Fail("HANDSHAKE_WORKERS", "%d is more than the one COMMAND_WORKER", n)
	}
	return n
}

// Kube is how lifecycle (and `lifecycle adopt`) reaches Kubernetes and
// which claims are the gateway's.
type Kube struct {
	// Kubeconfig is KUBECONFIG; empty means in-cluster credentials.
	Kubeconfig string
	// SandboxNamespace is SANDBOX_NAMESPACE, where the tenants' claims,
	// sandboxes and pods live, with the template, warm pool and quota.
	SandboxNamespace string
	// ControlPlaneNamespace is CONTROL_PLANE_NAMESPACE, where lifecycle
	// itself runs beside NATS, the edges and the Secrets; the manifests set
	// it from the pod's own namespace. It must differ from the sandboxes'.
	ControlPlaneNamespace string
	// ManagedKey and ManagedValue come from MANAGED_BY_LABEL (key=value).
	ManagedKey, ManagedValue string
	// KubeQPS and KubeBurst are KUBE_API_QPS and KUBE_API_BURST, the API
	// client's rate (every handshake reads a pod log); KubeCallTimeout is
	// KUBE_API_TIMEOUT, the bound on one API call.
	KubeQPS         float32
	KubeBurst       int
	KubeCallTimeout time.Duration
}

func loadKube(e *Env) Kube {
	c := Kube{
		Kubeconfig:            e.String("KUBECONFIG", ""),
		SandboxNamespace:      e.String("SANDBOX_NAMESPACE", DefaultSandboxNamespace),
		ControlPlaneNamespace: e.String("CONTROL_PLANE_NAMESPACE", DefaultControlPlaneNamespace),
		KubeQPS:               float32(e.Int("KUBE_API_QPS", 50, 1, 10_000)),
		KubeBurst:             e.Int("KUBE_API_BURST", 100, 1, 20_000),
		KubeCallTimeout:       e.Duration("KUBE_API_TIMEOUT", 30*time.Second, time.Second, 10*time.Minute),
	}
	c.ManagedKey, c.ManagedValue = managedLabel(e)
	if e.Set("NAMESPACE") {
		e.Fail("NAMESPACE", "renamed SANDBOX_NAMESPACE (the namespace of the sandboxes, their claims and pods; the control plane's own is CONTROL_PLANE_NAMESPACE)")
	}
	for name, ns := range map[string]string{"SANDBOX_NAMESPACE": c.SandboxNamespace, "CONTROL_PLANE_NAMESPACE": c.ControlPlaneNamespace} {
		if !dns1123.MatchString(ns) {
			e.Fail(name, "%q is not a valid namespace name", ns)
		}
	}
	if c.SandboxNamespace == c.ControlPlaneNamespace {
		e.Fail("SANDBOX_NAMESPACE", "%q is also CONTROL_PLANE_NAMESPACE: tenants' pods would share a namespace, its quota and its Secrets with NATS, the edges and lifecycle", c.SandboxNamespace)
	}
	return c
}

// The namespaces the manifests install into (manifests/base and
// manifests/sandbox; a deployment test keeps them equal): the control
// plane's, and the tenants' own.
const (
	DefaultControlPlaneNamespace = "aaas"
	DefaultSandboxNamespace      = "aaas-sandboxes"
)

// Commands is how lifecycle consumes the command stream; setup creates the
// consumer with the same values.
type Commands struct {
	// Workers is COMMAND_WORKERS; MaxDeliver is COMMAND_MAX_DELIVER.
	Workers, MaxDeliver int
	// AckWait is COMMAND_ACK_WAIT: how long a command may go without a
	// sign of life before another replica gets it.
	AckWait time.Duration
}

func loadCommands(e *Env) Commands {
	return Commands{
		Workers:    e.Int("COMMAND_WORKERS", 16, 1, 1024),
		MaxDeliver: e.Int("COMMAND_MAX_DELIVER", 5, 1, 100),
		AckWait:    e.Duration("COMMAND_ACK_WAIT", 30*time.Second, time.Second, 10*time.Minute),
	}
}

// Setup is the provisioning step's configuration: it creates the streams,
// buckets and the commands' consumer every other process only checks for.
type Setup struct {
	Common
	Commands
}

// LoadSetup reads and validates the setup step's variables.
func LoadSetup(e *Env) (Setup, error) {
	c := Setup{Common: LoadCommon(e, ""), Commands: loadCommands(e)}
	return c, e.Err()
}

var (
	dns1123    = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	labelKey   = regexp.MustCompile(`^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$`)
	labelValue = regexp.MustCompile(`^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$`)
)

func managedLabel(e *Env) (string, string) {
	const def = "aaas.example.com/managed-by=dsh-gateway"
	v := e.String("MANAGED_BY_LABEL", def)
	k, val, ok := strings.Cut(v, "=")
	if !ok || !labelKey.MatchString(k) || val == "" || !labelValue.MatchString(val) {
		e.Fail("MANAGED_BY_LABEL", "%q is not a label key=value", v)
		k, val, _ = strings.Cut(def, "=")
	}
	return k, val
}

// handshakeKey reads HANDSHAKE_KEYS, the AES-256 key that seals DSH auth
// cookies in NATS. The edge and lifecycle must share it.
// handshakeKeys reads the key ring: comma-separated keys, newest first.
// The first seals new cookies; any of them opens, so a key can be rotated
// in without a moment in which some replica cannot read what another wrote.
func handshakeKeys(e *Env) [][]byte {
	if e.Set("HANDSHAKE_KEY") {
		e.Fail("HANDSHAKE_KEY", "renamed HANDSHAKE_KEYS (a comma-separated key ring, newest first)")
	}
	v := e.Secret("HANDSHAKE_KEYS")
	if v == "" {
		e.Fail("HANDSHAKE_KEYS", "required: 32 random bytes, base64 (e.g. `openssl rand -base64 32`), newest first when several")
		return nil
	}
	var keys [][]byte
	for i, s := range strings.Split(v, ",") {
		k, err := handshake.ParseKey(strings.TrimSpace(s))
		if err != nil {
			e.Fail("HANDSHAKE_KEYS", "key %d: %v", i+1, err)
			continue
		}
		keys = append(keys, k)
	}
	if len(keys) > 4 {
		e.Fail("HANDSHAKE_KEYS", "%d keys: keep at most 4 (the newest, and those still being rotated out)", len(keys))
	}
	return keys
}

// Sweeper is the configuration of cmd/sweeper.
type Sweeper struct {
	Common
	// Policy is IDLE_TIMEOUT and MAX_RUNTIME (idlePolicy); Profiles
	// (PROFILES) may give their sandboxes their own.
	Policy   idle.Policy
	Profiles Profiles
	// Notify is the webhook (loadNotify).
	Notify Notify
	// Interval is SWEEP_INTERVAL, default a tenth of IDLE_TIMEOUT (at
	// most 30s).
	Interval time.Duration
	// LeaseTTL is LEASE_TTL: a standby takes over within it.
	LeaseTTL time.Duration
	// MaxRunning is MAX_RUNNING_SANDBOXES; with IdleEvict (IDLE_EVICT)
	// the sweeper suspends the longest-idle sandboxes while wakes wait.
	MaxRunning int
	IdleEvict  bool
}

// maxSandboxes is MAX_SANDBOXES_PER_USER, read by the edge (which offers
// named sandboxes when it is above 1) and lifecycle (which keeps each
// account to it): how many sandboxes an account may have, its first one
// included. 1 is one sandbox per account, as before named sandboxes.
func maxSandboxes(e *Env) int { return e.Int("MAX_SANDBOXES_PER_USER", 1, 1, 100) }

// maxRunning is MAX_RUNNING_SANDBOXES, read by lifecycle (which admits)
// and the sweeper (which evicts).
func maxRunning(e *Env) int { return e.Int("MAX_RUNNING_SANDBOXES", 0, 0, 10_000_000) }

// LoadSweeper reads and validates the sweeper's variables.
func LoadSweeper(e *Env) (Sweeper, error) {
	c := Sweeper{
		Common:     LoadCommon(e, ":9092"),
		Policy:     idlePolicy(e),
		Notify:     loadNotify(e),
		LeaseTTL:   e.Duration("LEASE_TTL", 10*time.Second, time.Second, 5*time.Minute),
		MaxRunning: maxRunning(e),
		IdleEvict:  e.Bool("IDLE_EVICT", false),
		Profiles:   loadProfiles(e, true),
	}
	checkPolicies(e, c.Profiles, c.Policy)
	if c.IdleEvict && c.MaxRunning == 0 {
		e.Fail("IDLE_EVICT", "needs MAX_RUNNING_SANDBOXES: eviction makes room under that cap")
	}
	c.Interval = e.Duration("SWEEP_INTERVAL", min(max(c.Policy.IdleTimeout/10, 100*time.Millisecond), 30*time.Second), 50*time.Millisecond, time.Hour)
	return c, e.Err()
}

// idlePolicy reads IDLE_TIMEOUT (a Ready sandbox with nothing in flight
// and no activity for this long is suspended), MAX_RUNTIME (one awake
// this long without a keep-awake is suspended even if busy; 0, the
// default, is no ceiling), and DORMANT_AFTER and DORMANT_DELETE_AFTER
// (idle.Policy.Dormancy; both off by default). The sweeper decides by them; the edge shows
// users when their sandbox will be suspended by the same rule.
func idlePolicy(e *Env) idle.Policy {
	p := idle.Policy{
		IdleTimeout: e.Duration("IDLE_TIMEOUT", 15*time.Minute, time.Second, 30*24*time.Hour),
		MaxRuntime:  e.Duration("MAX_RUNTIME", 0, 0, 365*24*time.Hour),
	}
	p.DormantAfter = e.Duration("DORMANT_AFTER", 0, 0, 10*365*24*time.Hour)
	p.DormantDeleteAfter = e.Duration("DORMANT_DELETE_AFTER", 0, 0, 10*365*24*time.Hour)
	if p.DormantDeleteAfter > 0 && p.DormantAfter == 0 {
		e.Fail("DORMANT_DELETE_AFTER", "needs DORMANT_AFTER: accounts are deleted that long after they became dormant")
	}
	if p.MaxRuntime > 0 && p.MaxRuntime < p.IdleTimeout {
		e.Fail("MAX_RUNTIME", "%s is shorter than IDLE_TIMEOUT (%s): every sandbox would meet the ceiling before it could fall idle", p.MaxRuntime, p.IdleTimeout)
	}
	return p
}

// Notify is NOTIFY_WEBHOOK_URL and NOTIFY_WEBHOOK_SECRET (notify.Options),
// read by the sweeper (suspend warnings, dormancy) and lifecycle
// (suspends, deletions).
type Notify struct {
	URL    string
	Secret []byte
	// Attempts and Backoff bound the tries per notice: 5, 1s apart at
	// first, doubling (about half a minute in all).
	Attempts int
	Backoff  time.Duration
	// Queue is how many notices may wait.
	Queue int
	// WarnBefore is NOTIFY_WARN_BEFORE: how long before a suspend the
	// sweeper warns.
	WarnBefore time.Duration
}

func loadNotify(e *Env) Notify {
	n := Notify{URL: e.String("NOTIFY_WEBHOOK_URL", ""), Attempts: 5, Backoff: time.Second, Queue: 10_000,
		WarnBefore: e.Duration("NOTIFY_WARN_BEFORE", 5*time.Minute, time.Second, 24*time.Hour)}
	if n.URL == "" {
		return n
	}
	if u, err := url.Parse(n.URL); err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.User != nil {
		e.Fail("NOTIFY_WEBHOOK_URL", "%q is not an http(s) URL without credentials", n.URL)
	}
	n.Secret = []byte(e.Secret("NOTIFY_WEBHOOK_SECRET"))
	if len(n.Secret) < 16 {
		e.Fail("NOTIFY_WEBHOOK_SECRET", "required with NOTIFY_WEBHOOK_URL, at least 16 bytes: the notices' HMAC key (e.g. `openssl rand -hex 32`)")
	}
	return n
}

// routeMaxStaleness reads ROUTE_MAX_STALENESS, the longest an edge (which
// routes by it) or a broker (which attributes by it) acts on its copy of
// the sandboxes bucket without confirming it current.
func routeMaxStaleness(e *Env) time.Duration {
	return e.Duration("ROUTE_MAX_STALENESS", 2*time.Minute, 5*time.Second, time.Hour)
}

// shutdownTimeout reads SHUTDOWN_TIMEOUT, the drain deadline on SIGTERM
// of an edge's requests or a broker's calls.
func shutdownTimeout(e *Env) time.Duration {
	return e.Duration("SHUTDOWN_TIMEOUT", 25*time.Second, 0, 10*time.Minute)
}

// beaconInterval reads BEACON_INTERVAL, the heartbeat period of a user's
// activity beacons while an edge's request or a broker's model call is in
// flight.
func beaconInterval(e *Env) time.Duration {
	return e.Duration("BEACON_INTERVAL", 5*time.Second, 100*time.Millisecond, 5*time.Minute)
}

// beaconTTL reads BEACON_TTL, how long a beacon reporting work in flight
// may be trusted, which must outlast two heartbeats of interval.
func beaconTTL(e *Env, interval time.Duration) time.Duration {
	ttl := e.Duration("BEACON_TTL", 2*time.Minute, time.Second, events.MaxBeaconTTL)
	if ttl < 2*interval {
		e.Fail("BEACON_TTL", "%s is less than two BEACON_INTERVALs (%s): one late beacon would let a busy sandbox look idle", ttl, interval)
	}
	return ttl
}

// keyRing reads a comma-separated ring of 32-byte keys (base64 or hex),
// newest first; at most 4.
func keyRing(e *Env, name string) [][]byte {
	var keys [][]byte
	for i, s := range strings.Split(e.Secret(name), ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		k, err := handshake.ParseKey(s)
		if err != nil {
			e.Fail(name, "key %d: %v", i+1, err)
			continue
		}
		keys = append(keys, k)
	}
	if len(keys) > 4 {
		e.Fail(name, "%d keys: keep at most 4 (the newest, and those still being rotated out)", len(keys))
	}
	return keys
}

// Secrets is `setup secrets`, the chart's pre-install step: it creates the
// install's generated Secrets in the control plane's namespace when they
// are absent, and never replaces one that exists.
type Secrets struct {
	// Namespace is CONTROL_PLANE_NAMESPACE.
	Namespace string
	// App is GENERATE_APP_SECRET, the Secret of handshake-keys and
	// invite-code; NATS is GENERATE_NATS_SECRET (the identities and the
	// route password) and NATSTLS GENERATE_NATS_TLS_SECRET (the NATS
	// nodes' CA and certificate). Each empty one is not generated: the
	// operator brings it.
	App, NATS, NATSTLS string
	// CallTimeout is KUBE_API_TIMEOUT.
	CallTimeout time.Duration
}

// LoadSecrets reads and validates `setup secrets`' variables.
func LoadSecrets(e *Env) (Secrets, error) {
	c := Secrets{
		Namespace:   e.String("CONTROL_PLANE_NAMESPACE", DefaultControlPlaneNamespace),
		App:         e.String("GENERATE_APP_SECRET", ""),
		NATS:        e.String("GENERATE_NATS_SECRET", ""),
		NATSTLS:     e.String("GENERATE_NATS_TLS_SECRET", ""),
		CallTimeout: e.Duration("KUBE_API_TIMEOUT", 30*time.Second, time.Second, 10*time.Minute),
	}
	for name, v := range map[string]string{"CONTROL_PLANE_NAMESPACE": c.Namespace, "GENERATE_APP_SECRET": c.App, "GENERATE_NATS_SECRET": c.NATS, "GENERATE_NATS_TLS_SECRET": c.NATSTLS} {
		if v != "" && !dns1123.MatchString(v) {
			e.Fail(name, "%q is not a valid Kubernetes name", v)
		}
	}
	return c, e.Err()
}

// Smoke is `setup smoke`, the chart's `helm test` checks (package smoke).
type Smoke struct {
	// URL is SMOKE_URL, where the checks connect; Host is SMOKE_HOST, the
	// gateway's public host name; CAFile is SMOKE_CA_FILE, the CA of an
	// https front door (empty: not verified); Invite is SMOKE_INVITE.
	URL, Host, CAFile, Invite string
	// Timeout is SMOKE_TIMEOUT, the bound on each request.
	Timeout time.Duration
}

// LoadSmoke reads and validates `setup smoke`'s variables.
func LoadSmoke(e *Env) (Smoke, error) {
	c := Smoke{
		URL:     e.String("SMOKE_URL", "http://aaas-edge:8080"),
		Host:    e.String("SMOKE_HOST", ""),
		CAFile:  e.String("SMOKE_CA_FILE", ""),
		Invite:  e.Secret("SMOKE_INVITE"),
		Timeout: e.Duration("SMOKE_TIMEOUT", 20*time.Second, time.Second, 10*time.Minute),
	}
	if u, err := url.Parse(c.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		e.Fail("SMOKE_URL", "%q is not an http or https URL", c.URL)
	}
	if c.Host == "" {
		e.Fail("SMOKE_HOST", "required: the gateway's public host name")
	}
	return c, e.Err()
}

// CacheLimits are the edge's bounded caches' limits for EDGE_CACHE_USERS:
// per user, one account and one sandbox record, and room for the
// sessions (a browser or two, and their sandbox origins'), the
// handshakes (one per pod and host) and the API tokens in use (a script
// or two) of the users it serves.
type CacheLimits struct {
	Users, Sandboxes, Sessions, Handshakes, APITokens int
}

// CacheLimits derives the caches' limits from CacheUsers.
func (c Edge) CacheLimits() CacheLimits {
	return CacheLimits{Users: c.CacheUsers, Sandboxes: c.CacheUsers, Sessions: 4 * c.CacheUsers, Handshakes: 2 * c.CacheUsers, APITokens: 2 * c.CacheUsers}
}
