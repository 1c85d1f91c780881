// Package state is the model of the gateway's shared state: the records
// the KV buckets hold (sessions, accounts, sandboxes, handshakes, command
// answers, rate-limit logs), their keys, the sandbox phases, and the
// bucket definitions the setup step provisions. kv stores them; every
// process reads and writes them through this one definition.
package state

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
	"unique"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/jsconfig"
)

// Bucket names.
const (
	BucketSessions   = "sessions"
	BucketUsers      = "users"
	BucketSandboxes  = "sandboxes"
	BucketHandshakes = "handshakes"
	BucketRequests   = "requests"
	BucketRateLimit  = "ratelimit"
	BucketLocks      = "locks"
	BucketQueue      = "queue"
	// BucketSigninCodes holds the single-use codes that carry a gateway
	// session to a sandbox origin (subdomain mode).
	BucketSigninCodes = "signin_codes"
	// BucketKeepAwake holds users' keep-awakes (KeepAwake).
	BucketKeepAwake = "keepawake"
)

// BucketsConfig sizes the buckets for an environment.
type BucketsConfig struct {
	Replicas int
	// SessionTTL is COOKIE_MAX_AGE: the longest a session can live.
	SessionTTL time.Duration
	// HandshakeTTL bounds how long a DSH auth cookie is kept.
	HandshakeTTL time.Duration
	// RequestTTL is how long a command's answer waits for its requester.
	RequestTTL time.Duration
	// RateWindow is AUTH_RATE_WINDOW; attempt logs live at most two windows.
	RateWindow time.Duration
	// SigninCodeTTL is SIGNIN_CODE_TTL: how long a sign-in code for a
	// sandbox origin stays good (at most a minute).
	SigninCodeTTL time.Duration
	// Accounts is EXPECTED_ACCOUNTS and SessionsPerUser
	// EXPECTED_SESSIONS_PER_USER: the caps of the buckets whose records
	// grow with accounts are derived from them (MaxBytes).
	Accounts, SessionsPerUser int
}

// DefaultBucketsConfig is the development sizing.
func DefaultBucketsConfig() BucketsConfig {
	return BucketsConfig{
		Replicas:      1,
		SessionTTL:    7 * 24 * time.Hour,
		HandshakeTTL:  23 * time.Hour,
		RequestTTL:    15 * time.Minute,
		RateWindow:    time.Minute,
		SigninCodeTTL: 30 * time.Second,
		// Small enough that every cap is its floor: what a development
		// server (embednats: 6 GiB) can reserve.
		Accounts:        10_000,
		SessionsPerUser: 5,
	}
}

// capacity is how one bucket's cap is derived: record is the most one
// record takes in the store (its subject, headers and JSON, and the
// store's own framing: TestRecordBytes stores the largest record of each
// kind and checks), perMille how many records a thousand accounts hold
// there (sessions: SessionsPerUser each), and floor the cap a small
// deployment keeps. Buckets that traffic fills, not accounts (rate limits,
// command answers, sign-in codes, leases, calls in flight, budgets an
// administrator sets), keep their floor.
type capacity struct {
	record, perMille, floor int64
}

var capacities = map[string]capacity{
	BucketSessions: {record: 640, floor: 512 << 20},
	BucketUsers:    {record: 512, perMille: 1000, floor: 256 << 20},
	// Reason and Detail at MaxReasonLen.
	BucketSandboxes: {record: 1280, perMille: 1000, floor: 256 << 20},
	// A cookie at handshake.MaxCookieLen; one a day per account (the
	// records of pods gone are purged, the rest expire with HandshakeTTL).
	BucketHandshakes:  {record: 1280, perMille: 1000, floor: 512 << 20},
	BucketRequests:    {floor: 256 << 20},
	BucketRateLimit:   {floor: 256 << 20},
	BucketLocks:       {floor: 16 << 20},
	BucketSigninCodes: {floor: 32 << 20},
	// A month's record of an account that calls models (64 recent call
	// ids make it the largest): a month of calls by every account, or a
	// year's by one in twelve.
	BucketUsage:      {record: 2560, perMille: 1000, floor: 256 << 20},
	BucketBudgets:    {floor: 32 << 20},
	BucketModelCalls: {floor: 32 << 20},
	// A provider key of the longest kind; one account in four brings one.
	BucketCredentials: {record: 2048, perMille: 250, floor: 64 << 20},
	// Groups are bounded (MaxGroups), but a user in more than a dozen is
	// rare: a dozen long names is what is budgeted.
	BucketUserGroups: {record: 1024, perMille: 1000, floor: 64 << 20},
	BucketKeepAwake:  {record: 256, perMille: 1000, floor: 16 << 20},
	BucketAPITokens:  {record: 512, perMille: 1000, floor: 64 << 20},
	// Every account waiting at once (a Monday morning under a tight cap).
	BucketQueue: {record: 256, perMille: 1000, floor: 16 << 20},
	// A record per profile, rewritten as its counts change.
	BucketRollouts: {floor: 8 << 20},
}

// MaxBytes is bucket's cap under c: its floor, or what c.Accounts
// accounts hold there, whichever is more.
func (c BucketsConfig) MaxBytes(bucket string) int64 {
	cp := capacities[bucket]
	perMille := cp.perMille
	if bucket == BucketSessions {
		perMille = 1000 * int64(c.SessionsPerUser)
	}
	return max(cp.floor, int64(c.Accounts)*perMille/1000*cp.record)
}

// StoreBytes is what the buckets reserve in all on each NATS node that
// holds a replica of every one (every node, with STREAM_REPLICAS equal to
// the nodes): JetStream reserves each cap against the node's
// max_file_store when the bucket is created.
func (c BucketsConfig) StoreBytes() int64 {
	var sum int64
	for _, bc := range BucketConfigs(c) {
		sum += bc.MaxBytes
	}
	return sum
}

// markerTTL is how long delete markers of expired keys stay, long enough for
// every watcher to see them.
const markerTTL = time.Minute

// BucketConfigs returns every bucket definition. Each has a MaxBytes
// (c.MaxBytes) so that no flood of sessions, handshakes or rate-limit
// entries can fill the JetStream store the others share; a full bucket
// refuses writes, which the edge answers with 503.
func BucketConfigs(c BucketsConfig) []jetstream.KeyValueConfig {
	return []jetstream.KeyValueConfig{
		{Bucket: BucketSessions, Description: "browser sessions by user and sid hash", TTL: c.SessionTTL, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketSessions), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketUsers, Description: "accounts, mirrored from SandboxClaims", MaxBytes: c.MaxBytes(BucketUsers), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketSandboxes, Description: "sandbox phase per user, written by lifecycle", MaxBytes: c.MaxBytes(BucketSandboxes), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketHandshakes, Description: "sealed DSH auth cookies by user, pod and host", TTL: c.HandshakeTTL, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketHandshakes), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketRequests, Description: "outcomes of commands a requester waits for", TTL: c.RequestTTL, MaxBytes: c.MaxBytes(BucketRequests), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketRateLimit, Description: "auth attempts per client per window", TTL: 2 * c.RateWindow, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketRateLimit), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketLocks, Description: "leases for one-active-replica roles", LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketLocks), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketSigninCodes, Description: "single-use sign-in codes for sandbox origins, by sha256 of the code", TTL: c.SigninCodeTTL, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketSigninCodes), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketUsage, Description: "model-call totals per user and month, written by the brokers", TTL: 400 * 24 * time.Hour, MaxBytes: c.MaxBytes(BucketUsage), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketBudgets, Description: "monthly model budgets set by administrators, per user and SSO group", MaxBytes: c.MaxBytes(BucketBudgets), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketModelCalls, Description: "model calls in flight per user, for the concurrency cap", TTL: 24 * time.Hour, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketModelCalls), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketCredentials, Description: "provider keys users brought, sealed to the brokers", MaxBytes: c.MaxBytes(BucketCredentials), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketUserGroups, Description: "SSO groups each user last signed in with", TTL: c.SessionTTL, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketUserGroups), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketKeepAwake, Description: "users' keep-awakes, written by the edges, honoured by the sweeper and lifecycle", TTL: 31 * 24 * time.Hour, LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketKeepAwake), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketAPITokens, Description: "users' named API tokens (hashes), by user and name", LimitMarkerTTL: markerTTL, MaxBytes: c.MaxBytes(BucketAPITokens), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketQueue, Description: "wakes waiting for a free place (MAX_RUNNING_SANDBOXES, MAX_CONCURRENT_STARTS), admitted oldest first", MaxBytes: c.MaxBytes(BucketQueue), Replicas: c.Replicas, Storage: jetstream.FileStorage},
		{Bucket: BucketRollouts, Description: "each profile's rollout: its template's revision and its sandboxes per revision, written by lifecycle", MaxBytes: c.MaxBytes(BucketRollouts), Replicas: c.Replicas, Storage: jetstream.FileStorage},
	}
}

// EnsureBuckets creates the buckets or updates their configuration when it
// differs.
func EnsureBuckets(ctx context.Context, js jetstream.JetStream, c BucketsConfig) error {
	for _, bc := range BucketConfigs(c) {
		if b, err := js.KeyValue(ctx, bc.Bucket); err == nil {
			if st, err := b.Status(ctx); err == nil && jsconfig.Holds(st.Config(), bc) {
				continue
			}
		}
		if _, err := js.CreateOrUpdateKeyValue(ctx, bc); err != nil {
			return fmt.Errorf("ensure bucket %s: %w", bc.Bucket, err)
		}
	}
	return nil
}

// Session is a browser session. Its key is SessionKey(user, sha256(sid)).
type Session struct {
	User    string    `json:"user"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires"`
	// Via says how it started: signup, login, sso, or sandbox for a
	// sandbox origin's session.
	Via string `json:"via"`
	// Host is the sandbox host a sandbox origin's session is for (subdomain
	// mode), "" for a gateway session. A sandbox session holds only on its
	// host and only while what it was made from holds: Parent, the SHA-256
	// (hex) of the gateway session, or for SSO (no gateway session) Bound,
	// the account's binding then.
	Host   string `json:"host,omitempty"`
	Parent string `json:"parent,omitempty"`
	Bound  string `json:"bound,omitempty"`
}

// SigninCode is a single-use code that carries a gateway sign-in to a
// sandbox origin; its key is the hex SHA-256 of the code, which itself
// only ever is in the browser's URL. Parent and Bound are the future
// sandbox session's (see Session).
type SigninCode struct {
	User    string    `json:"user"`
	Host    string    `json:"host"`
	Parent  string    `json:"parent,omitempty"`
	Bound   string    `json:"bound,omitempty"`
	Expires time.Time `json:"expires"`
}

// SessionKey is <user>.<hex sha256 of the session id>.
func SessionKey(user, sidHash string) string { return user + "." + sidHash }

// User is an account, mirrored from its SandboxClaim.
type User struct {
	Name      string    `json:"name"`
	TokenHash string    `json:"token_hash,omitempty"`
	Claim     string    `json:"claim"`
	ClaimUID  string    `json:"claim_uid,omitempty"`
	Managed   bool      `json:"managed"`
	Created   time.Time `json:"created"`
	// RecreatingSince is set while /recreate replaces the claim, so the
	// account survives the moment its old claim is gone.
	RecreatingSince time.Time `json:"recreating_since,omitzero"`
	// DeletingSince is set when a deletion starts: the account's
	// credentials stop working before its sandbox goes.
	DeletingSince time.Time `json:"deleting_since,omitzero"`
	// Sandboxes names the account's named sandboxes (their keys are
	// ident.SandboxKey(Name, name)), its first sandbox aside, oldest
	// first. lifecycle lists a name here before it makes the claim, so
	// MAX_SANDBOXES_PER_USER holds however many creates race, and drops it
	// once the sandbox is gone.
	Sandboxes []string `json:"sandboxes,omitempty"`
}

// Phase is where a user's sandbox is in its life.
type Phase string

// Sandbox phases.
const (
	PhaseClaiming   Phase = "Claiming"
	PhaseWaking     Phase = "Waking"
	PhaseReady      Phase = "Ready"
	PhaseSuspending Phase = "Suspending"
	PhaseSuspended  Phase = "Suspended"
	PhaseDeleting   Phase = "Deleting"
	PhaseFailed     Phase = "Failed"
)

// Running reports whether a sandbox in phase p holds a pod or is getting
// one: what MAX_RUNNING_SANDBOXES counts.
func (p Phase) Running() bool {
	switch p {
	case PhaseClaiming, PhaseWaking, PhaseReady, PhaseSuspending:
		return true
	}
	return false
}

// Queued is a wake waiting for a free place; its key is the user. Only
// lifecycle writes the queue; edges read it to show each waiting user's
// position.
type Queued struct {
	User  string    `json:"user"`
	Since time.Time `json:"since"`
}

// Phases are all the phases, for metrics that report each (zero too).
var Phases = []Phase{PhaseClaiming, PhaseWaking, PhaseReady, PhaseSuspending, PhaseSuspended, PhaseDeleting, PhaseFailed}

// Sandbox is the state of one user's sandbox as lifecycle last saw it.
type Sandbox struct {
	User    string `json:"user"`
	Phase   Phase  `json:"phase"`
	Managed bool   `json:"managed"`
	Claim   string `json:"claim"`
	// Profile is the profile (PROFILES) the claim was made of, as its
	// annotation says; empty: the default (a claim older than profiles,
	// or one adopted).
	Profile string `json:"profile,omitempty"`
	// Revision names the sandbox's pod template (sandbox.Revision: a hash
	// of its pod spec, the same as its SandboxTemplate's until that
	// changes): what its next pod runs.
	Revision string `json:"revision,omitempty"`
	// Halted is the revision a rollout took this sandbox to and rolled it
	// back from, which no sandbox is rolled to again (ROLLOUT).
	Halted  string `json:"halted_revision,omitempty"`
	Sandbox string `json:"sandbox,omitempty"`
	PodName string `json:"pod_name,omitempty"`
	PodUID  string `json:"pod_uid,omitempty"`
	// Address is host:port of the DSH server (pod IP or Service FQDN).
	Address string `json:"address,omitempty"`
	// PodIP is the Ready pod's IP: the address its connections come
	// from, by which the model broker knows whose call it is.
	PodIP  string `json:"pod_ip,omitempty"`
	Reason string `json:"reason,omitempty"`
	// ReadySince is when the sandbox last became Ready; the sweeper uses it
	// as the idle clock of a sandbox nobody has touched through the gateway.
	ReadySince time.Time `json:"ready_since,omitzero"`
	// LastSuspend is the gateway's last suspend of the sandbox, kept
	// after it wakes (nil: never suspended by this gateway).
	LastSuspend *Suspension `json:"last_suspend,omitempty"`
	Updated     time.Time   `json:"updated"`
}

// SandboxSummary is what the sweeper decides by, of a Sandbox record. It
// is decoded from the same records (the same JSON names, the same schema
// version) and keeps no more than a few words per sandbox: not the pod's
// names and addresses, nor the words of reasons, and its phase one of
// Phases rather than a string of its own. At a million sandboxes a full
// record's copy is most of the sweeper's memory. It is only ever read:
// written back, it would lose what it leaves out, so it refuses to be
// encoded.
type SandboxSummary struct {
	Phase   Phase
	Managed bool
	// readySince and asleep are Unix nanoseconds (0: the zero time).
	readySince, asleep int64
	// profile is the record's profile, one copy of each name however
	// many sandboxes are of it (the zero handle: none).
	profile unique.Handle[string]
}

// sandboxSummaryJSON is the part of a Sandbox record a summary reads.
type sandboxSummaryJSON struct {
	Phase       Phase     `json:"phase"`
	Managed     bool      `json:"managed"`
	Profile     string    `json:"profile,omitempty"`
	ReadySince  time.Time `json:"ready_since,omitzero"`
	LastSuspend *struct {
		At time.Time `json:"at"`
	} `json:"last_suspend,omitempty"`
	Updated time.Time `json:"updated"`
}

// UnmarshalJSON reads a Sandbox record's JSON.
func (s *SandboxSummary) UnmarshalJSON(data []byte) error {
	var r sandboxSummaryJSON
	if err := json.Unmarshal(data, &r); err != nil {
		return err
	}
	asleep := r.Updated
	if r.LastSuspend != nil {
		asleep = r.LastSuspend.At
	}
	phase := r.Phase
	for _, p := range Phases {
		if p == phase {
			phase = p // the constant's bytes, not the decoded copy's
		}
	}
	*s = SandboxSummary{Phase: phase, Managed: r.Managed, readySince: nanos(r.ReadySince), asleep: nanos(asleep)}
	if r.Profile != "" {
		s.profile = unique.Make(r.Profile)
	}
	return nil
}

// Profile is the record's profile ("": none, the default).
func (s SandboxSummary) Profile() string {
	if s.profile == (unique.Handle[string]{}) {
		return ""
	}
	return s.profile.Value()
}

// ErrSummaryWritten is a SandboxSummary given to be written.
var ErrSummaryWritten = errors.New("a sandbox summary is never written: it would drop the fields it leaves out")

// MarshalJSON refuses: see SandboxSummary.
func (SandboxSummary) MarshalJSON() ([]byte, error) { return nil, ErrSummaryWritten }

// ReadySince is the record's ReadySince.
func (s SandboxSummary) ReadySince() time.Time { return fromNanos(s.readySince) }

// Asleep is when a suspended sandbox went to sleep: its last suspend by
// this gateway, or else its record's last change.
func (s SandboxSummary) Asleep() time.Time { return fromNanos(s.asleep) }

func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}

// MaxReasonLen bounds a sandbox's Reason and its last suspension's
// Detail as stored: the text comes from Kubernetes and from the tenant's
// own container (its termination message, up to 4 KiB), and is only shown.
const MaxReasonLen = 256

// Clipped is s with Reason and LastSuspend.Detail cut to MaxReasonLen
// bytes (at a rune boundary, ending in "…" where cut): what lifecycle
// stores, so one record's size is bounded whatever a pod says.
func (s Sandbox) Clipped() Sandbox {
	s.Reason = clip(s.Reason)
	if ls := s.LastSuspend; ls != nil && len(ls.Detail) > MaxReasonLen {
		c := *ls
		c.Detail = clip(c.Detail)
		s.LastSuspend = &c
	}
	return s
}

func clip(s string) string {
	if len(s) <= MaxReasonLen {
		return s
	}
	const mark = "…"
	cut := MaxReasonLen - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// Suspension is one suspend the gateway carried out: when, why (an
// idle.Reason) and the decision in words. Lifecycle writes it on the
// Sandbox object with the suspend itself (sandbox.SuspendAnnotation).
type Suspension struct {
	At     time.Time `json:"at"`
	Reason string    `json:"reason"`
	Detail string    `json:"detail,omitempty"`
}

// KeepAwake is a user's request to keep their sandbox awake until Until
// (POST /_/keepawake, at most MAX_KEEPAWAKE ahead). Its key is the user;
// edges write it, the sweeper and lifecycle honour it.
type KeepAwake struct {
	Until time.Time `json:"until"`
	At    time.Time `json:"at"`
}

// Holds reports whether the keep-awake still holds at now.
func (k KeepAwake) Holds(now time.Time) bool { return now.Before(k.Until) }

// Handshake is the outcome of a DSH launch-token handshake for one
// (user, pod, host). Exactly one of Sealed and Error is set.
type Handshake struct {
	User   string `json:"user"`
	PodUID string `json:"pod_uid"`
	Host   string `json:"host"`
	// Sealed is the DSH auth cookie ("name=value"), AES-GCM sealed.
	Sealed []byte    `json:"sealed,omitempty"`
	Error  string    `json:"error,omitempty"`
	At     time.Time `json:"at"`
}

// HandshakeKey is <user>.<pod uid>.<HostKey(host)>: the one way edge and
// lifecycle name a handshake.
func HandshakeKey(user, podUID, host string) string { return user + "." + podUID + "." + HostKey(host) }

// HostKey is a browser host as a key token: the first 8 bytes of the
// SHA-256 of its lower-cased form, in hex (hosts contain dots and colons,
// which keys and subjects cannot).
func HostKey(host string) string {
	sum := sha256.Sum256([]byte(strings.ToLower(host)))
	return hex.EncodeToString(sum[:8])
}

// Result is the answer to a command someone waits for.
type Result struct {
	RequestID string `json:"request_id"`
	Verb      string `json:"verb"`
	User      string `json:"user"`
	// Outcome is created, conflict, deleted, recreated or failed.
	Outcome string    `json:"outcome"`
	Error   string    `json:"error,omitempty"`
	At      time.Time `json:"at"`
}

// Outcomes.
const (
	OutcomeCreated   = "created"
	OutcomeConflict  = "conflict"
	OutcomeDeleted   = "deleted"
	OutcomeRecreated = "recreated"
	OutcomeReplaced  = "replaced"
	OutcomeFailed    = "failed"
)

// Attempts is one client's recent auth attempts (Unix milliseconds), the
// sliding log behind the shared rate limit.
type Attempts struct {
	At []int64 `json:"at"`
	// Refused is when a refusal of this client was last audited (Unix
	// milliseconds): at most one audit event per client per window.
	Refused int64 `json:"refused,omitempty"`
}

// ValidRevision reports whether r has a revision's shape (sandbox.Revision):
// eight lower-case hex digits.
func ValidRevision(r string) bool {
	if len(r) != 8 {
		return false
	}
	for _, c := range r {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
