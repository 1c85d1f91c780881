package state

// RecordBytes is the most one record of bucket is budgeted to take.
func RecordBytes(bucket string) int64 { return capacities[bucket].record }

// SandboxSummaryJSON is the part of a Sandbox record a summary reads.
type SandboxSummaryJSON = sandboxSummaryJSON
