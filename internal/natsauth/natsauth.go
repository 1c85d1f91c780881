// Package natsauth says who may do what on the control bus. Each process
// kind has one NATS identity (an nkey), allowed exactly the subjects it
// uses: its commands, its beacons or audit events, and the JetStream API
// and KV subjects of the streams and buckets it reads or writes. Only the
// setup identity may create, change or delete streams, buckets and
// consumers. The table here is the only definition: the NATS server
// configuration in manifests/base (nats-permissions.conf) is generated from
// it, the embedded servers of make run and the tests load it, and a test
// runs every flow under it.
package natsauth

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// Role is a process kind, and its NATS identity.
type Role string

const (
	Edge      Role = "edge"
	Lifecycle Role = "lifecycle"
	Sweeper   Role = "sweeper"
	// Broker is the model-API broker (cmd/broker).
	Broker Role = "broker"
	// Setup provisions streams, buckets and consumers, restores backups,
	// and does nothing else.
	Setup Role = "setup"
	// Backup copies every stream and bucket (setup backup).
	Backup Role = "backup"
)

// Roles are the identities a deployment has, in the order the
// configuration lists them.
var Roles = []Role{Edge, Lifecycle, Sweeper, Broker, Setup, Backup}

// ParseRole is the role named s, or an error naming the roles there are.
func ParseRole(s string) (Role, error) {
	if r := Role(s); slices.Contains(Roles, r) {
		return r, nil
	}
	names := make([]string, len(Roles))
	for i, r := range Roles {
		names[i] = string(r)
	}
	return "", fmt.Errorf("no identity %q: the identities are %s", s, strings.Join(names, ", "))
}

// Permissions are the subjects an identity may publish to and subscribe
// to; anything not listed is refused by the server.
type Permissions struct {
	Publish   []string
	Subscribe []string
}

// InboxPrefix is the prefix of the role's reply subjects, so that no
// identity can read another's replies.
func (r Role) InboxPrefix() string { return "_INBOX_" + string(r) }

// grant is what a role does on the bus; the permission table is derived
// from it, and so are the streams and buckets the role waits for at start.
type grant struct {
	// writes and reads are buckets (writing includes reading).
	writes, reads []string
	// publishes are subjects of streams the role appends to.
	publishes []string
	// consumes are streams the role reads through its own ephemeral
	// ordered consumers; gets are streams it reads single messages of.
	consumes, gets []string
	// durable is the consumer the role pulls from (created by setup).
	durable *durable
	// api is raw JetStream API access (setup only), restoring backups
	// included.
	api bool
	// snapshots is taking snapshots of every stream aaas keeps, and
	// nothing else (backup only).
	snapshots bool
}

type durable struct{ stream, name string }

var grants = map[Role]grant{
	// Signup, login and logout write sessions and the shared rate limit's
	// log; sign-in on sandbox origins writes and takes the single-use
	// codes, which no other identity may touch (a code is a session to
	// whoever can write one). Accounts, sandboxes, DSH cookies and the
	// rollouts' counts are read only: lifecycle alone writes them. Every command (suspend for the admin view), beacons
	// and audit events; the newest beacons of the users an edge shows (a
	// direct get: the admin view, the user's page). Model
	// spend is read (usage, and the usage stream for the admin's
	// per-call export) and the audit trail (the admin's audit view);
	// budget overrides (admin), users' sealed own
	// keys, the SSO groups users sign in with and users' keep-awakes are
	// written.
	Edge: {
		writes: []string{state.BucketSessions, state.BucketRateLimit, state.BucketSigninCodes, state.BucketBudgets, state.BucketCredentials, state.BucketUserGroups, state.BucketKeepAwake, state.BucketAPITokens},
		reads:  []string{state.BucketUsers, state.BucketSandboxes, state.BucketHandshakes, state.BucketRequests, state.BucketQueue, state.BucketUsage, state.BucketRollouts},
		publishes: append(commandSubjects(events.VerbClaim, events.VerbWake, events.VerbHandshake, events.VerbSuspend, events.VerbDelete, events.VerbRecreate, events.VerbToken),
			events.ActivitySubject("*", "*"), events.AuditSubjectsAll),
		gets: []string{events.StreamActivity},
		// AAAS_ACTIVITY's consumers: the edges of the release before
		// followed the whole stream, and the version-skew policy runs
		// them on this release's permissions. Drop it with the next.
		consumes: []string{events.StreamActivity, events.StreamUsage, events.StreamAudit},
	},
	// The commands' durable consumer (pull and acknowledge only), every
	// record (pruning the sessions of deleted accounts too; the rollouts'
	// counts, which only it can take), and the newest
	// beacon and the keep-awake of a user for compare-and-suspend, and a
	// user's SSO groups for a rollout's canary (ROLLOUT_GROUPS).
	Lifecycle: {
		writes:    []string{state.BucketUsers, state.BucketSandboxes, state.BucketHandshakes, state.BucketRequests, state.BucketSessions, state.BucketLocks, state.BucketQueue, state.BucketAPITokens, state.BucketRollouts},
		reads:     []string{state.BucketKeepAwake, state.BucketUserGroups},
		publishes: []string{events.AuditSubjectsAll},
		gets:      []string{events.StreamActivity},
		durable:   &durable{events.StreamCommands, events.CommandConsumer},
	},
	// Idle clocks from the activity stream, users' keep-awakes, suspend
	// commands and the deletion of dormant accounts (DORMANT_DELETE_AFTER;
	// lifecycle deletes only managed claims), and the lease. No session: NATS cannot tell a purge from a put on a key's
	// subject, so an identity that may remove sessions may forge them, and
	// pruning the sessions of deleted accounts is lifecycle's, which
	// writes them anyway.
	Sweeper: {
		writes:    []string{state.BucketLocks},
		reads:     []string{state.BucketSandboxes, state.BucketUsers, state.BucketQueue, state.BucketKeepAwake},
		publishes: append(commandSubjects(events.VerbSuspend, events.VerbDelete), events.AuditSubjectsAll),
		consumes:  []string{events.StreamActivity},
	},
	// A model call's attribution (sandboxes: the Ready pod's address), the
	// budget that applies (budgets, user_groups) and the user's own key
	// (credentials, sealed to the brokers) are read; what a call spent
	// (usage) and the calls in flight (model_calls) are written, and each
	// call's record and its user's activity published. No command, no
	// audit event, no session: a broker acts on nothing but model calls.
	Broker: {
		writes:    []string{state.BucketUsage, state.BucketModelCalls},
		reads:     []string{state.BucketSandboxes, state.BucketBudgets, state.BucketUserGroups, state.BucketCredentials},
		publishes: []string{events.UsageSubject("*"), events.ActivitySubject("*", "*")},
	},
	Setup: {api: true},
	// Copies of every stream and bucket: it reads all state (sessions'
	// hashes, sealed cookies and keys as they lie in NATS) but can change
	// none; restoring is setup's.
	Backup: {snapshots: true},
}

// Streams are the names of every stream aaas keeps: the event streams,
// then each bucket's (KV_<bucket>), as a backup copies them.
func Streams() []string {
	var names []string
	for _, st := range events.StreamConfigs(events.DefaultStreamsConfig()) {
		names = append(names, st.Name)
	}
	for _, b := range state.BucketConfigs(state.DefaultBucketsConfig()) {
		names = append(names, "KV_"+b.Bucket)
	}
	return names
}

// streamOf is the stream a published subject lands in.
func streamOf(subject string) string {
	for _, st := range events.StreamConfigs(events.DefaultStreamsConfig()) {
		for _, f := range st.Subjects {
			if strings.HasPrefix(subject, strings.TrimSuffix(f, ">")) {
				return st.Name
			}
		}
	}
	panic("natsauth: no stream holds " + subject)
}

// Requires are the streams and buckets the role uses, which must exist
// before it can work.
func (r Role) Requires() (streams, buckets []string) {
	g := r.grant()
	for _, p := range g.publishes {
		streams = append(streams, streamOf(p))
	}
	streams = append(streams, g.consumes...)
	streams = append(streams, g.gets...)
	if g.durable != nil {
		streams = append(streams, g.durable.stream)
	}
	buckets = append(append(buckets, g.writes...), g.reads...)
	slices.Sort(streams)
	slices.Sort(buckets)
	return slices.Compact(streams), slices.Compact(buckets)
}

func (r Role) grant() grant {
	g, ok := grants[r]
	if !ok {
		panic(fmt.Sprintf("natsauth: unknown role %q", r))
	}
	return g
}

// commandSubjects are the subjects of publishing verbs' commands.
func commandSubjects(verbs ...events.Verb) []string {
	var subs []string
	for _, v := range verbs {
		subs = append(subs, events.CommandSubject(v, "*"))
	}
	return subs
}

// Permissions is the role's row of the table: its publish subjects (the
// JetStream API of exactly the streams, buckets and consumers it uses) and
// its own inbox.
func (r Role) Permissions() Permissions {
	g := r.grant()
	var pub []string
	add := func(s ...string) { pub = append(pub, s...) }
	if g.api {
		add("$JS.API.>", "$JS.SNAPSHOT.RESTORE.>")
	}
	if g.snapshots {
		for _, st := range Streams() {
			add("$JS.API.STREAM.INFO."+st, "$JS.API.STREAM.SNAPSHOT."+st, "$JS.SNAPSHOT.ACK."+st+".>")
		}
	}
	streams, _ := r.Requires()
	for _, st := range streams {
		add("$JS.API.STREAM.INFO." + st)
	}
	add(g.publishes...)
	// A bucket is a stream KV_<bucket>: read by direct gets and by the
	// ordered consumers of watches and key listings; written on its keys'
	// subjects.
	for _, b := range append(slices.Clone(g.writes), g.reads...) {
		add("$JS.API.STREAM.INFO.KV_" + b)
		add(directGet("KV_" + b)...)
		add(orderedConsumers("KV_" + b)...)
	}
	for _, b := range g.writes {
		add("$KV." + b + ".>")
	}
	for _, st := range g.gets {
		add(directGet(st)...)
	}
	for _, st := range g.consumes {
		add(orderedConsumers(st)...)
	}
	if d := g.durable; d != nil {
		add("$JS.API.CONSUMER.INFO."+d.stream+"."+d.name, "$JS.API.CONSUMER.MSG.NEXT."+d.stream+"."+d.name, "$JS.ACK."+d.stream+"."+d.name+".>")
	}
	slices.Sort(pub)
	return Permissions{Publish: slices.Compact(pub), Subscribe: []string{r.InboxPrefix() + ".>"}}
}

func directGet(stream string) []string {
	return []string{"$JS.API.DIRECT.GET." + stream, "$JS.API.DIRECT.GET." + stream + ".>"}
}

// orderedConsumers are the subjects of reading a stream through ephemeral
// ordered consumers: create, info, pull, delete, flow control.
func orderedConsumers(stream string) []string {
	return []string{
		"$JS.API.CONSUMER.CREATE." + stream, "$JS.API.CONSUMER.CREATE." + stream + ".>",
		"$JS.API.CONSUMER.INFO." + stream + ".>",
		"$JS.API.CONSUMER.MSG.NEXT." + stream + ".>",
		"$JS.API.CONSUMER.DELETE." + stream + ".>",
		"$JS.FC." + stream + ".>",
	}
}

// server converts the row for an embedded server.
func (p Permissions) server() *server.Permissions {
	return &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: p.Publish},
		Subscribe: &server.SubjectPermission{Allow: p.Subscribe},
	}
}

// ServerConfig is the NATS configuration that defines every role's
// permissions as a variable (EDGE_PERMISSIONS, …), for the server's
// authorization block to refer to. manifests/base/nats-permissions.conf is
// exactly this text.
func ServerConfig() string {
	var b strings.Builder
	b.WriteString("# Generated by internal/natsauth (go run ./hack/natsauth -permissions); do not edit.\n")
	b.WriteString("# Each aaas process kind may publish and subscribe to these subjects only.\n")
	for _, r := range Roles {
		p := r.Permissions()
		fmt.Fprintf(&b, "%s_PERMISSIONS: {\n  publish: {allow: %s}\n  subscribe: {allow: %s}\n}\n", strings.ToUpper(string(r)), list(p.Publish), list(p.Subscribe))
	}
	return b.String()
}

func list(subjects []string) string {
	q := make([]string, len(subjects))
	for i, s := range subjects {
		q[i] = fmt.Sprintf("%q", s)
	}
	return "[\n    " + strings.Join(q, ",\n    ") + "\n  ]"
}

// Identities are a generated set of nkeys, one per role, for a dev stack or
// a test (production keys come from the Secret README describes). Admin is
// an unrestricted identity for test harnesses and tools only; no
// deployment has it.
type Identities struct {
	// Dir holds <role>.nk, each role's seed (mode 0600).
	Dir    string
	public map[Role]string
	// next are the roles' staged next public keys, which servers admit as
	// production's do; their seeds are not kept.
	next map[Role]string
}

// Admin is the harness-only identity with every permission.
const Admin Role = "admin"

// Generate creates a seed per role (and Admin) in dir.
func Generate(dir string) (*Identities, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ids := &Identities{Dir: dir, public: map[Role]string{}, next: map[Role]string{}}
	for _, r := range append(slices.Clone(Roles), Admin) {
		kp, err := nkeys.CreateUser()
		if err != nil {
			return nil, fmt.Errorf("nkey for %s: %w", r, err)
		}
		seed, _ := kp.Seed()
		pub, _ := kp.PublicKey()
		if err := os.WriteFile(ids.SeedFile(r), seed, 0o600); err != nil {
			return nil, err
		}
		ids.public[r] = pub
		if r == Admin {
			continue
		}
		next, err := nkeys.CreateUser()
		if err != nil {
			return nil, fmt.Errorf("nkey for %s: %w", r, err)
		}
		ids.next[r], _ = next.PublicKey()
	}
	return ids, nil
}

// ServerEnv is the environment production's nats.conf reads the roles'
// public keys from (each role's current and staged next key).
func (ids *Identities) ServerEnv() map[string]string {
	env := map[string]string{}
	for _, r := range Roles {
		env[r.NKeyVar(false)], env[r.NKeyVar(true)] = ids.public[r], ids.next[r]
	}
	return env
}

// SeedFile is where role's seed is (NATS_NKEY for its process).
func (ids *Identities) SeedFile(r Role) string { return filepath.Join(ids.Dir, r.SeedKey(false)) }

// Public is role's public key.
func (ids *Identities) Public(r Role) string { return ids.public[r] }

// Users are the embedded server's users: every role's current and staged
// next key with its permissions, as production's nats.conf has them, and
// Admin without limits.
func (ids *Identities) Users() []*server.NkeyUser {
	var users []*server.NkeyUser
	for _, r := range Roles {
		for _, k := range []string{ids.public[r], ids.next[r]} {
			users = append(users, &server.NkeyUser{Nkey: k, Permissions: r.Permissions().server()})
		}
	}
	return append(users, &server.NkeyUser{Nkey: ids.public[Admin]})
}

// SecretData is a fresh set of credentials for a deployment, as the
// aaas-nats Secret holds them: each role's seed (<role>.nk, mounted into
// that process only) and public key (<role>.pub, for the NATS servers),
// each role's staged next identity (<role>.next.nk and .next.pub, which
// the servers accept too, so a rotation has no outage: Rotate), and the
// password NATS nodes authenticate their routes with.
func SecretData() (map[string][]byte, error) {
	data, err := MissingSecretData(nil)
	if err != nil {
		return nil, err
	}
	pw, err := RoutePassword()
	if err != nil {
		return nil, err
	}
	data["route-password"] = []byte(pw)
	return data, nil
}

// SeedKey is the aaas-nats Secret's key holding role's seed; with next,
// its staged next identity's.
func (r Role) SeedKey(next bool) string { return string(r) + nextInfix(next) + ".nk" }

// PublicKey is the aaas-nats Secret's key holding role's public key; with
// next, its staged next identity's.
func (r Role) PublicKey(next bool) string { return string(r) + nextInfix(next) + ".pub" }

// NKeyVar is the NATS servers' environment variable their nats.conf reads
// role's public key from; with next, its staged next identity's.
func (r Role) NKeyVar(next bool) string {
	return "NATS_" + strings.ToUpper(string(r)+strings.ReplaceAll(nextInfix(next), ".", "_")) + "_NKEY"
}

func nextInfix(next bool) string {
	if next {
		return ".next"
	}
	return ""
}

// MissingSecretData is what an existing aaas-nats Secret lacks: the seed
// and public key of each identity it holds neither of (a role a newer
// release brought, or the staged next identities, which the release after
// 0.2.0 brought). An identity held by one key without the other is an
// error, not a reason to replace it.
func MissingSecretData(existing map[string][]byte) (map[string][]byte, error) {
	data := map[string][]byte{}
	for _, r := range Roles {
		for _, next := range []bool{false, true} {
			_, seed := existing[r.SeedKey(next)]
			_, pub := existing[r.PublicKey(next)]
			switch {
			case seed && pub:
				continue
			case seed != pub:
				return nil, fmt.Errorf("the secret holds only one of %s and %s; restore the other or remove both", r.SeedKey(next), r.PublicKey(next))
			}
			if err := newIdentity(data, r, next); err != nil {
				return nil, err
			}
		}
	}
	return data, nil
}

// Rotate is what rotating role's identity changes in the aaas-nats
// Secret: the staged next identity becomes the current one (the NATS
// servers already accept it, as next) and a fresh one is staged. The old
// current key is gone from the Secret, but the servers keep accepting it
// until they restart, so the role's processes can be restarted onto the
// new seed first and NATS after them, without an outage (docs/RUNBOOK.md).
func Rotate(existing map[string][]byte, r Role) (map[string][]byte, error) {
	seed, pub := existing[r.SeedKey(true)], existing[r.PublicKey(true)]
	if len(seed) == 0 || len(pub) == 0 {
		return nil, fmt.Errorf("the secret has no staged identity %s/%s for %s: run setup secrets (the chart's hook) first, and restart NATS so that it accepts it", r.SeedKey(true), r.PublicKey(true), r)
	}
	if _, err := r.Identity(existing, true); err != nil {
		return nil, fmt.Errorf("%w; refusing to rotate onto it", err)
	}
	data := map[string][]byte{r.SeedKey(false): seed, r.PublicKey(false): pub}
	if err := newIdentity(data, r, true); err != nil {
		return nil, err
	}
	return data, nil
}

// Identity is role's (next) public key in the aaas-nats Secret's data,
// once its seed there is checked to be that key's user nkey.
func (r Role) Identity(data map[string][]byte, next bool) (string, error) {
	kp, err := nkeys.FromSeed(data[r.SeedKey(next)])
	if err != nil {
		return "", fmt.Errorf("%s is not an nkey seed: %w", r.SeedKey(next), err)
	}
	pub, err := kp.PublicKey()
	if err != nil || pub != string(data[r.PublicKey(next)]) || !nkeys.IsValidPublicUserKey(pub) {
		return "", fmt.Errorf("%s is not the user key of %s", r.PublicKey(next), r.SeedKey(next))
	}
	return pub, nil
}

// newIdentity puts a fresh user nkey into data as role's (next) identity.
func newIdentity(data map[string][]byte, r Role, next bool) error {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return fmt.Errorf("nkey for %s: %w", r, err)
	}
	s, _ := kp.Seed()
	p, _ := kp.PublicKey()
	data[r.SeedKey(next)], data[r.PublicKey(next)] = s, []byte(p)
	return nil
}

// RoutePassword is a fresh password for the NATS routes: hex, because it
// goes into the routes' URLs unescaped, behind a letter prefix, because
// nats.conf reads it from the environment as a value and would take an
// all-digit string (or one like 12e34) for a number.
func RoutePassword() (string, error) {
	pw := make([]byte, 24)
	if _, err := rand.Read(pw); err != nil {
		return "", err
	}
	return "route-" + hex.EncodeToString(pw), nil
}

// Table is the permission table in words, as README.md shows it (a test
// keeps the two equal).
func Table() string {
	var b strings.Builder
	b.WriteString("| identity | writes buckets | reads buckets | publishes | reads streams |\n|---|---|---|---|---|\n")
	cell := func(xs []string) string {
		if len(xs) == 0 {
			return "—"
		}
		q := make([]string, len(xs))
		for i, x := range xs {
			q[i] = "`" + x + "`"
		}
		return strings.Join(q, ", ")
	}
	for _, r := range Roles {
		g := r.grant()
		streams := append(slices.Clone(g.consumes), g.gets...)
		if g.durable != nil {
			streams = append(streams, g.durable.stream+" (consumer "+g.durable.name+")")
		}
		pubs := g.publishes
		if g.api {
			pubs = []string{"$JS.API.> (creates and updates streams, buckets, consumers)", "$JS.SNAPSHOT.RESTORE.> (restores backups)"}
		}
		if g.snapshots {
			streams = []string{"every stream and bucket, as snapshots only"}
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s |\n", r, cell(g.writes), cell(g.reads), cell(pubs), cell(streams))
	}
	return b.String()
}
