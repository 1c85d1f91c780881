package kv

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
)

// Records carry their schema version, so that processes of two releases
// can share a bucket during an upgrade (and a rollback) without one
// silently losing what the other wrote. A record type says its version
// (Versioned); kv writes it as the record's first field, "v", and on
// reading:
//
//   - the same version: decoded as it is;
//   - an older one: brought up to date first, one version at a time, by
//     the type's Migrate (version 0, a record from before versions, is
//     version 1's schema: nothing to do);
//   - a newer one: refused (ErrNewerRecord), never decoded into a type
//     that would drop the fields it does not know. Get and Mutate return
//     the error; a Cache leaves the key out and counts it (NewerRecords).
//
// README's version-skew policy says when a release may start writing a
// new version: only once every process that reads it can.

// Versioned is a record type with a schema version: the version this
// release writes and the newest it reads.
type Versioned interface {
	SchemaVersion() int
}

// Migrating is a Versioned type whose older records need more than a
// decode: Migrate turns a record of version from (≥ 1) into one of
// from+1, field by field.
type Migrating interface {
	Migrate(from int, fields map[string]json.RawMessage) error
}

// ErrNewerRecord is a record written by a newer release, in a schema this
// one does not know.
var ErrNewerRecord = errors.New("written by a newer release of aaas, whose schema this release does not read: upgrade this process")

// newerRecords counts the records refused as newer, over every bucket.
var newerRecords atomic.Uint64

// NewerRecords is how many records this process has refused as written by
// a newer release (aaas_kv_newer_records_total).
func NewerRecords() uint64 { return newerRecords.Load() }

// schemaVersion is T's schema version (0: T is not versioned).
func schemaVersion[T any]() int {
	var zero T
	if v, ok := any(zero).(Versioned); ok {
		return v.SchemaVersion()
	}
	return 0
}

// Encode is a record as a bucket holds it: v's JSON, with its schema
// version first when T has one. For writers that publish records
// themselves (a benchmark filling a bucket in bulk).
func Encode[T any](v T) ([]byte, error) { return encode(v) }

// encode is v's JSON, with its schema version first when T has one.
func encode[T any](v T) ([]byte, error) {
	data, err := json.Marshal(v)
	ver := schemaVersion[T]()
	if err != nil || ver == 0 || len(data) < 2 || data[0] != '{' {
		return data, err
	}
	head := strconv.AppendInt([]byte(`{"v":`), int64(ver), 10)
	if len(data) == 2 { // {}
		return append(head, '}'), nil
	}
	return append(append(head, ','), data[1:]...), nil
}

// decodeInto decodes data into v, migrating an older record and refusing
// a newer one (ErrNewerRecord).
func decodeInto[T any](data []byte, v *T) error {
	want := schemaVersion[T]()
	if want == 0 {
		return json.Unmarshal(data, v)
	}
	got, err := recordVersion(data)
	if err != nil {
		return err
	}
	switch {
	case got > want:
		newerRecords.Add(1)
		return fmt.Errorf("schema version %d, this release reads up to %d: %w", got, want, ErrNewerRecord)
	case got < want && want > 1:
		if data, err = migrate[T](data, max(got, 1), want); err != nil {
			return err
		}
	}
	return json.Unmarshal(data, v)
}

// recordVersion is a record's "v" (0 when it has none): read from the
// front, where encode puts it, or else from the whole record.
func recordVersion(data []byte) (int, error) {
	const prefix = `{"v":`
	if len(data) > len(prefix) && string(data[:len(prefix)]) == prefix {
		end := len(prefix)
		for end < len(data) && data[end] >= '0' && data[end] <= '9' {
			end++
		}
		if n, err := strconv.Atoi(string(data[len(prefix):end])); err == nil && end < len(data) && (data[end] == ',' || data[end] == '}') {
			return n, nil
		}
	}
	var probe struct {
		V int `json:"v"`
	}
	if err := json.Unmarshal(data, &probe); err != nil {
		return 0, err
	}
	return probe.V, nil
}

// migrate brings a record of version from up to version to with T's
// Migrate, one version at a time.
func migrate[T any](data []byte, from, to int) ([]byte, error) {
	var zero T
	m, ok := any(zero).(Migrating)
	if !ok {
		return nil, fmt.Errorf("a record of schema version %d, and %T has no migration to %d", from, zero, to)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(data, &fields); err != nil {
		return nil, err
	}
	for v := from; v < to; v++ {
		if err := m.Migrate(v, fields); err != nil {
			return nil, fmt.Errorf("migrate %T from schema version %d: %w", zero, v, err)
		}
	}
	delete(fields, "v")
	return json.Marshal(fields)
}
