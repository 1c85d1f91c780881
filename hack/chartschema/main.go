// Command chartschema writes the chart's values.schema.json from
// internal/config (package chartschema):
//
//	go run ./hack/chartschema
package main

import (
	"fmt"
	"os"

	"github.com/aaas-project/aaas/internal/dev/chartschema"
)

func main() {
	b, err := chartschema.Generate()
	if err == nil {
		err = os.WriteFile(chartschema.Path, b, 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "chartschema:", err)
		os.Exit(1)
	}
}
