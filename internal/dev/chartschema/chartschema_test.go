package chartschema

import (
	"encoding/json"
	"testing"

	"github.com/aaas-project/aaas/internal/config"
)

// TestChartManagedNamesAreSettings: every name the chart claims for itself
// is a variable some process reads (a renamed one would otherwise slip
// into values.config unnoticed), and none of them is accepted there.
func TestChartManagedNamesAreSettings(t *testing.T) {
	read := map[string]bool{}
	for _, s := range config.Settings() {
		read[s.Name] = true
	}
	b, err := Generate()
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Properties struct {
			Config struct{ Properties map[string]map[string]any }
		}
	}
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	for name := range ChartManaged {
		if !read[name] {
			t.Errorf("ChartManaged names %s, which no process reads", name)
		}
		if schema.Properties.Config.Properties[name] != nil {
			t.Errorf("config accepts %s, which the chart sets", name)
		}
	}
	// Positive control: a setting of each kind is there, typed.
	for name, want := range map[string]string{"MAX_USERS": "integer", "COOKIE_SECURE": "boolean", "IDLE_TIMEOUT": "string", "ADMIN_USERS": "string"} {
		if got := schema.Properties.Config.Properties[name]["type"]; got != want {
			t.Errorf("config.%s is %v, want %s", name, got, want)
		}
	}
	if got := schema.Properties.Config.Properties["LOG_LEVEL"]["enum"]; got == nil {
		t.Error("config.LOG_LEVEL has no enum")
	}
}
