package broker

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

func TestLoadKeys(t *testing.T) {
	ps := []config.Provider{{Name: "deepseek"}, {Name: "local"}}
	for _, tc := range []struct {
		name  string
		file  string // deepseek's file; "-" for none
		want  string
		error string
	}{
		{"a key, newline trimmed", "sk-abc\n", "sk-abc", ""},
		{"no file: no key", "-", "", ""},
		{"empty", " \n", "", "is empty"},
		{"two lines", "sk-a\nsk-b\n", "", "more than one line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.file != "-" {
				if err := os.WriteFile(filepath.Join(dir, "deepseek"), []byte(tc.file), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			keys, err := LoadKeys(dir, ps)
			if tc.error != "" {
				if err == nil || !strings.Contains(err.Error(), tc.error) || strings.Contains(err.Error(), "sk-") {
					t.Fatalf("error %v, want one saying %q without the key", err, tc.error)
				}
				return
			}
			if err != nil || keys["deepseek"] != tc.want || len(keys) > 1 {
				t.Fatalf("keys %v, %v", keys, err)
			}
		})
	}
}
