// Command sizing writes README's sizing table from the caps setup derives
// (package sizing):
//
//	go run ./hack/sizing
package main

import (
	"fmt"
	"os"

	"github.com/aaas-project/aaas/internal/dev/sizing"
)

func main() {
	if err := sizing.Write(); err != nil {
		fmt.Fprintln(os.Stderr, "sizing:", err)
		os.Exit(1)
	}
}
