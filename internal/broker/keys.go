package broker

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/aaas-project/aaas/internal/config"
)

// LoadKeys reads each provider's key from dir/<name> (a mounted Secret;
// surrounding white space trimmed). A provider without a file has no key.
// Errors name the file, never its contents.
func LoadKeys(dir string, providers []config.Provider) (map[string]string, error) {
	keys := map[string]string{}
	for _, p := range providers {
		path := filepath.Join(dir, p.Name)
		b, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("provider %s key: %w", p.Name, err)
		}
		k := strings.TrimSpace(string(b))
		if k == "" {
			return nil, fmt.Errorf("provider %s key: %s is empty", p.Name, path)
		}
		if strings.ContainsAny(k, "\r\n\x00") {
			return nil, fmt.Errorf("provider %s key: %s holds more than one line", p.Name, path)
		}
		keys[p.Name] = k
	}
	return keys, nil
}
