package events

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/state"
)

// SchemaVersion is the version of the messages this build writes (but
// for the token command: tokenVersion). Readers accept any version up to
// the newest they know (SchemaVersion; CommandReadsUpTo for commands) and
// never half-understand a newer one: a command of a newer version goes
// back to the queue for a newer replica (ErrNewerSchema), so a rolling
// upgrade loses nothing.
const SchemaVersion = 1

// CommandReadsUpTo is the newest command version this build reads.
const CommandReadsUpTo = namedVersion

// tokenVersion is the version of the token command, new in 0.3.0: a 0.2.0
// lifecycle, which reads 1 only, hands it back to the queue for a newer
// replica instead of refusing a verb it does not know.
const tokenVersion = 2

// profileVersion is the version of a claim or recreate that names a
// profile, new in 0.4.0: a lifecycle that predates profiles would make
// the default one, so it hands the command back for a newer replica
// instead. One that names none keeps the old version, which every
// release reads the same.
const profileVersion = 3

// namedVersion is the version of a claim or delete of a named sandbox
// (a key "<user>--<name>", ident.SandboxKey), new in 0.5.0: a lifecycle
// that predates named sandboxes would refuse the claim, which carries no
// token hash, and take the delete for an account's, so it hands both
// back for a newer replica instead.
const namedVersion = 4

// ErrNewerSchema marks a message written by a newer build than this one.
var ErrNewerSchema = errors.New("written by a newer version")

const (
	commandPrefix  = "aaas.cmd."
	activityPrefix = "aaas.activity."
	auditPrefix    = "aaas.audit."
	usagePrefix    = "aaas.usage."
)

// Verb names a lifecycle command.
type Verb string

// The lifecycle verbs.
const (
	VerbClaim     Verb = "claim"
	VerbWake      Verb = "wake"
	VerbHandshake Verb = "handshake"
	VerbSuspend   Verb = "suspend"
	VerbDelete    Verb = "delete"
	VerbRecreate  Verb = "recreate"
	// VerbToken replaces an account's bearer token (its hash).
	VerbToken Verb = "token"
)

// Verbs lists every verb, for metrics and validation.
var Verbs = []Verb{VerbClaim, VerbWake, VerbHandshake, VerbSuspend, VerbDelete, VerbRecreate, VerbToken}

// CommandSubject is aaas.cmd.<verb>.<user>.
func CommandSubject(v Verb, user string) string { return commandPrefix + string(v) + "." + user }

// CommandSubjectsAll matches every command.
const CommandSubjectsAll = commandPrefix + ">"

// ActivitySubject is aaas.activity.<user>.<edge>.
func ActivitySubject(user, edge string) string { return activityPrefix + user + "." + edge }

// ActivitySubjectUser matches every edge's beacons for one user.
func ActivitySubjectUser(user string) string { return activityPrefix + user + ".*" }

// ActivitySubjectsAll matches every beacon.
const ActivitySubjectsAll = activityPrefix + ">"

// AuditSubject is aaas.audit.<kind>.<user>; user "-" for events without one.
func AuditSubject(k AuditKind, user string) string {
	if user == "" {
		user = "-"
	}
	return auditPrefix + string(k) + "." + user
}

// AuditSubjectsAll matches every audit event.
const AuditSubjectsAll = auditPrefix + ">"

// Command is the one message type on the command stream. Verb-specific
// arguments live in the matching optional field; Validate checks that the
// right one is present.
type Command struct {
	V    int    `json:"v"`
	Verb Verb   `json:"verb"`
	User string `json:"user"`
	// ID is the Nats-Msg-Id. It is derived from the state the command acts
	// on, so every replica that asks for the same change produces the same
	// ID and the stream keeps one copy.
	ID string `json:"id"`
	// RequestID is set when a requester waits for the outcome (signup,
	// delete, recreate); lifecycle writes the answer under it.
	RequestID string `json:"request_id,omitempty"`
	// Trace is the id of the HTTP request that asked for the command (the
	// edge's X-Request-Id): lifecycle quotes it in its log lines and audit
	// events, so one grep follows a request across processes. A label
	// only: a collapsed duplicate keeps the first asker's. A release that
	// does not know it loses nothing it acts on, so it takes no new
	// schema version.
	Trace    string    `json:"trace,omitempty"`
	IssuedBy string    `json:"issued_by,omitempty"`
	IssuedAt time.Time `json:"issued_at"`

	Claim     *ClaimArgs     `json:"claim,omitempty"`
	Suspend   *SuspendArgs   `json:"suspend,omitempty"`
	Handshake *HandshakeArgs `json:"handshake,omitempty"`
	Token     *TokenArgs     `json:"token,omitempty"`
	Recreate  *RecreateArgs  `json:"recreate,omitempty"`
}

// TokenArgs carries an account's new token.
type TokenArgs struct {
	// TokenHash is the hex SHA-256 of the new bearer token, which never
	// leaves the edge that minted it.
	TokenHash string `json:"token_hash"`
	// By says who asked: "user", or "admin:<name>".
	By string `json:"by"`
}

// ClaimArgs carries what a new account needs.
type ClaimArgs struct {
	// TokenHash is the hex SHA-256 of the user's bearer token; the token
	// itself never leaves the edge that minted it.
	TokenHash string `json:"token_hash"`
	// Profile names the profile (config.Profiles) the sandbox is made of;
	// empty: the default.
	Profile string `json:"profile,omitempty"`
}

// RecreateArgs carries what a recreate changes.
type RecreateArgs struct {
	// Profile names the profile the new sandbox is made of; empty: the
	// one the old sandbox was.
	Profile string `json:"profile,omitempty"`
}

// SuspendArgs carries the sweeper's evidence, so lifecycle can refuse the
// suspend when anything newer has happened since the decision.
type SuspendArgs struct {
	// ActivitySeq is the highest activity-stream sequence for this user the
	// sweeper had seen when it decided.
	ActivitySeq uint64    `json:"activity_seq"`
	IdleSince   time.Time `json:"idle_since"`
	// By names the administrator who asked; such a suspend is carried out
	// however recently the sandbox was used. (A worker that predates the
	// field sees no evidence and cancels it if there was any activity.)
	By string `json:"by,omitempty"`
	// Reason is why (an idle.Reason: idle, idle_connected, max_runtime,
	// evicted, admin, user); empty from a build that predates it, read as
	// idle, or admin when By is set. Forced reasons are carried out
	// whatever the activity since.
	Reason string `json:"reason,omitempty"`
	// Detail is the decision in words, for the audit and the user's page.
	Detail string `json:"detail,omitempty"`
}

// HandshakeArgs says which pod and which browser Host the DSH auth cookie is
// for, plus the forwarded headers DSH should see during the handshake.
type HandshakeArgs struct {
	PodUID string `json:"pod_uid"`
	Host   string `json:"host"`
	Proto  string `json:"proto,omitempty"`
	Prefix string `json:"prefix,omitempty"`
	// StaleRevision is the handshakes-bucket revision the requester found
	// unusable (0 when there was none); it makes a refresh a new command.
	StaleRevision uint64 `json:"stale_revision,omitempty"`
}

// Subject is where the command is published.
func (c Command) Subject() string { return CommandSubject(c.Verb, c.User) }

// Validate checks the fields a handler relies on.
func (c Command) Validate() error {
	if c.V < 1 || c.V > CommandReadsUpTo {
		return fmt.Errorf("unsupported command schema version %d (this build reads 1..%d)", c.V, CommandReadsUpTo)
	}
	if c.User == "" || strings.ContainsAny(c.User, ".*> ") {
		return fmt.Errorf("invalid user %q", c.User)
	}
	if c.ID == "" {
		return fmt.Errorf("command without id")
	}
	if len(c.Trace) > maxTrace {
		return fmt.Errorf("trace of %d bytes (at most %d)", len(c.Trace), maxTrace)
	}
	switch c.Verb {
	case VerbClaim:
		// An account's claim carries its token's hash; a named sandbox
		// belongs to an account that exists, and carries none.
		if _, name, _ := ident.SplitSandboxKey(c.User); c.Claim == nil || name == "" && len(c.Claim.TokenHash) != 64 || name != "" && c.Claim.TokenHash != "" {
			return fmt.Errorf("claim without a token hash, or a named sandbox's with one")
		}
		return validProfile(c.Claim.Profile)
	case VerbRecreate:
		if c.Recreate != nil {
			return validProfile(c.Recreate.Profile)
		}
	case VerbDelete, VerbWake:
	case VerbToken:
		if c.Token == nil || len(c.Token.TokenHash) != 64 {
			return fmt.Errorf("token without a token hash")
		}
	case VerbSuspend:
		if c.Suspend == nil {
			return fmt.Errorf("suspend without evidence")
		}
	case VerbHandshake:
		if c.Handshake == nil || c.Handshake.PodUID == "" || c.Handshake.Host == "" {
			return fmt.Errorf("handshake without pod uid and host")
		}
	default:
		return fmt.Errorf("unknown verb %q", c.Verb)
	}
	return nil
}

// validProfile checks a command's profile name ("" is the default).
func validProfile(name string) error {
	if name == "" {
		return nil
	}
	if err := ident.ValidateProfile(name); err != nil {
		return fmt.Errorf("profile %q: %w", name, err)
	}
	return nil
}

// maxTrace bounds Command.Trace: the edge passes on an ingress's request
// id of at most 64 bytes, or its own shorter one.
const maxTrace = 64

func newCommand(v Verb, user, id string) Command {
	return Command{V: SchemaVersion, Verb: v, User: user, ID: string(v) + "." + user + "." + id, IssuedAt: time.Now().UTC()}
}

// NewClaim asks for an account whose sandbox is of profile ("": the
// default). requestID is unique per signup attempt.
func NewClaim(user, requestID, tokenHash, profile string) Command {
	c := newCommand(VerbClaim, user, requestID)
	c.RequestID = requestID
	c.Claim = &ClaimArgs{TokenHash: tokenHash, Profile: profile}
	if profile != "" {
		c.V = profileVersion
	}
	return c
}

// NewSandbox asks for the named sandbox of key (ident.SandboxKey: its
// owner's account exists) of profile ("": the default). requestID is
// unique per attempt.
func NewSandbox(key, requestID, profile string) Command {
	c := newCommand(VerbClaim, key, requestID)
	c.V, c.RequestID = namedVersion, requestID
	c.Claim = &ClaimArgs{Profile: profile}
	return c
}

// NewWake asks for a sandbox to run. stateRev is the sandboxes-bucket
// revision the requester saw, so any number of edges waking the same
// suspended sandbox publish one command, and a later suspension gets a new one.
func NewWake(user string, stateRev uint64) Command {
	return newCommand(VerbWake, user, strconv.FormatUint(stateRev, 10))
}

// NewSuspend records the sweeper's decision and why (an idle.Reason).
func NewSuspend(user string, activitySeq, stateRev uint64, idleSince time.Time, reason, detail string) Command {
	c := newCommand(VerbSuspend, user, strconv.FormatUint(stateRev, 10)+"."+strconv.FormatUint(activitySeq, 10))
	c.Suspend = &SuspendArgs{ActivitySeq: activitySeq, IdleSince: idleSince.UTC(), Reason: reason, Detail: detail}
	return c
}

// NewAdminSuspend is an administrator's suspend of user's sandbox as of
// its state revision stateRev: administrators asking at once ask once.
func NewAdminSuspend(user string, stateRev uint64, by string) Command {
	c := newCommand(VerbSuspend, user, strconv.FormatUint(stateRev, 10)+".admin")
	c.Suspend = &SuspendArgs{By: by, Reason: "admin"}
	return c
}

// NewUserSuspend is the user's own "suspend now", as of the sandbox's
// state revision stateRev (a double click asks once).
func NewUserSuspend(user string, stateRev uint64) Command {
	c := newCommand(VerbSuspend, user, strconv.FormatUint(stateRev, 10)+".user")
	c.Suspend = &SuspendArgs{Reason: "user"}
	return c
}

// NewHandshake asks for a DSH auth cookie for (user, pod, host).
func NewHandshake(user string, a HandshakeArgs) Command {
	c := newCommand(VerbHandshake, user, a.PodUID+"."+state.HostKey(a.Host)+"."+strconv.FormatUint(a.StaleRevision, 10))
	c.Handshake = &a
	return c
}

// NewDelete asks for an account and everything in it to go, or, for a
// named sandbox's key, that sandbox and its volume.
func NewDelete(key, requestID string) Command {
	c := newCommand(VerbDelete, key, requestID)
	c.RequestID = requestID
	if _, name, _ := ident.SplitSandboxKey(key); name != "" {
		c.V = namedVersion
	}
	return c
}

// NewToken asks for user's bearer token to be replaced by the one whose
// hash is tokenHash; requestID is unique per attempt.
func NewToken(user, requestID, tokenHash, by string) Command {
	c := newCommand(VerbToken, user, requestID)
	c.V, c.RequestID = tokenVersion, requestID
	c.Token = &TokenArgs{TokenHash: tokenHash, By: by}
	return c
}

// NewRecreate asks for a fresh sandbox and volume under the same account,
// of profile ("": the one it was).
func NewRecreate(user, requestID, profile string) Command {
	c := newCommand(VerbRecreate, user, requestID)
	c.RequestID = requestID
	if profile != "" {
		c.V, c.Recreate = profileVersion, &RecreateArgs{Profile: profile}
	}
	return c
}

// Beacon is an edge's report of one user's activity. The newest beacon per
// (user, edge) is that edge's view; the sweeper combines them.
type Beacon struct {
	V    int    `json:"v"`
	User string `json:"user"`
	Edge string `json:"edge"`
	// InFlight counts the work in flight for the user on this sender right
	// now: an edge's requests and the streams (WebSockets, streamed
	// responses) that had browser input within IDLE_CONNECTED_TIMEOUT; a
	// broker's model calls.
	InFlight int `json:"in_flight"`
	// IdleStreams counts the streams open on this edge that no longer
	// count as activity (no browser input for IDLE_CONNECTED_TIMEOUT).
	IdleStreams int `json:"idle_streams,omitempty"`
	// LastActive is when this edge last started or finished work for the user.
	LastActive time.Time `json:"last_active"`
	SentAt     time.Time `json:"sent_at"`
	// TTL is how long this beacon's InFlight may be trusted; an edge that
	// stops sending (crashed, partitioned) stops pinning the sandbox after it.
	TTL time.Duration `json:"ttl"`
}

// MaxBeaconTTL bounds how long one beacon may pin a sandbox, whatever the
// edge (or whoever publishes under its name) claims.
const MaxBeaconTTL = 5 * time.Minute

// Subject is where the beacon is published.
func (b Beacon) Subject() string { return ActivitySubject(b.User, b.Edge) }

// At reads the beacon by the stream's clock, stamped being when the stream
// stored it: the edge's LastActive counts as an age at sending (SentAt -
// LastActive) back from stamped, so an edge whose clock is off by any
// amount changes nothing; the TTL is bounded by MaxBeaconTTL, whatever
// the sender claims.
func (b Beacon) At(stamped time.Time) (lastActive time.Time, ttl time.Duration) {
	return stamped.Add(-max(b.SentAt.Sub(b.LastActive), 0)), min(max(b.TTL, 0), MaxBeaconTTL)
}

// UsageSubject is aaas.usage.<user>.
func UsageSubject(user string) string { return usagePrefix + user }

// UsageSubjectsAll matches every usage event.
const UsageSubjectsAll = usagePrefix + ">"

// UsageEvent is one model call a broker forwarded (or refused after it
// reached the provider). ID is the call's id, also its Nats-Msg-Id.
type UsageEvent struct {
	V        int    `json:"v"`
	ID       string `json:"id"`
	User     string `json:"user"`
	Broker   string `json:"broker"`
	Provider string `json:"provider"`
	Model    string `json:"model"`
	// Status is the HTTP status the provider answered (0: no answer).
	Status       int   `json:"status"`
	Stream       bool  `json:"stream,omitempty"`
	InputTokens  int64 `json:"input_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	CachedTokens int64 `json:"cached_tokens"`
	// CacheWriteTokens are input tokens written to the provider's cache
	// (part of InputTokens, like CachedTokens).
	CacheWriteTokens int64 `json:"cache_write_tokens,omitempty"`
	// Estimated is set when the provider reported no usage and the
	// tokens were estimated from the bytes.
	Estimated  bool          `json:"estimated,omitempty"`
	CostMicros int64         `json:"cost_micros"`
	BYOK       bool          `json:"byok,omitempty"`
	Duration   time.Duration `json:"duration"`
	At         time.Time     `json:"at"`
}

// Subject is where the event is published.
func (e UsageEvent) Subject() string { return UsageSubject(e.User) }

// AuditKind names an audit event.
type AuditKind string

// Audit kinds.
const (
	AuditSignup          AuditKind = "signup"
	AuditLogin           AuditKind = "login"
	AuditLogout          AuditKind = "logout"
	AuditDelete          AuditKind = "delete"
	AuditRecreate        AuditKind = "recreate"
	AuditClaim           AuditKind = "claim"
	AuditWake            AuditKind = "wake"
	AuditSuspend         AuditKind = "suspend"
	AuditHandshake       AuditKind = "handshake"
	AuditHandshakeFailed AuditKind = "handshake_failed"
	AuditRateLimited     AuditKind = "rate_limited"
	AuditInviteRejected  AuditKind = "invite_rejected"
	AuditSSORefused      AuditKind = "sso_refused"
	AuditStateChange     AuditKind = "state"
	AuditCommandFailed   AuditKind = "command_failed"
	AuditAdmin           AuditKind = "admin"
	// AuditCredential is a user storing or deleting their own provider
	// key (BYOK); the key itself is never in it.
	AuditCredential AuditKind = "credential"
	// AuditKeepAwake is a user keeping their sandbox awake (or ending a
	// keep-awake).
	AuditKeepAwake AuditKind = "keepawake"
	// AuditDormant is an account found dormant (DORMANT_AFTER), and its
	// deletion asked for (DORMANT_DELETE_AFTER).
	AuditDormant AuditKind = "dormant"
	// AuditToken is an account's bearer token replaced (by the user, or
	// reset by an administrator); the token is never in it.
	AuditToken AuditKind = "token"
	// AuditRollout is a sleeping sandbox given its profile's new pod
	// template as it wakes (ROLLOUT=next-wake), from revision to revision.
	AuditRollout AuditKind = "rollout"
)

// AuditKinds are every kind, for the audit view's filter.
var AuditKinds = []AuditKind{AuditSignup, AuditLogin, AuditLogout, AuditDelete, AuditRecreate, AuditClaim, AuditWake, AuditSuspend,
	AuditHandshake, AuditHandshakeFailed, AuditRateLimited, AuditInviteRejected, AuditSSORefused, AuditStateChange, AuditCommandFailed,
	AuditAdmin, AuditCredential, AuditKeepAwake, AuditDormant, AuditToken, AuditRollout}

// AuditFilter is the subject filter of the audit events of kind about
// user; "" for either matches any.
func AuditFilter(kind AuditKind, user string) string {
	if kind == "" {
		kind = "*"
	}
	if user == "" {
		user = "*"
	}
	return auditPrefix + string(kind) + "." + user
}

// AuditEvent is one audit record. Detail is free text for humans and must
// never contain a token, cookie or session id.
type AuditEvent struct {
	V         int       `json:"v"`
	Kind      AuditKind `json:"kind"`
	User      string    `json:"user,omitempty"`
	At        time.Time `json:"at"`
	Source    string    `json:"source"`
	Outcome   string    `json:"outcome,omitempty"`
	RequestID string    `json:"request_id,omitempty"`
	Client    string    `json:"client,omitempty"`
	Detail    string    `json:"detail,omitempty"`
}

// Subject is where the event is published.
func (e AuditEvent) Subject() string { return AuditSubject(e.Kind, e.User) }

// Decode parses a message body of any of the types above and checks its
// schema version.
func Decode[T Command | Beacon | AuditEvent | UsageEvent](data []byte) (T, error) {
	var v T
	if err := json.Unmarshal(data, &v); err != nil {
		return v, fmt.Errorf("decode %T: %w", v, err)
	}
	ver, newest := 0, SchemaVersion
	switch m := any(v).(type) {
	case Command:
		ver, newest = m.V, CommandReadsUpTo
	case Beacon:
		ver = m.V
	case AuditEvent:
		ver = m.V
	case UsageEvent:
		ver = m.V
	}
	if ver > newest {
		return v, fmt.Errorf("decode %T: schema version %d, this build reads 1..%d: %w", v, ver, newest, ErrNewerSchema)
	}
	if ver < 1 {
		return v, fmt.Errorf("decode %T: unsupported schema version %d", v, ver)
	}
	return v, nil
}
