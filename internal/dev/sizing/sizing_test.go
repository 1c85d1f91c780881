package sizing

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestREADMEHasTheCodesSizing: the table in README is what the caps setup
// derives come to; after changing a cap, run go run ./hack/sizing.
func TestREADMEHasTheCodesSizing(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "..", Path))
	if err != nil {
		t.Fatal(err)
	}
	want, err := Update(readme)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readme, want) {
		t.Fatalf("README's sizing table is stale; run go run ./hack/sizing. It should read:\n%s", Table(5))
	}
}
