// Command natsauth writes what the NATS identities of an install need.
//
//	go run ./hack/natsauth -secret [-namespace dsh-demo] | kubectl apply -f -
//
// prints the aaas-nats Secret with fresh credentials: an nkey per process
// kind (edge, lifecycle, sweeper, setup) and the NATS route password.
//
//	go run ./hack/natsauth -permissions > manifests/base/nats/permissions.conf
//
// prints the NATS permission table (internal/natsauth) in the server's
// configuration syntax; a test keeps the committed file equal to it, as it
// keeps README.md's table equal to what -table prints.
package main

import (
	"encoding/base64"
	"flag"
	"fmt"
	"os"
	"slices"

	"github.com/aaas-project/aaas/internal/natsauth"
)

func main() {
	secret := flag.Bool("secret", false, "print the aaas-nats Secret with fresh credentials")
	permissions := flag.Bool("permissions", false, "print the permission table as NATS configuration")
	table := flag.Bool("table", false, "print the permission table for README.md")
	namespace := flag.String("namespace", "dsh-demo", "namespace of the Secret")
	flag.Parse()
	switch {
	case *permissions:
		fmt.Print(natsauth.ServerConfig())
	case *table:
		fmt.Print(natsauth.Table())
	case *secret:
		data, err := natsauth.SecretData()
		if err != nil {
			fmt.Fprintln(os.Stderr, "natsauth:", err)
			os.Exit(1)
		}
		keys := make([]string, 0, len(data))
		for k := range data {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		fmt.Printf("apiVersion: v1\nkind: Secret\nmetadata:\n  name: aaas-nats\n  namespace: %s\ntype: Opaque\ndata:\n", *namespace)
		for _, k := range keys {
			fmt.Printf("  %s: %s\n", k, base64.StdEncoding.EncodeToString(data[k]))
		}
	default:
		flag.Usage()
		os.Exit(2)
	}
}
