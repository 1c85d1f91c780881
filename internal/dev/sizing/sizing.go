// Package sizing writes README's sizing table from the caps setup derives
// (state's and events' StoreBytes), so the table an operator sizes NATS by
// is the code's own arithmetic:
//
//	go run ./hack/sizing
package sizing

import (
	"bytes"
	"fmt"
	"os"
	"strings"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/state"
)

// Path is README's, from the repository's root.
const Path = "README.md"

// The markers around the generated table.
const (
	begin = "<!-- sizing: written by go run ./hack/sizing -->\n"
	end   = "<!-- /sizing -->\n"
)

// Accounts are the table's rows.
var Accounts = []int{10_000, 100_000, config.DefaultExpectedAccounts, 10_000_000}

// residentPerEntry is what NATS holds in memory per stored entry, measured
// by hack/scale (130-140 bytes at 100k to 1.64M entries); base is a node's
// own.
const (
	residentPerEntry = 140
	residentBase     = 256 << 20
)

// Table is the sizing section's table at sessions per account.
func Table(sessions int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "| `EXPECTED_ACCOUNTS` | sessions bucket | all buckets | each NATS node reserves | `max_file_store` at least | NATS volume | NATS memory (about) |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|\n")
	for _, n := range Accounts {
		bc := state.DefaultBucketsConfig()
		bc.Accounts, bc.SessionsPerUser = n, sessions
		reserve := events.DefaultStreamsConfig().StoreBytes() + bc.StoreBytes()
		store := roundGiB(reserve)
		// Entries: the sessions, the account, its sandbox, a month of
		// usage and one record more (a handshake, a token, groups).
		memory := roundGiB(int64(n)*int64(sessions+4)*residentPerEntry + residentBase)
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %dGi | %dGi | %dGi |\n", n, size(bc.MaxBytes(state.BucketSessions)), size(bc.StoreBytes()), size(reserve), store, store+store/4, memory)
	}
	return b.String()
}

// Update rewrites the table between its markers in readme.
func Update(readme []byte) ([]byte, error) {
	i := bytes.Index(readme, []byte(begin))
	j := bytes.Index(readme, []byte(end))
	if i < 0 || j < i {
		return nil, fmt.Errorf("%s has no %q … %q section", Path, strings.TrimSpace(begin), strings.TrimSpace(end))
	}
	var out bytes.Buffer
	out.Write(readme[:i+len(begin)])
	out.WriteString(Table(config.DefaultExpectedSessionsPerUser))
	out.Write(readme[j:])
	return out.Bytes(), nil
}

// Write updates README in the working directory.
func Write() error {
	readme, err := os.ReadFile(Path)
	if err != nil {
		return err
	}
	out, err := Update(readme)
	if err != nil {
		return err
	}
	return os.WriteFile(Path, out, 0o644)
}

func roundGiB(n int64) int64 { return (n + 1<<30 - 1) >> 30 }

func size(n int64) string {
	if n >= 1<<30 {
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	}
	return fmt.Sprintf("%d MiB", n>>20)
}
