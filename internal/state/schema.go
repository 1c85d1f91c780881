package state

// Schema versions of the records the buckets hold (kv.Versioned): the
// version this release writes, and the newest it reads. Version 1 is the
// schema each record had before records carried one, so a record written
// by an earlier release reads as version 1.
//
// Changing a record's JSON in a way an older reader would misread (a
// field renamed, retyped or given new meaning; a new field an older
// writer would drop on a read-modify-write) takes a new version: a
// Migrate from the previous one (kv.Migrating) with its test, and the
// version-skew policy's two steps (README, "Upgrades and version skew"):
// one release that reads the new version and still writes the old, then
// the next that writes it.

func (Session) SchemaVersion() int    { return 1 }
func (SigninCode) SchemaVersion() int { return 1 }
func (User) SchemaVersion() int       { return 1 }
func (Queued) SchemaVersion() int     { return 1 }
func (Sandbox) SchemaVersion() int    { return 1 }

func (KeepAwake) SchemaVersion() int  { return 1 }
func (Handshake) SchemaVersion() int  { return 1 }
func (Result) SchemaVersion() int     { return 1 }
func (Attempts) SchemaVersion() int   { return 1 }
func (Usage) SchemaVersion() int      { return 1 }
func (Budget) SchemaVersion() int     { return 1 }
func (ModelCalls) SchemaVersion() int { return 1 }
func (Credential) SchemaVersion() int { return 1 }
func (UserGroups) SchemaVersion() int { return 1 }
func (Rollout) SchemaVersion() int    { return 1 }

// A summary reads the records Sandbox reads: the same version (and, the
// day Sandbox migrates, the same migrations; a test holds them together).
func (SandboxSummary) SchemaVersion() int { return Sandbox{}.SchemaVersion() }
